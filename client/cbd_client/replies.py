"""The daemon's replies as the client API's plain types, and the one fold of output deltas.

`add_delta` is the only place where a Delta joins its candidate (text, tokens, logprobs, tool-call
fragments, finish reason, usage): `CompletionBuilder` (generate) and `replay.Replay` (a recovered
stream) both call it. A tool call's first delta has its id and name, the later ones fragments of its
arguments, in index order.
"""

from __future__ import annotations

from cbd_client.contract import FINISH_REASON_NAME, KV_TIER_NAME, PRIORITY_NAME, RETENTION_NAME
from cbd_client.types import (
    Candidate,
    Completion,
    Delta,
    ModelInfo,
    SessionInfo,
    Stats,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)  # fmt: skip
from cbd_client.v1 import cbd_pb2 as pb


def usage(message: pb.Usage) -> Usage:
    return Usage(message.prompt_tokens, message.cached_prompt_tokens, message.completion_tokens)


def deltas(response: pb.GenerateResponse) -> list[Delta]:
    """One Delta per candidate in a Generate response."""
    out = []
    for c in response.candidates:
        logprobs = tuple(
            TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)) for lp in c.logprobs
        )
        finish = FINISH_REASON_NAME.get(c.finish_reason)
        out.append(
            Delta(
                request_id=response.request_id,
                index=c.index,
                text=c.text,
                token_ids=tuple(c.token_ids),
                logprobs=logprobs,
                finish_reason=None if finish is None else finish.value,
                usage=usage(c.usage) if c.HasField("usage") else None,
                tool_calls=tuple(ToolCallDelta(t.index, t.id, t.name, t.arguments) for t in c.tool_calls),
            )  # fmt: skip
        )
    return out


def add_delta(c: Candidate, d: Delta) -> None:
    """Fold a delta into its candidate."""
    c.text += d.text
    c.token_ids += d.token_ids
    c.logprobs += d.logprobs
    c.finish_reason = d.finish_reason or c.finish_reason
    c.usage = d.usage or c.usage
    for t in d.tool_calls:
        if t.index == len(c.tool_calls):
            c.tool_calls.append(ToolCall(t.id, t.name))
        c.tool_calls[t.index].arguments += t.arguments


class CompletionBuilder:
    """Folds a Generate stream into finished candidates."""

    def __init__(self, n: int) -> None:
        self.request_id = ""
        self.candidates = [Candidate(i) for i in range(n)]
        self.usage: Usage | None = None

    def add(self, response: pb.GenerateResponse) -> list[Delta]:
        self.request_id = response.request_id
        if response.HasField("usage"):
            self.usage = usage(response.usage)
        ds = deltas(response)
        for d in ds:
            add_delta(self.candidates[d.index], d)
        return ds

    def result(self) -> Completion:
        return Completion(self.request_id, self.candidates, self.usage)


def model_info(message: pb.ModelInfo) -> ModelInfo:
    values = {f.name: getattr(message, f.name) for f in pb.ModelInfo.DESCRIPTOR.fields}
    values["eos_token_ids"] = tuple(values["eos_token_ids"])
    return ModelInfo(**values)


def stats(message: pb.Stats) -> Stats:
    return Stats(**{f.name: getattr(message, f.name) for f in pb.Stats.DESCRIPTOR.fields})


def session_info(message: pb.SessionInfo) -> SessionInfo:
    """Enum fields as their contract names (plain str); an unset or unknown value as its default."""
    values = {f.name: getattr(message, f.name) for f in pb.SessionInfo.DESCRIPTOR.fields}
    tier, retention, priority = (KV_TIER_NAME.get(message.kv_tier), RETENTION_NAME.get(message.retention),
                                 PRIORITY_NAME.get(message.priority))  # fmt: skip
    values["kv_tier"] = "none" if tier is None else tier.value
    values["retention"] = "normal" if retention is None else retention.value
    values["expected_idle_ms"] = message.expected_idle_ms if message.HasField("expected_idle_ms") else None
    values["priority"] = "interactive" if priority is None else priority.value
    return SessionInfo(**values)
