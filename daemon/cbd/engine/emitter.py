"""Output emission: a completed step's tokens become each request's `RequestOutput`; requests end here
(finished, failed, aborted) and their outputs wait in an outbox until `deliver()`.

Invariants:
- a row whose candidate finished or was aborted while the step was in flight emits nothing (the
  scheduler's `update_from_output` leaves it out); a candidate that finishes drops any token already
  in flight for it and frees its blocks at once (`Scheduler.finish`), keeping its KV for its session;
- a request's record in `live` is released with its last output, and only then (the turn's outcome,
  `turn_ok`, is decided here once, for the engine and the frontend alike);
- outputs are handed to callbacks in the order they were made, only from `deliver()`: the threaded
  engine refreshes its stats snapshot first, so a caller that has seen its request finish never reads
  stats that still count it;
- a request whose params gather its outputs (engine/stream_interval.py) has them held here until due, then
  handed over as one (outputs.merge_outputs' rule): its first token and its end are never held.
Not thread-safe: called from the engine thread only.
"""

from __future__ import annotations

import logging

from cbd.engine.admission import Admission
from cbd.engine.device.runner import SampledTokens
from cbd.engine.live import LiveRequest
from cbd.engine.output_processor import OutputProcessor
from cbd.engine.outputs import CandidateDelta, RequestOutput, TokenLogprob, Usage, merge_deltas
from cbd.engine.sched.plan import SampleRow, StepPlan
from cbd.engine.sched.scheduler import Scheduler
from cbd.engine.sequence import FinishReason, Request, Sequence, SequenceStatus
from cbd.engine.sessions.manager import SessionManager
from cbd.engine.stream_interval import StreamInterval, gathers

log = logging.getLogger(__name__)


class Emitter:
    def __init__(
        self, processor: OutputProcessor, live: Admission, scheduler: Scheduler, sessions: SessionManager
    ) -> None:
        self.processor = processor
        self.live = live
        self.scheduler = scheduler
        self.sessions = sessions
        # Outputs made and not yet handed to their callbacks (see deliver); pairs, in order.
        self._outbox: list[tuple[LiveRequest, RequestOutput]] = []
        self.num_generated_tokens = 0

    def tokens(self, plan: StepPlan, sampled: SampledTokens, rows: list[int]) -> list[RequestOutput]:
        """Describe the token of each live row of a completed step (`rows`: as Scheduler.update_from_output
        answered, after putting the tokens in place), finishing the candidates it ends; one output per
        request that got tokens."""
        deltas: dict[str, tuple[Sequence, list[CandidateDelta]]] = {}
        samples, on_token = plan.samples, self.processor.on_token
        with_logprobs = sampled.logprobs is not None
        ended = False  # some candidate finished: its request may have ended
        finished = SequenceStatus.FINISHED
        for i in rows:
            row = samples[i]
            seq = row.target
            if seq.status is finished:  # it stopped at an earlier token of the drafts it kept: nothing past it
                continue
            delta = on_token(seq, row.position, _logprob(sampled, row, i) if with_logprobs else None)
            if delta.finish_reason is not None:
                ended = True
                seq.cut_after(row.position + 1)  # a token (and drafts) already in flight for it is dropped
                session = seq.request.session
                if session is not None:  # keep its KV for the session's next turn
                    self.sessions.candidate_finished(session, seq)
                if delta.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and (
                    session is None or self.sessions.holds(session)  # a closed session's turn leaves no donor
                ):
                    self.scheduler.speculator.finished(seq)  # its tokens may draft for its tenant's others
                self.scheduler.finish(seq)
                delta.usage = _usage(seq.request, seq.num_output_tokens)
            entry = deltas.get(seq.request.request_id)
            if entry is None:
                deltas[seq.request.request_id] = (seq, [delta])
            else:
                entry[1].append(delta)
        outputs = []
        output = self.output
        for seq, ds in deltas.values():
            self.num_generated_tokens += len(ds)
            outputs.append(output(seq.request, ds if len(ds) == 1 else merge_deltas(ds), ended))
        return outputs

    def fail(self, request: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """End every unfinished candidate of request (and the forks it has not made yet) with reason; error:
        why, when it is the request's doing (RequestOutput.error)."""
        deltas = []
        for seq in request.sequences:
            if not seq.is_finished:
                seq.drop_placeholders()
                self.scheduler.finish(seq)
                seq.finish_reason = reason
                usage = _usage(request, seq.num_output_tokens)
                deltas.append(CandidateDelta(seq.candidate_index, [], "", None, reason, usage))
            for c in range(seq.candidate_index + 1, seq.candidate_index + 1 + seq.pending_forks):
                deltas.append(CandidateDelta(c, [], "", None, reason, _usage(request, 0)))
            seq.pending_forks = 0
        return self.output(request, deltas, error=error)

    def output(
        self, request: Request, deltas: list[CandidateDelta], ended: bool = True, error: str | None = None
    ) -> RequestOutput:
        """The request's output of these deltas; a finished request's ends its turn and releases its record.
        ended False: no candidate finished since the last output (the request cannot have ended). What is
        handed over may be this output merged with ones held before it (the stream interval): complete it
        here (`error`), never after."""
        out = RequestOutput(request.request_id, deltas, error=error)
        if not request.queue_reported and request.first_scheduled is not None:
            out.queue_seconds = request.first_scheduled - request.arrival_time
            out.priority = request.priority
            out.prompt_usage = _usage(request, 0)
            request.queue_reported = True
        if ended and request.is_finished:
            if request.session is not None:
                ok = all(sq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for sq in request.sequences)
                out.turn_ok = ok and len(request.sequences) == request.params.n  # the frontend's chat log follows it
                self.sessions.end_turn(request.session, request, out.turn_ok)
            out.finished = True
            out.usage = _usage(request, sum(s.num_output_tokens for s in request.sequences))
            live = self.live.release(request.request_id)
        else:
            live = self.live.get(request.request_id)
        if live is not None and live.on_output is not None:
            gathering = request.gathering
            if gathering is None:  # its first output: gathered or not, by its params (and then its class)
                p = request.params
                gathers_any = gathers(p.stream_interval, p.batch_stream_interval)
                gathering = (
                    StreamInterval(p.stream_interval, p.batch_stream_interval, p.priority) if gathers_any else False
                )
                request.gathering = gathering
            if gathering is False:
                self._outbox.append((live, out))
            else:
                due = gathering.add(out)
                if due is not None:
                    self._outbox.append((live, due))
                if out.priority is not None and gathering.passes_each:  # its class's interval is 1
                    request.gathering = False
        return out

    def deliver(self) -> None:
        """Hand the outputs made since the last call to their requests' callbacks, in order."""
        outbox, self._outbox = self._outbox, []
        for live, out in outbox:
            try:
                live.on_output(out)  # type: ignore[misc]
            except Exception:
                log.exception("output callback for %s failed", live.request_id)


def _usage(request: Request, completion_tokens: int) -> Usage:
    return Usage(len(request.prompt_token_ids), request.num_cached_prompt_tokens, completion_tokens)


def _logprob(sampled: SampledTokens, row: SampleRow, i: int) -> TokenLogprob | None:
    if sampled.logprobs is None:
        return None
    want = row.source.request.params.logprobs
    if want is None:
        return None
    top = []
    if want and sampled.top_ids is not None and sampled.top_logprobs is not None:
        top = list(zip(sampled.top_ids[i][:want], sampled.top_logprobs[i][:want]))
    return TokenLogprob(sampled.token_ids[i], sampled.logprobs[i], top)
