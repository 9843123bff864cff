"""cbd Generate streams to the API's objects: whole replies, and chunks for server-sent events.

Chat: `chat.completion` / `chat.completion.chunk`; a choice's message holds its text (None when it only
called tools), its tool calls (id, function name, arguments JSON) and, on request, logprobs
({"content": [{token, logprob, bytes, top_logprobs}]}). Streamed, each choice's first chunk carries
the role, text arrives as content deltas and tool calls as the API streams them (a call's first delta
has its index, id, type and name; later ones fragments of its arguments). Completions: `text_completion`
with the legacy logprobs shape. usage: prompt_tokens, completion_tokens, total_tokens and
prompt_tokens_details.cached_tokens (prompt tokens whose KV was reused: a session's, or a cached prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cbd_client.contract import FINISH_REASON_NAME, FinishReason
from cbd_client.v1 import cbd_pb2 as pb


def finish_reason(value: pb.FinishReason, default: FinishReason | None = None) -> str | None:
    """The API's finish_reason of a candidate's (the contract's names; "abort": the daemon shut down
    before the reply was complete)."""
    name = FINISH_REASON_NAME.get(value, default)
    return None if name is None else name.value


def usage(u: pb.Usage | None) -> dict[str, Any] | None:
    if u is None:
        return None
    return {
        "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }  # fmt: skip


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(c: pb.CandidateDelta) -> list[dict[str, Any]]:
    return [
        {**_entry(lp.token, lp.logprob), "top_logprobs": [_entry(t.token, t.logprob) for t in lp.top]}
        for lp in c.logprobs
    ]


@dataclass(slots=True)
class Choice:
    """One candidate's reply as it accumulates."""

    index: int
    text: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, str]] = field(default_factory=dict)  # index -> id, name, arguments
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, c: pb.CandidateDelta, chat: bool) -> None:
        if c.text:
            self.text.append(c.text)
        for t in c.tool_calls:
            call = self.calls.setdefault(t.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = call["id"] or t.id
            call["name"] = call["name"] or t.name
            call["arguments"] += t.arguments
        if c.logprobs:
            self.logprobs.extend(chat_logprobs(c) if chat else list(c.logprobs))
        if c.finish_reason:
            self.finish_reason = finish_reason(c.finish_reason, FinishReason.STOP)

    def message(self) -> dict[str, Any]:
        """The assistant message (as the API returns it, and as a client sends it back)."""
        text = "".join(self.text)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.calls.items())
            ]
        return message


class Reply:
    """Folds Generate responses into API objects; the same state serves whole replies and streams."""

    def __init__(self, kind: str, request_id: str, created: int, model: str, n: int, logprobs: int | None) -> None:
        self.kind = kind  # "chat" or "completion"
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.created = created
        self.model = model
        self.logprobs = logprobs
        self.choices: dict[int, Choice] = {}
        self.n = n
        self.usage: pb.Usage | None = None
        self._started: set[int] = set()
        self._chars: dict[int, int] = {}  # per choice: characters of its tokens streamed so far (text_offset)

    def _head(self) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def add(self, response: pb.GenerateResponse, offset: int = 0) -> list[dict[str, Any]]:
        """Fold one response in (candidates numbered from `offset`: several prompts of one completion
        request); returns the stream chunks it makes."""
        if response.HasField("usage"):
            self.usage = _sum(self.usage, response.usage)  # one final usage per prompt's stream
        chunks = []
        for c in response.candidates:
            index = offset + c.index
            choice = self.choices.setdefault(index, Choice(index))
            choice.add(c, self.kind == "chat")
            chunk = self._chat_chunk(index, c) if self.kind == "chat" else self._text_chunk(index, c)
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def _chat_chunk(self, index: int, c: pb.CandidateDelta) -> dict[str, Any] | None:
        """The chunk of one candidate's delta; None when it says nothing (no text, call, logprobs or finish:
        tokens that only mark a tool call's start)."""
        delta: dict[str, Any] = {}
        if index not in self._started:
            self._started.add(index)
            delta["role"] = "assistant"
        if c.text or "role" in delta:
            delta["content"] = c.text
        if c.tool_calls:
            calls: dict[int, dict[str, Any]] = {}  # one entry per call in a chunk, as the API streams them
            for t in c.tool_calls:
                call = calls.setdefault(t.index, {"index": t.index, "function": {"arguments": ""}})
                call["function"]["arguments"] += t.arguments
                if t.id:
                    call.update(id=t.id, type="function")
                    call["function"]["name"] = t.name
            delta["tool_calls"] = list(calls.values())
        logprobs = {"content": chat_logprobs(c)} if self.logprobs is not None and c.logprobs else None
        finish = finish_reason(c.finish_reason) if c.finish_reason else None
        if not delta and logprobs is None and finish is None:
            return None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head(), "object": "chat.completion.chunk", "choices": [choice]}

    def _text_chunk(self, index: int, c: pb.CandidateDelta) -> dict[str, Any]:
        finish = finish_reason(c.finish_reason) if c.finish_reason else None
        logprobs = None
        if self.logprobs is not None:  # offsets continue from the tokens this choice has streamed
            start = self._chars.get(index, 0)
            logprobs = _legacy_logprobs(list(c.logprobs), start)
            self._chars[index] = start + sum(len(lp.token) for lp in c.logprobs)
        return {
            **self._head(),
            "choices": [{"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": finish}],
        }

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(), "object": obj, "choices": [], "usage": usage(self.usage)}

    def whole(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            ch = self.choices[index]
            if self.kind == "chat":
                logprobs = {"content": ch.logprobs} if self.logprobs is not None else None
                choices.append({"index": index, "message": ch.message(), "logprobs": logprobs,
                                "finish_reason": ch.finish_reason})  # fmt: skip
            else:
                logprobs = _legacy_logprobs(ch.logprobs) if self.logprobs is not None else None
                choices.append({"index": index, "text": "".join(ch.text), "logprobs": logprobs,
                                "finish_reason": ch.finish_reason})  # fmt: skip
        return {**self._head(), "choices": choices, "usage": usage(self.usage)}


def _legacy_logprobs(items: list[pb.TokenLogprob], start: int = 0) -> dict[str, Any]:
    """The legacy completions API's logprobs of these tokens, the first at character `start` of the text."""
    offsets, at = [], start
    for lp in items:
        offsets.append(at)
        at += len(lp.token)
    return {
        "tokens": [lp.token for lp in items], "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items], "text_offset": offsets,
    }  # fmt: skip


def _sum(a: pb.Usage | None, b: pb.Usage) -> pb.Usage:
    if a is None:
        return b
    return pb.Usage(prompt_tokens=a.prompt_tokens + b.prompt_tokens,
                    cached_prompt_tokens=a.cached_prompt_tokens + b.cached_prompt_tokens,
                    completion_tokens=a.completion_tokens + b.completion_tokens)  # fmt: skip
