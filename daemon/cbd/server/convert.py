"""cbd.v1 messages to engine types and back."""

from __future__ import annotations

import math
from collections.abc import Callable

from cbd.engine.outputs import RequestOutput, Usage
from cbd.engine.sampling_params import PRIORITY_BATCH, PRIORITY_INTERACTIVE, SamplingParams
from cbd.engine.sequence import FinishReason
from cbd.errors import InvalidRequest
from cbd.server.tool_call_parser import ToolCallDelta, ToolCallParser
from cbd.server.tool_calls import CallFormat
from cbd_client import contract
from cbd_client.v1 import cbd_pb2 as pb

# The engine's finish reasons carry the contract's names (a reason the contract lacks fails here, at import).
_FINISH: dict[FinishReason | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    **{r: contract.FINISH_REASON_PROTO[contract.FinishReason(r.value)] for r in FinishReason},
}


def priority(value: int) -> int | None:
    """The engine's priority class for a proto Priority; None for UNSPECIFIED."""
    if value == pb.PRIORITY_UNSPECIFIED:
        return None
    classes: dict[int, int] = {pb.PRIORITY_INTERACTIVE: PRIORITY_INTERACTIVE, pb.PRIORITY_BATCH: PRIORITY_BATCH}
    if value not in classes:
        raise InvalidRequest(f"unknown priority {value}")
    return classes[value]


def sampling_params(request: pb.GenerateRequest, tenant: str = "") -> SamplingParams:
    """tenant: the caller's (see CbdService._tenant)."""
    s = request.sampling
    values: dict[str, object] = {"n": request.n or 1, "priority": priority(request.priority), "tenant": tenant}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs"):
        if s.HasField(name):
            values[name] = getattr(s, name)
    return SamplingParams(
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        skip_special_tokens=not s.include_special_tokens,
        **values,  # type: ignore[arg-type]
    )


def _no_text(token_id: int) -> str:
    return ""


def _usage(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        completion_tokens=usage.completion_tokens,
    )


class ToolCallReplies:
    """One streaming parser per candidate of a request whose reply may hold tool calls."""

    def __init__(self, fmt: CallFormat, calls_only: bool = False, formatted: bool = False) -> None:
        self.fmt = fmt
        self.calls_only = calls_only  # tool_choice required or named: no text besides the calls
        self.formatted = formatted  # calls or text in a response format (see ToolCallParser)
        self.parsers: dict[int, ToolCallParser] = {}

    def split(self, index: int, text: str, finished: bool) -> tuple[str, list[ToolCallDelta], bool]:
        """(plain text, call deltas, whether the candidate's reply ended in complete calls)."""
        parser = self.parsers.setdefault(index, ToolCallParser(self.fmt, self.calls_only, self.formatted))
        plain, calls = parser.feed(text)
        if finished:
            plain += parser.finish()
        return plain, calls, finished and bool(parser.complete_calls)


def response(
    output: RequestOutput, replies: ToolCallReplies | None = None, token_text: Callable[[int], str] | None = None
) -> pb.GenerateResponse:
    """token_text: each logprob's token text (PromptEncoder.token_text); none when not given."""
    message = pb.GenerateResponse(request_id=output.request_id)
    for delta in output.candidates:
        text, finish = delta.text, _FINISH[delta.finish_reason]
        calls: list[ToolCallDelta] = []
        if replies is not None:
            text, calls, called = replies.split(delta.index, delta.text, delta.finish_reason is not None)
            if called and delta.finish_reason is FinishReason.STOP:
                finish = pb.FINISH_REASON_TOOL_CALLS
        c = message.candidates.add(index=delta.index, text=text, token_ids=delta.token_ids, finish_reason=finish)
        for call in calls:
            c.tool_calls.add(index=call.index, id=call.id, name=call.name, arguments=call.arguments)
        text_of = token_text or _no_text
        for lp in delta.logprobs or ():
            # Tokens a grammar forbids (logprob -inf) are no alternatives.
            top = [pb.TopLogprob(token_id=t, logprob=v, token=text_of(t)) for t, v in lp.top if v != -math.inf]
            c.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, top=top, token=text_of(lp.token_id))
        if delta.usage is not None:
            c.usage.CopyFrom(_usage(delta.usage))
    if output.usage is not None:
        message.usage.CopyFrom(_usage(output.usage))
    if output.prompt_usage is not None:
        message.prompt_usage.CopyFrom(_usage(output.prompt_usage))
    return message
