"""End to end: a real `cbd serve` process with the default model, driven through the real client."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cbd_client import AsyncClient, CbdError, Client
from daemon_process import DaemonProcess

pytestmark = pytest.mark.slow
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    return shared_daemon


@pytest.fixture()
def client(daemon):
    with Client(daemon.address, timeout=120) as c:
        yield c


def wait_until_idle(client: Client, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if (stats.running, stats.waiting, stats.kv_blocks_used, stats.live_requests) == (0, 0, 0, 0):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_health_is_not_serving_until_warm_then_serving(daemon) -> None:
    assert daemon.health_seen == ["NOT_SERVING", "SERVING"]


def test_greedy_chat_knows_paris(client) -> None:
    result = client.generate(FRANCE, max_tokens=32, temperature=0)
    candidate = result.candidates[0]
    assert "Paris" in candidate.text
    assert candidate.finish_reason == "stop"
    assert result.usage.prompt_tokens == len(client.tokenize(FRANCE))
    assert result.usage.completion_tokens == len(candidate.token_ids) == candidate.usage.completion_tokens


def test_streamed_deltas_concatenate_to_the_final_text(client) -> None:
    prompt = [{"role": "user", "content": "Write a short poem about the ocean, with an emoji."}]
    deltas = list(client.stream(prompt, max_tokens=48, temperature=0, stop=["\n\n"]))
    final = client.generate(prompt, max_tokens=48, temperature=0, stop=["\n\n"])
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.candidates[0].token_ids
    assert "\n\n" not in final.text
    assert deltas[-1].finish_reason == final.candidates[0].finish_reason


def test_fan_out_with_seed_is_reproducible(client) -> None:
    kw = dict(n=4, max_tokens=16, temperature=0.9, seed=1234)
    first = client.generate(FRANCE, **kw)
    second = client.generate(FRANCE, **kw)
    assert len(first.candidates) == 4
    assert [c.text for c in first.candidates] == [c.text for c in second.candidates]
    assert len({c.text for c in first.candidates}) > 1
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.candidates)


def test_logprobs_are_returned_per_token(client) -> None:
    c = client.generate(FRANCE, max_tokens=4, temperature=0, logprobs=3).candidates[0]
    assert len(c.logprobs) == len(c.token_ids)
    for lp, token in zip(c.logprobs, c.token_ids):
        assert lp.token_id == token and len(lp.top) == 3 and lp.top[0][0] == token  # greedy = best
        assert lp.logprob <= 0


def test_cancelled_stream_frees_its_blocks(client) -> None:
    stream = client.stream(FRANCE, max_tokens=2000, temperature=0, ignore_eos=True)
    received = [next(stream) for _ in range(3)]
    assert all(d.finish_reason is None for d in received)
    assert client.stats().kv_blocks_used > 0
    stream.close()  # cancels the call
    wait_until_idle(client)


def test_deadline_aborts_the_request(client) -> None:
    with pytest.raises(CbdError) as info:
        client.generate(FRANCE, max_tokens=4000, temperature=0, ignore_eos=True, timeout=1.0)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_idle(client)


@pytest.mark.parametrize(
    "prompt, kw, match",
    [
        (FRANCE, dict(temperature=-1.0), "temperature must be in"),
        (FRANCE, dict(top_p=1.5), "top_p must be in"),
        (FRANCE, dict(n=1000), "n must be in"),
        (FRANCE, dict(max_tokens=0), "max_tokens must be >= 1"),
        (FRANCE, dict(logprobs=50), "logprobs must be in"),
        ([999_999], {}, "prompt token ids must be in"),
        ("word " * 9000, {}, "context holds at most"),
        ([{"role": "", "content": "hi"}], {}, "has no role"),
    ],
)
def test_bad_input_is_invalid_argument_with_a_readable_message(client, prompt, kw, match) -> None:
    with pytest.raises(CbdError) as info:
        client.generate(prompt, **kw)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert match in info.value.details


def test_missing_prompt_and_sessions(daemon) -> None:
    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1.cbd_pb2_grpc import CbdStub

    with grpc.insecure_channel(daemon.address) as channel:
        stub = CbdStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest()))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt is required" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi", session_id="s1")))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "no open session" in info.value.details()


def test_chat_session_turns_equal_stateless_and_reuse_kv(client) -> None:
    system = [{"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}]
    questions = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?",
                 "Name a river in the first one.", "Thanks! Say goodbye."]  # fmt: skip
    conversation = list(system)
    with client.session(system, ttl=60) as session:
        assert session.info().is_chat
        previous_prompt = 0
        for k, q in enumerate(questions):
            turn = [{"role": "user", "content": q}]
            reply = session.send(turn, max_tokens=24, temperature=0)
            conversation += turn
            stateless = client.generate(conversation, max_tokens=24, temperature=0)
            assert reply.text == stateless.text, k
            assert reply.usage.prompt_tokens == stateless.usage.prompt_tokens, k  # same rendered conversation
            if k:  # the whole history was resident (the reply's end marker is re-rendered by the template)
                assert reply.usage.cached_prompt_tokens >= previous_prompt, k
            previous_prompt = reply.usage.prompt_tokens
            conversation.append({"role": "assistant", "content": reply.text})
        info = session.info()
        assert info.num_tokens >= previous_prompt and info.resident_blocks > 0 and not info.busy
    with pytest.raises(CbdError) as gone:
        client.get_session(info.session_id)
    assert gone.value.code == grpc.StatusCode.NOT_FOUND
    wait_until_idle(client)


def test_a_fork_of_a_fork_being_made_continues_the_whole_conversation(client, daemon) -> None:
    """A fork sent while its source is itself being forked (a client branching from a snapshot it has just
    asked for; the gateway's concurrent continuations of one response) continues the whole conversation:
    the same prompt as the conversation sent whole, never the new message alone. (Either of the frontend's
    two safeguards passes it alone: the fork's conversation known before the engine hop, and the note asked
    for a source without a transcript; with neither, every second fork rendered the new message alone.)"""
    system = [{"role": "system", "content": "Be brief."}]
    first = [{"role": "user", "content": "Name a colour."}]
    ask = [{"role": "user", "content": "And another one?"}]
    greedy = dict(max_tokens=4, temperature=0)

    async def race() -> tuple[str, list[int], int]:
        async with AsyncClient(daemon.address) as aclient:
            source = await aclient.session(system)
            reply = await source.send(first, **greedy)
            prompts: list[int] = []
            k = seconds = 0
            # The source's fork and a fork of that fork, sent at once: six times, and on until a fork of a
            # fork was made (which of the two reaches the engine first is the race itself).
            while k < 6 or (not seconds and k < 60):
                k += 1
                middle, last = f"{source.session_id}.m{k}", f"{source.session_id}.m{k}.x"
                made = await asyncio.gather(aclient.fork_session(source.session_id, new_session_id=middle),
                                            aclient.fork_session(middle, new_session_id=last), return_exceptions=True)  # fmt: skip
                for info in made:  # the second may reach the engine first: NOT_FOUND, nothing to check
                    if isinstance(info, CbdError) and info.code == grpc.StatusCode.NOT_FOUND:
                        continue
                    assert not isinstance(info, BaseException), info
                    seconds += info.session_id == last
                    turn = await aclient.generate(ask, session_id=info.session_id, **greedy)
                    prompts.append(turn.usage.prompt_tokens)
                    await aclient.close_session(info.session_id)
            await aclient.close_session(source.session_id)
            return reply.text, prompts, seconds

    text, prompts, seconds = asyncio.run(race())
    whole = client.generate(system + first + [{"role": "assistant", "content": text}] + ask, **greedy)
    assert seconds > 0 and set(prompts) == {whole.usage.prompt_tokens}, (prompts, whole.usage)  # some were made


def test_the_first_message_carries_the_prompts_counts_and_the_last_the_totals(client, daemon) -> None:
    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1.cbd_pb2_grpc import CbdStub

    prompt = "Count from one to five."
    size = len(client.tokenize(prompt))
    with client.session([{"role": "system", "content": "Be brief."}]) as session:
        session.send([{"role": "user", "content": "Hi."}], max_tokens=3, temperature=0)
        history = session.info().num_tokens
        with grpc.insecure_channel(daemon.address) as channel:
            stub = CbdStub(channel)
            sampling = pb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            plain = list(stub.Generate(pb.GenerateRequest(text=prompt, sampling=sampling)))
            turn = pb.GenerateRequest(session_id=session.session_id, sampling=sampling)
            turn.chat.messages.add(role="user", content="And now?")
            continued = list(stub.Generate(turn))
    for stream in (plain, continued):
        first, last = stream[0].prompt_usage, stream[-1].usage
        assert stream[0].HasField("prompt_usage") and not any(m.HasField("prompt_usage") for m in stream[1:])
        assert (first.prompt_tokens, first.cached_prompt_tokens) == (last.prompt_tokens, last.cached_prompt_tokens)
        assert first.completion_tokens == 0 and last.completion_tokens == 12
    assert plain[0].prompt_usage.prompt_tokens == size
    # The session's history was resident (but its last token: the template re-renders the reply's end marker).
    assert continued[0].prompt_usage.cached_prompt_tokens >= history - 1, (continued[0].prompt_usage, history)


def test_session_fan_out_choose_fork_and_busy(client) -> None:
    with client.session([{"role": "system", "content": "Be brief."}]) as session:
        options = session.send(
            [{"role": "user", "content": "Name a fruit."}], n=3, temperature=1.0, seed=5, max_tokens=8
        )
        assert len(options.candidates) == 3 and session.info().pending_candidates == 3
        with pytest.raises(CbdError) as info:  # the next turn must name the candidate that continues
            session.send([{"role": "user", "content": "Why?"}], max_tokens=4)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "parent_candidate" in info.value.details
        branch = session.fork(candidate=0)
        session.choose(2)
        session.send([{"role": "user", "content": "Why that one?"}], max_tokens=8, temperature=0)
        assert session.info().pending_candidates == 0
        stream = session.stream([{"role": "user", "content": "Tell me more, at length."}], max_tokens=2000,
                                temperature=0, ignore_eos=True)  # fmt: skip
        next(stream)
        with pytest.raises(CbdError) as info:  # one turn at a time
            session.send([{"role": "user", "content": "Hello?"}], max_tokens=4)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        stream.close()
        with branch:
            alone = branch.send([{"role": "user", "content": "Why?"}], max_tokens=8, temperature=0)
            assert alone.usage.cached_prompt_tokens > 0
    time.sleep(0.2)
    wait_until_idle(client)


def test_model_info_tokenize_and_reflection(client, daemon) -> None:
    info = client.model_info()
    assert (info.architecture, info.vocab_size, info.dtype, info.device) == ("llama", 49152, "float32", "cpu")
    assert info.kv_cache_dtype == "float32"  # --kv-cache-dtype auto: the model's dtype
    assert info.model == "SmolLM2-135M-Instruct.Q4_1" and info.has_chat_template and info.eos_token_ids
    ids = client.tokenize("Hello world")
    assert ids and all(0 <= t < info.vocab_size for t in ids)
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(daemon.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"cbd.v1.Cbd", "grpc.health.v1.Health"} <= names


def test_async_client_runs_concurrent_requests(daemon) -> None:
    async def run() -> list[str]:
        async with AsyncClient(daemon.address, timeout=120) as c:
            prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(3, 9)]
            results = await asyncio.gather(*(c.generate(p, max_tokens=12, temperature=0) for p in prompts))
            return [r.text for r in results]

    texts = asyncio.run(run())
    assert len(texts) == 6 and all(texts)


def test_duplicate_live_request_id_is_refused_and_the_first_keeps_streaming(client) -> None:
    first = client.stream(FRANCE, request_id="dup-1", max_tokens=80, temperature=0, ignore_eos=True)
    next(first)
    with pytest.raises(CbdError) as info:
        client.generate(FRANCE, request_id="dup-1", max_tokens=2)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in info.value.details
    rest = list(first)
    assert rest[-1].finish_reason == "length" and rest[-1].request_id == "dup-1"


def test_session_ttl_nan_is_refused_and_inf_never_expires(daemon) -> None:
    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1.cbd_pb2_grpc import CbdStub

    with grpc.insecure_channel(daemon.address) as channel:
        stub = CbdStub(channel)
        for bad in (float("nan"), float("-inf"), -1.0):
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=bad))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_seconds" in info.value.details()
        forever = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=float("inf"), tokens=pb.TokenIds(ids=[1, 2, 3])))
        assert forever.ttl_seconds == float("inf")
        with pytest.raises(grpc.RpcError) as info:
            stub.ForkSession(pb.ForkSessionRequest(session_id=forever.session_id, ttl_seconds=float("nan")))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_seconds" in info.value.details()
        child = stub.ForkSession(pb.ForkSessionRequest(session_id=forever.session_id))
        assert child.ttl_seconds == float("inf") and child.num_tokens == 3
        for sid in (forever.session_id, child.session_id):
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_parent_candidate_without_session_is_refused(daemon) -> None:
    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1.cbd_pb2_grpc import CbdStub

    with grpc.insecure_channel(daemon.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(CbdStub(channel).Generate(pb.GenerateRequest(text="hi", parent_candidate=0)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in info.value.details()


def test_malformed_session_ids_name_the_field_never_the_value(daemon) -> None:
    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1.cbd_pb2_grpc import CbdStub

    def refused(call, request, field: str, value: str) -> None:
        with pytest.raises(grpc.RpcError) as info:
            call(request)
        details = info.value.details()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(field + " must be 1-128 characters") and "\n" not in details, details
        assert value not in details, details

    with grpc.insecure_channel(daemon.address) as channel:
        stub = CbdStub(channel)
        long_id, dotted = "q" * 129, ".hidden-x"
        for bad in (long_id, dotted):
            refused(
                stub.OpenSession, pb.OpenSessionRequest(session_id=bad, tokens=pb.TokenIds(ids=[1])), "session_id", bad
            )
        sid = stub.OpenSession(pb.OpenSessionRequest(tokens=pb.TokenIds(ids=[1, 2]))).session_id
        try:
            refused(stub.ForkSession, pb.ForkSessionRequest(session_id=sid, new_session_id=long_id), "new_session_id",
                    long_id)  # fmt: skip
            # a call that names a session must name one: empty is malformed, not an unknown session
            refused(stub.GetSession, pb.GetSessionRequest(session_id=""), "session_id", "\x00")
            refused(stub.CloseSession, pb.CloseSessionRequest(session_id=""), "session_id", "\x00")
            refused(stub.ForkSession, pb.ForkSessionRequest(session_id=""), "session_id", "\x00")
        finally:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        for sampling, n, field in ((pb.SamplingParams(logprobs=21), 1, "logprobs"), (pb.SamplingParams(), 65, "n")):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(pb.GenerateRequest(text="hi", n=n, sampling=sampling)))
            details = info.value.details()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
            assert "21" not in details and "65" not in details, details


def test_fork_without_candidate_while_candidates_are_pending_is_failed_precondition_like_a_turn(client, daemon) -> None:
    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1.cbd_pb2_grpc import CbdStub

    with grpc.insecure_channel(daemon.address) as channel:
        stub = CbdStub(channel)
        sid = stub.OpenSession(pb.OpenSessionRequest(tokens=pb.TokenIds(ids=[1, 2, 3]))).session_id
        fan = pb.GenerateRequest(
            tokens=pb.TokenIds(ids=[4, 5]),
            session_id=sid,
            n=2,
            sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        list(stub.Generate(fan))
        assert stub.GetSession(pb.GetSessionRequest(session_id=sid)).pending_candidates == 2
        with pytest.raises(grpc.RpcError) as fork:
            stub.ForkSession(pb.ForkSessionRequest(session_id=sid))
        with pytest.raises(grpc.RpcError) as turn:
            list(stub.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=[6]), session_id=sid)))
        assert fork.value.code() == turn.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "candidate" in fork.value.details() and "parent_candidate" in turn.value.details()
        child = stub.ForkSession(pb.ForkSessionRequest(session_id=sid, candidate=1))
        assert child.num_tokens == 7 and child.pending_candidates == 0
        for s in (sid, child.session_id):
            stub.CloseSession(pb.CloseSessionRequest(session_id=s))
    wait_until_idle(client)


def stream_messages(daemon: DaemonProcess, **fields) -> list[tuple[list[list[int]], bool]]:
    """Each stream message's token ids per candidate, and whether a candidate ended in it, of a seeded call."""
    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1.cbd_pb2_grpc import CbdStub

    sampling = pb.SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    request = pb.GenerateRequest(tokens=pb.TokenIds(ids=[1, 30, 31, 32, 33]), sampling=sampling, **fields)
    with grpc.insecure_channel(daemon.address) as channel:
        messages = []
        for response in CbdStub(channel).Generate(request, timeout=120):
            per_candidate: list[list[int]] = [[] for _ in range(max(request.n, 1))]
            for c in response.candidates:
                per_candidate[c.index] += c.token_ids
            messages.append((per_candidate, any(c.finish_reason for c in response.candidates)))
    return messages


def candidate_tokens(messages: list[tuple[list[list[int]], bool]]) -> list[list[int]]:
    return [[t for m, _ in messages for t in m[i]] for i in range(len(messages[0][0]))]


@pytest.mark.parametrize(
    ("fields", "interval"),
    [
        ({"priority": 2}, 8),  # a batch request: the daemon's --stream-interval (default 8)
        ({"priority": 2, "n": 3}, 8),
        ({"stream_interval": 5}, 5),  # an interactive request that asks for it
        ({"priority": 2, "stream_interval": 3, "n": 2}, 3),
    ],
)
def test_a_stream_gathers_its_tokens_by_its_interval_and_loses_none(daemon, fields, interval) -> None:
    gathered = stream_messages(daemon, **fields)
    each_step = stream_messages(daemon, **{**fields, "stream_interval": 1})  # the oracle: a message per step
    assert candidate_tokens(gathered) == candidate_tokens(each_step)
    assert all(len(tokens) == 40 for tokens in candidate_tokens(gathered))
    assert any(gathered[0][0])  # the first token went out at once, in the first message
    for tokens, ended in gathered[1:]:  # a message holds a candidate's interval at least, or a candidate's end
        assert ended or max(len(t) for t in tokens) >= interval, [len(t) for t in tokens]


@pytest.mark.parametrize("value", [0, 1025])
def test_a_stream_interval_out_of_range_is_invalid_argument(daemon, value) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stream_messages(daemon, stream_interval=value)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_interval must be 1-1024" in info.value.details()
