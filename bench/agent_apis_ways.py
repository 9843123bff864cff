"""One agent's turns through each API of bench/agent_apis.py: the cbd session API (gRPC), the Responses
API with previous_response_id, and Chat Completions resending the whole history.

Every way sends the same messages: a system prompt and the first tool output, then one tool output (a user
message) per turn; the reply is greedy, at most `new_tokens` long. TTFT is the time from just before the
call is sent to the first generated token (gRPC: the first delta with token ids; HTTP: the first SSE event
that carries text). Prompt and cached token counts come from each API's usage.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from cbd_client import AsyncClient


@dataclass(slots=True)
class Turn:
    ttft: float  # seconds from send to the first generated token
    seconds: float  # from send to the end of the reply
    prompt_tokens: int  # the whole prompt the turn attends over (history + new input)
    cached_tokens: int  # of those, reused (resident session KV or the prefix cache)
    generated: int

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class Script:
    system: str
    tools: list[str]  # one tool output per turn
    new_tokens: int


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


async def grpc_agent(client: AsyncClient, script: Script, snapshots: bool = False) -> list[Turn]:
    """One session per agent; each turn sends only its new message. snapshots: fork the session before each
    continuation into a kept snapshot, as the Responses route does (the fork is inside the turn's TTFT)."""
    session = await client.session()
    kept = []
    turns = []
    try:
        for i, tool in enumerate(script.tools):
            messages = ([{"role": "system", "content": script.system}] if i == 0 else []) + [_user(tool)]
            start = time.perf_counter()
            if snapshots and i > 0:
                kept.append(await session.fork())
            first = None
            usage = None
            async for delta in session.stream(messages, max_tokens=script.new_tokens, temperature=0.0):
                if first is None and delta.token_ids:
                    first = time.perf_counter()
                if delta.usage is not None:
                    usage = delta.usage
            end = time.perf_counter()
            if usage is None:
                raise RuntimeError("a session turn ended without usage")
            turns.append(Turn((first or end) - start, end - start, usage.prompt_tokens, usage.cached_prompt_tokens,
                              usage.completion_tokens))  # fmt: skip
    finally:
        for snapshot in (*kept, session):
            await snapshot.close()
    return turns


async def _events(http: httpx.AsyncClient, path: str, body: dict[str, Any], token: str) -> AsyncIterator[dict]:
    """The JSON of each SSE data line of a streamed call (a non-200 answer raises with its body)."""
    headers = {"Authorization": f"Bearer {token}"}
    async with http.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{path}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


async def responses_agent(http: httpx.AsyncClient, script: Script, token: str) -> list[Turn]:
    """Each turn continues the previous response (previous_response_id) with only its new message."""
    turns = []
    previous = None
    for i, tool in enumerate(script.tools):
        new = ([{"role": "system", "content": script.system}] if i == 0 else []) + [_user(tool)]
        body: dict[str, Any] = {"model": "cbd", "input": new, "max_output_tokens": script.new_tokens,
                                "temperature": 0.0, "stream": True}  # fmt: skip
        if previous is not None:
            body["previous_response_id"] = previous
        start = time.perf_counter()
        first = None
        final: dict[str, Any] | None = None
        async for event in _events(http, "/responses", body, token):
            kind = event.get("type")
            if first is None and kind == "response.output_text.delta" and event.get("delta"):
                first = time.perf_counter()
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
        end = time.perf_counter()
        if final is None or final["status"] == "failed" or final.get("usage") is None:
            raise RuntimeError(f"a Responses turn did not finish: {final}")
        u = final["usage"]
        previous = final["id"]
        turns.append(Turn((first or end) - start, end - start, u["input_tokens"],
                          u["input_tokens_details"]["cached_tokens"], u["output_tokens"]))  # fmt: skip
    return turns


async def chat_agent(http: httpx.AsyncClient, script: Script, token_of_turn: list[str]) -> list[Turn]:
    """Each turn resends the whole conversation, with no session header: a stateless client.
    token_of_turn: the bearer token of each turn (a fresh one per turn: nothing of an earlier turn of
    this caller can be reused, neither the daemon's per-tenant prefix cache nor any gateway-side state)."""
    conversation: list[dict[str, Any]] = [{"role": "system", "content": script.system}]
    turns = []
    for i, tool in enumerate(script.tools):
        conversation.append(_user(tool))
        body = {"model": "cbd", "messages": conversation, "max_tokens": script.new_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        start = time.perf_counter()
        first = None
        usage = None
        reply = []
        async for chunk in _events(http, "/chat/completions", body, token_of_turn[i]):
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    first = first or time.perf_counter()
                    reply.append(text)
            if chunk.get("usage"):
                usage = chunk["usage"]
        end = time.perf_counter()
        if usage is None:
            raise RuntimeError("a chat turn ended without usage")
        conversation.append({"role": "assistant", "content": "".join(reply)})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        turns.append(Turn((first or end) - start, end - start, usage["prompt_tokens"], cached,
                          usage["completion_tokens"]))  # fmt: skip
    return turns
