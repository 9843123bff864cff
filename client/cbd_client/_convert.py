"""Between the client's Python arguments and results and the cbd.v1 messages."""

from __future__ import annotations

from collections.abc import Sequence

from cbd_client.types import Candidate, Completion, Delta, ModelInfo, SessionInfo, Stats, TokenLogprob, Usage
from cbd_client.v1 import cbd_pb2 as pb

Prompt = str | Sequence[int] | Sequence[dict[str, str]]

_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}
_SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def set_prompt(message: pb.GenerateRequest | pb.TokenizeRequest | pb.OpenSessionRequest, prompt: Prompt) -> None:
    """A str is text; a list of ints is token ids; a list of {"role", "content"} dicts is a chat."""
    if isinstance(prompt, str):
        message.text = prompt
    elif prompt and all(isinstance(m, dict) for m in prompt):
        message.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)  # type: ignore[index]
    elif isinstance(message, (pb.GenerateRequest, pb.OpenSessionRequest)) and all(isinstance(t, int) for t in prompt):
        message.tokens.ids.extend(prompt)  # type: ignore[arg-type]
    else:
        raise TypeError("prompt must be a str, a list of token ids, or a list of chat message dicts")


def generate_request(
    prompt: Prompt, n: int, request_id: str, sampling: dict[str, object], session_id: str = "",
    parent_candidate: int | None = None,
) -> pb.GenerateRequest:  # fmt: skip
    unknown = sorted(set(sampling) - _SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameters {unknown}; known: {sorted(_SAMPLING_FIELDS)}")
    request = pb.GenerateRequest(n=n, request_id=request_id, session_id=session_id)
    if parent_candidate is not None:
        request.parent_candidate = parent_candidate
    set_prompt(request, prompt)
    for name, value in sampling.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            getattr(request.sampling, name).extend(value)
        else:
            setattr(request.sampling, name, value)
    return request


def _usage(message: pb.Usage) -> Usage:
    return Usage(message.prompt_tokens, message.cached_prompt_tokens, message.completion_tokens)


def deltas(response: pb.GenerateResponse) -> list[Delta]:
    out = []
    for c in response.candidates:
        logprobs = tuple(
            TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)) for lp in c.logprobs
        )
        out.append(
            Delta(
                request_id=response.request_id, index=c.index, text=c.text, token_ids=tuple(c.token_ids),
                logprobs=logprobs, finish_reason=_FINISH.get(c.finish_reason),
                usage=_usage(c.usage) if c.HasField("usage") else None,
            )  # fmt: skip
        )
    return out


class CompletionBuilder:
    """Folds a Generate stream into finished candidates."""

    def __init__(self, n: int) -> None:
        self.request_id = ""
        self.candidates = [Candidate(i) for i in range(n)]
        self.usage: Usage | None = None

    def add(self, response: pb.GenerateResponse) -> list[Delta]:
        self.request_id = response.request_id
        if response.HasField("usage"):
            self.usage = _usage(response.usage)
        ds = deltas(response)
        for d in ds:
            c = self.candidates[d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs
            c.finish_reason = d.finish_reason or c.finish_reason
            c.usage = d.usage or c.usage
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
    return SessionInfo(**{f.name: getattr(message, f.name) for f in pb.SessionInfo.DESCRIPTOR.fields})


def open_session_request(prefix: Prompt | None, ttl: float | None) -> pb.OpenSessionRequest:
    request = pb.OpenSessionRequest(ttl_seconds=ttl or 0.0)
    if prefix is not None:
        set_prompt(request, prefix)
    return request
