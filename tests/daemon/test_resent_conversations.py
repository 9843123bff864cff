"""Clients that resend the whole conversation (the Messages API; Chat Completions without X-Cbd-Session)
continue the session of a conversation they sent before only when it extends it token for token: driven
with the official `openai` and `anthropic` packages through a real gateway and daemon, with a fresh call
of the whole conversation on the daemon as the oracle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import grpc
import openai
import pytest

from cbd.gateway.agentic.conversations import Conversations
from cbd_client import Client
from cbd_client.calls import set_prompt
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1.cbd_pb2_grpc import CbdStub
from daemon_process import DaemonProcess
from gateway_stack import OTHER_TOKEN, TOKEN, Stack, stack

QUESTIONS = ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a country."]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tenant_daemon: DaemonProcess) -> Iterator[Stack]:
    yield from stack(tmp_path_factory.mktemp("resent"), tenant_daemon)


def sessions_of(gw: Stack, token: str) -> set[str]:
    with Client(gw.daemon.address, timeout=30, token=token) as c:
        return {s.session_id for s in c.list_sessions()}


def one_shot(gw: Stack, messages: list[dict[str, Any]]) -> str:
    """The oracle: the whole conversation as one plain call (no session), greedy."""
    with Client(gw.daemon.address, timeout=120, token=TOKEN) as c:
        return c.generate(messages, max_tokens=MAX_TOKENS, temperature=0).text


def ask(gw: Stack, api: str, messages: list[dict[str, Any]], token: str = TOKEN) -> tuple[str, int, int]:
    """(reply text, prompt tokens, cached prompt tokens) of one greedy call through the gateway."""
    if api == "openai":
        oai = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=token, max_retries=0)
        r = oai.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached = r.usage.prompt_tokens_details.cached_tokens or 0
        return r.choices[0].message.content or "", r.usage.prompt_tokens, cached
    ant = anthropic.Anthropic(base_url=gw.url, api_key=token, max_retries=0)
    system = [m["content"] for m in messages if m["role"] == "system"]  # the API takes it apart from the messages
    rest = [m for m in messages if m["role"] != "system"]
    m = ant.messages.create(
        model="m",
        max_tokens=MAX_TOKENS,
        messages=rest,
        system=system[0] if system else anthropic.NOT_GIVEN,
        extra_body={"temperature": 0},
    )  # type: ignore[arg-type]
    cached = m.usage.cache_read_input_tokens or 0
    return m.content[0].text, m.usage.input_tokens + cached, cached  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_resent_chat_continues_its_session_token_for_token(gw: Stack, api: str) -> None:
    before = sessions_of(gw, TOKEN)
    # Each API's conversation its own from the first tokens on: nothing of one is in the other's cache.
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{api}: you answer in a few words."}]
    cached_seen, held = -1, 0
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        text, prompt, cached = ask(gw, api, messages)
        assert text == one_shot(gw, messages)  # continuing renders exactly what the whole conversation does
        if held:
            # The session held the last turn's prompt and reply: only the new message was computed.
            assert cached >= held and cached > cached_seen
        cached_seen, held = cached, prompt
        messages.append({"role": "assistant", "content": text})
        assert len(sessions_of(gw, TOKEN) - before) == 1  # one session carried every turn

    # Another caller's identical conversation never continues this caller's session: its tenant has
    # nothing of it (no session, no cached prefix).
    theirs_before = sessions_of(gw, OTHER_TOKEN)
    mine = sessions_of(gw, TOKEN)
    ours = mine - before  # this conversation's session (older ones of the shared daemon may expire meanwhile)
    text, _, cached = ask(gw, api, [*messages, {"role": "user", "content": "Name a city."}], OTHER_TOKEN)
    assert cached == 0 and text == one_shot(gw, [*messages, {"role": "user", "content": "Name a city."}])
    now = sessions_of(gw, TOKEN)
    assert not now - mine and ours <= now and len(sessions_of(gw, OTHER_TOKEN) - theirs_before) == 1

    # Edited in the middle: a fresh session; what is cached comes from the prefix cache only, which
    # shares no more than the tokens before the edit.
    edited = [*messages[:3], {"role": "user", "content": "Name a vegetable."}, *messages[4:]]
    edited.append({"role": "user", "content": "Name a planet."})
    with Client(gw.daemon.address, timeout=30, token=TOKEN) as c:
        unchanged = len(c.tokenize(messages[:3]))
    text, _, cached = ask(gw, api, edited)
    assert cached <= unchanged and text == one_shot(gw, edited)
    assert len(sessions_of(gw, TOKEN) - mine) == 1  # a new session; the held one is still there
    assert ours <= sessions_of(gw, TOKEN)

    # And the held conversation still continues its own session.
    text, _, cached = ask(gw, api, [*messages, {"role": "user", "content": "Name a river."}])
    assert cached >= held


@pytest.mark.slow
def test_a_whole_conversation_turn_continues_only_a_token_prefix(gw: Stack) -> None:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    first_turn = [{"role": "user", "content": "Name a tree."}]

    def turn(session_id: str, messages: list[dict[str, Any]], whole: bool = True) -> tuple[str, pb.Usage]:
        request = pb.GenerateRequest(session_id=session_id, whole_conversation=whole)
        set_prompt(request, messages)
        request.sampling.temperature, request.sampling.max_tokens = 0, MAX_TOKENS
        text, usage = "", pb.Usage()
        for response in stub.Generate(request, metadata=metadata, timeout=120):
            text += "".join(c.text for c in response.candidates)
            usage = response.usage if response.HasField("usage") else usage
        return text, usage

    with grpc.insecure_channel(gw.daemon.address) as channel:
        stub = CbdStub(channel)
        sid = stub.OpenSession(pb.OpenSessionRequest(), metadata=metadata, timeout=30).session_id
        reply, _ = turn(sid, first_turn)
        held = stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=metadata, timeout=30).num_tokens
        # A conversation that does not begin with the session's history: ABORTED, the session unchanged.
        with pytest.raises(grpc.RpcError) as refused:
            turn(sid, [{"role": "user", "content": "Name a bush."}, {"role": "assistant", "content": reply},
                       {"role": "user", "content": "Another?"}])  # fmt: skip
        assert refused.value.code() == grpc.StatusCode.ABORTED
        info = stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=metadata, timeout=30)
        assert info.num_tokens == held and not info.busy
        # The conversation as it was, resent whole with a new message: the history's KV is reused.
        follow = [*first_turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "Another?"}]
        text, usage = turn(sid, follow)
        assert usage.cached_prompt_tokens >= held - 1 and text == one_shot(gw, follow)
        # Only for a session turn with chat input.
        with pytest.raises(grpc.RpcError) as bad:
            turn("", follow)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=metadata, timeout=30)


def test_the_index_is_bounded_and_hands_back_what_it_forgets_with_its_metadata() -> None:
    index = Conversations(capacity=2)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    alice, bob = [("authorization", "Bearer a")], [("authorization", "Bearer b")]
    assert index.record("alice", "s1", chat, alice) == []
    assert index.record("bob", "s2", chat, bob) == []  # the same text, another owner: its own entry
    # A second session holding the same conversation of the same owner replaces the first.
    assert index.record("alice", "s3", chat, alice) == [("s1", alice)]
    follow = [*chat, {"role": "user", "content": "more"}]
    assert index.find("bob", follow) == ("s2", 2) and index.find("alice", follow) == ("s3", 2)
    # Beyond capacity the least recently used goes (s2: s3 was just found), closed with bob's metadata.
    assert index.record("alice", "s4", [*follow, {"role": "assistant", "content": "ok"}], alice) == [("s2", bob)]
    assert len(index) == 2 and index.find("bob", follow) is None
