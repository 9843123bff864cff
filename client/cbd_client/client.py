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
auth token's name when the daemon checks tokens). Session turns (and `session()`) also take retention hints: expected_idle_ms= (how long the agent will
be away after the turn, e.g. while a tool runs) and retention= "low" | "normal" | "high".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from cbd_client import _convert, readiness
from cbd_client._convert import Prompt
from cbd_client.address import default_address, tls_credentials
from cbd_client.errors import CbdError
from cbd_client.routing import Routes
from cbd_client.session import Session
from cbd_client.types import Completion, Delta, ModelInfo, SessionInfo, Stats
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1.cbd_pb2_grpc import CbdStub


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
        builder = _convert.CompletionBuilder(n)
        request = _convert.generate_request(prompt, n, options)
        key = request.session_id or options.get("affinity")
        call = self._stub.Generate(
            request, timeout=timeout or self.timeout, metadata=_convert.with_affinity(self._metadata, key, self._routes)
        )
        try:
            for response in call:
                builder.add(response)
        except grpc.RpcError as e:
            raise CbdError.from_rpc(e) from None
        finally:
            call.cancel()  # a no-op once the stream has ended; otherwise (interrupted) learning must not wait
            self._learn(key, call)
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
        request = _convert.generate_request(prompt, n, options)
        key = request.session_id or options.get("affinity")
        call = self._stub.Generate(
            request, timeout=timeout or self.timeout, metadata=_convert.with_affinity(self._metadata, key, self._routes)
        )
        try:
            for response in call:
                yield from _convert.deltas(response)
        except grpc.RpcError as e:
            raise CbdError.from_rpc(e) from None
        finally:
            call.cancel()  # a no-op once the stream has ended
            self._learn(key, call)

    def tokenize(self, prompt: str | list[dict[str, str]], allow_special_tokens: bool = False) -> list[int]:
        """allow_special_tokens: special-token strings in a text prompt become their tokens (raw mode)."""
        request = pb.TokenizeRequest(allow_special_tokens=allow_special_tokens)
        _convert.set_prompt(request, prompt)
        return list(self._call(self._stub.Tokenize, request).token_ids)

    def model_info(self) -> ModelInfo:
        return _convert.model_info(self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest()))

    def stats(self) -> Stats:
        return _convert.stats(self._call(self._stub.GetStats, pb.GetStatsRequest()))

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
        sid = session_id or _convert.new_session_id()
        request = _convert.open_session_request(prefix, ttl, sid, expected_idle_ms, retention, priority)
        info = _convert.session_info(self._call(self._stub.OpenSession, request, sid))
        return Session(self, info, prefix, ttl, recover)

    def get_session(self, session_id: str, tenant: str = "") -> SessionInfo:
        """tenant: the admin token only, another tenant's session (see the proto's Tenants)."""
        request = pb.GetSessionRequest(session_id=session_id, tenant=tenant)
        return _convert.session_info(self._call(self._stub.GetSession, request, session_id))

    def list_sessions(self, all_tenants: bool = False) -> list[SessionInfo]:
        """The caller's open sessions (every tenant's: the admin token with all_tenants)."""
        reply = self._call(self._stub.ListSessions, pb.ListSessionsRequest(all_tenants=all_tenants))
        return [_convert.session_info(s) for s in reply.sessions]

    def fork_session(
        self, session_id: str, candidate: int | None = None, ttl: float | None = None, new_session_id: str | None = None
    ) -> SessionInfo:
        """A new session continuing this one; its id (default: this one's affinity key + a suffix) keeps it
        on the same daemon behind a proxy."""
        request = pb.ForkSessionRequest(session_id=session_id, ttl_seconds=ttl or 0.0,
                                        new_session_id=new_session_id or _convert.fork_session_id(session_id))  # fmt: skip
        if candidate is not None:
            request.candidate = candidate
        return _convert.session_info(self._call(self._stub.ForkSession, request, session_id))

    def close_session(self, session_id: str, tenant: str = "") -> None:
        """tenant: as get_session's."""
        request = pb.CloseSessionRequest(session_id=session_id, tenant=tenant)
        self._call(self._stub.CloseSession, request, session_id)

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

    def _call(self, method, request, session_id: str | None = None):
        metadata = _convert.with_affinity(self._metadata, session_id, self._routes)
        try:
            response, call = method.with_call(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            self._learn(session_id, e)
            raise CbdError.from_rpc(e) from None
        self._learn(session_id, call)
        return response

    def _learn(self, key: str | None, call: Any) -> None:
        """Remember the replica a proxy named in the call's response headers for its affinity key."""
        if key and hasattr(call, "initial_metadata"):
            # An error answer has no headers of its own: the proxy's header comes with the trailers then.
            self._routes.learn(_convert.affinity_key(key), [*(call.initial_metadata() or ()),
                                                            *(call.trailing_metadata() or ())])  # fmt: skip
