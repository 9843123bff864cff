"""Per-candidate output handling: append a sampled token, detokenise, decide whether it finished."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbd.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from cbd.engine.outputs import CandidateDelta, TokenLogprob
from cbd.engine.sequence import FinishReason, Sequence


@dataclass(slots=True)
class _CandidateText:
    detokenizer: IncrementalDetokenizer | None
    matcher: StopStringMatcher


class OutputProcessor:
    def __init__(
        self, tokenizer: Any | None, eos_token_ids: tuple[int, ...], max_model_len: int, detokenize: bool = True
    ) -> None:
        """detokenize False: only candidates with stop strings are detokenised here (the text decides when
        they stop); the others' deltas carry text "" and whoever reads them detokenises (ipc/text.py)."""
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def attach(self, seq: Sequence) -> None:
        params = seq.request.params
        detok = None
        if self.tokenizer is not None and (self.detokenize or params.stop):
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        seq.output_state = _CandidateText(detok, StopStringMatcher(params.stop))

    def on_token(self, seq: Sequence, position: int, logprob: TokenLogprob | None) -> CandidateDelta:
        """Describe the token now at seq.token_ids[position]; sets seq.finish_reason when it ends."""
        params = seq.request.params
        state: _CandidateText = seq.output_state
        token_id = seq.token_ids[position]
        text, hit = "", False
        reason: FinishReason | None = None
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            reason = FinishReason.STOP
        elif seq.grammar is not None and seq.grammar.finished and position == seq.num_known_tokens - 1:
            # the grammar's end (its stop token): only the newest token can be it (a verifying step's kept
            # drafts never end the grammar, and the matcher has already taken the whole kept run)
            reason = FinishReason.STOP
        elif state.detokenizer is not None:
            text, hit = state.matcher.feed(state.detokenizer.push(token_id))
            if hit:
                reason = FinishReason.STOP
        if reason is None and seq.length_limit_reached(position + 1, self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None and not hit:
            text += state.matcher.flush()  # the held-back tail was not the start of a stop string
        seq.finish_reason = reason
        # index, token_ids, text, logprobs, finish_reason (positional: this runs per sequence per step)
        return CandidateDelta(seq.candidate_index, [token_id], text, None if logprob is None else [logprob], reason)
