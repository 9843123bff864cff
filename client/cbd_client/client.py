"""Blocking client.

    from cbd_client import Client
    with Client() as client:                       # the default unix socket, or "host:port"
        print(client.generate("Hello", max_tokens=16, temperature=0).text)

Sampling keyword arguments: max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids,
ignore_eos, logprobs, include_special_tokens (see proto/cbd/v1/cbd.proto for their meaning).
Structured output: tools=, tool_choice=, parallel_tool_calls=, response_format= (see cbd_client.structured); a candidate's
tool calls are `candidate.tool_calls`, and a streamed Delta carries `tool_calls` pieces.
A prompt is a str (text), a list of ints (token ids) or a list of {"role", "content"} dicts (chat).
Routing: affinity= "<key>" on a plain request (not a session's) makes a proxy in front of several daemons
send every call with that key to the same one, e.g. a name for a long system prompt, so its prefix-cache
hits survive scale-out. Scheduling keywords: priority= "interactive" (default) | "batch", tenant= (fair share between callers; the
auth token's name when the daemon checks tokens). stream_interval= N: a streamed message at most every N tokens of a
candidate (default: 1 for interactive, the daemon's setting for batch). Session turns (and `session()`) also take retention hints: expected_idle_ms= (how long the agent will
be away after the turn, e.g. while a tool runs) and retention= "low" | "normal" | "high".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import grpc

from cbd_client import calls, readiness, replies
from cbd_client.address import default_address, tls_credentials
from cbd_client.errors import CbdError
from cbd_client.routing import Routes, affinity_key, with_affinity
from cbd_client.session import Session
from cbd_client.types import Completion, Delta, ModelInfo, Prompt, SessionInfo, Stats
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1.cbd_pb2_grpc import CbdStub

R = TypeVar("R")


class Client:
    def __init__(
        self,
        address: str | None = None,
        timeout: float | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        """token: the daemon's bearer token (auth_token_file). tls_ca: PEM file of the CA that signed the
        daemon's certificate (TCP with TLS); tls_cert / tls_key: this client's certificate (mutual TLS)."""
        self.address = address or default_address()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._routes = Routes()  # the replica a proxy chose per affinity key (routing.py)
        self.timeout = timeout  # default deadline per call, in seconds
        if tls_ca:
            self._channel = grpc.secure_channel(self.address, tls_credentials(tls_ca, tls_cert, tls_key))
        else:
            self._channel = grpc.insecure_channel(self.address)
        self._stub = CbdStub(self._channel)

    def generate(
        self,
        prompt: Prompt,
        *,
        n: int = 1,
        timeout: float | None = None,
        **options: Any,
    ) -> Completion:
        """Run to completion and return every candidate. options: request_id, session_id, parent_candidate,
        tools, tool_choice, response_format and the sampling keywords (see the module docstring)."""
        builder = replies.CompletionBuilder(n)
        with contextlib.closing(self._responses(calls.generate(prompt, n, options), timeout)) as responses:
            for response in responses:
                builder.add(response)
        return builder.result()

    def stream(
        self,
        prompt: Prompt,
        *,
        n: int = 1,
        timeout: float | None = None,
        **options: Any,
    ) -> Iterator[Delta]:
        """Yield deltas as they arrive; leaving the loop early cancels the request on the daemon."""
        with contextlib.closing(self._responses(calls.generate(prompt, n, options), timeout)) as responses:
            for response in responses:
                yield from replies.deltas(response)

    def tokenize(self, prompt: str | list[dict[str, str]], allow_special_tokens: bool = False) -> list[int]:
        """allow_special_tokens: special-token strings in a text prompt become their tokens (raw mode)."""
        return self._run(calls.tokenize(prompt, allow_special_tokens))

    def model_info(self) -> ModelInfo:
        return self._run(calls.model_info())

    def stats(self) -> Stats:
        return self._run(calls.stats())

    def session(
        self, prefix: Prompt | None = None, ttl: float | None = None, session_id: str | None = None,
        recover: bool = False, *, expected_idle_ms: int | None = None, retention: str | None = None,
        priority: str | None = None,
    ) -> Session:  # fmt: skip
        """Open a session (optionally starting with a system prompt or earlier messages). Its id is
        proposed here (`session_id`, or a random one), so that a proxy can route every call of it alike.
        recover: keep the transcript on this side and, if the session's daemon is gone (behind a proxy),
        re-open it elsewhere and retry the turn (see session.py). expected_idle_ms, retention: retention
        hints ("low" | "normal" | "high"; see the proto's SessionInfo.kv_tier); turns take them too.
        priority: the class its turns are scheduled in ("interactive" | "batch"), unless a turn says."""
        info = self._run(calls.open_session(prefix, ttl, session_id, expected_idle_ms, retention, priority))
        return Session(self, info, prefix, ttl, recover)

    def get_session(self, session_id: str, tenant: str = "") -> SessionInfo:
        """tenant: the admin token only, another tenant's session (see the proto's Tenants)."""
        return self._run(calls.get_session(session_id, tenant))

    def list_sessions(self, all_tenants: bool = False) -> list[SessionInfo]:
        """The caller's open sessions (every tenant's: the admin token with all_tenants)."""
        return self._run(calls.list_sessions(all_tenants))

    def fork_session(
        self, session_id: str, candidate: int | None = None, ttl: float | None = None, new_session_id: str | None = None
    ) -> SessionInfo:
        """A new session continuing this one; its id (default: this one's affinity key + a suffix) keeps it
        on the same daemon behind a proxy."""
        return self._run(calls.fork_session(session_id, candidate, ttl, new_session_id))

    def close_session(self, session_id: str, tenant: str = "") -> None:
        """tenant: as get_session's."""
        self._run(calls.close_session(session_id, tenant))

    def wait_ready(self, timeout: float = 120.0, on_wait: Callable[[str], None] | None = None) -> ModelInfo:
        """Block until the daemon is up and warm. No daemon at the address (no socket file, connection
        refused) fails at once with UNAVAILABLE; a daemon that is still loading is waited for up to
        `timeout` seconds (then DEADLINE_EXCEEDED), and `on_wait` is told once that we wait."""
        waiter = readiness.Waiter(self.address, timeout, on_wait)
        check = self._channel.unary_unary(readiness.HEALTH_CHECK)
        while True:
            try:
                outcome: bytes | grpc.RpcError = check(readiness.HEALTH_REQUEST, timeout=readiness.CHECK_TIMEOUT)
            except grpc.RpcError as e:
                outcome = e
            if waiter.ready(outcome):
                return self.model_info()
            time.sleep(readiness.POLL_SECONDS)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: calls.Unary[R]) -> R:
        metadata = with_affinity(self._metadata, call.key, self._routes)
        try:
            response, rpc = getattr(self._stub, call.method).with_call(
                call.request, timeout=self.timeout, metadata=metadata
            )
        except grpc.RpcError as e:
            self._learn(call.key, e)
            raise CbdError.from_rpc(e) from None
        self._learn(call.key, rpc)
        return call.result(response)

    def _responses(self, call: calls.Generate, timeout: float | None) -> Generator[pb.GenerateResponse, None, None]:
        """The call's responses; closing the iterator early cancels the call on the daemon."""
        rpc = self._stub.Generate(
            call.request, timeout=timeout or self.timeout,
            metadata=with_affinity(self._metadata, call.key, self._routes),
        )  # fmt: skip
        try:
            yield from rpc
        except grpc.RpcError as e:
            raise CbdError.from_rpc(e) from None
        finally:
            rpc.cancel()  # a no-op once the stream has ended; otherwise (interrupted) learning must not wait
            self._learn(call.key, rpc)

    def _learn(self, key: str | None, call: Any) -> None:
        """Remember the replica a proxy named in the call's response headers for its affinity key."""
        if key and hasattr(call, "initial_metadata"):
            # An error answer has no headers of its own: the proxy's header comes with the trailers then.
            self._routes.learn(affinity_key(key), [*(call.initial_metadata() or ()),
                                                   *(call.trailing_metadata() or ())])  # fmt: skip
