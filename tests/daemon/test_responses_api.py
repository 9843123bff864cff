"""The Responses API (/v1/responses) driven with the official `openai` package: a real daemon (the
embedded model, two tenants' tokens) and a real `cbd openai` gateway with its SQLite state directory."""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import openai
import pytest

from cbd.gateway.responses.store import ResponseStore, Stored, StoreSettings
from cbd_client import Client
from gateway_stack import OTHER_TOKEN, TOKEN, Stack, stack

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER}]  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    yield from stack(tmp_path_factory.mktemp("responses"))


def client(gw: Stack, token: str = TOKEN) -> Any:  # Any: the SDK's request types name its own models only
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=token, max_retries=0)


@pytest.mark.slow
def test_a_continued_response_is_a_session_turn(gw: Stack) -> None:
    c = client(gw)
    first = c.responses.create(model="m", input="What is the capital of France?", max_output_tokens=20,
                               temperature=0)  # fmt: skip
    assert first.status == "completed" and "Paris" in first.output_text
    assert first.usage is not None and first.usage.input_tokens > 10 and first.usage.output_tokens > 0
    ask = [{"role": "user", "content": "And the capital of Germany?"}]  # a message item whose content is a string
    second = c.responses.create(model="m", input=ask, previous_response_id=first.id, max_output_tokens=20,
                                temperature=0)  # fmt: skip
    assert "Berlin" in second.output_text and second.previous_response_id == first.id
    u = second.usage
    assert u is not None
    # Only the new input was computed: the first exchange was the session's resident KV (up to where the
    # reply, rendered back as text, tokenizes differently from how it was generated).
    assert u.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.id.rsplit("_", 1) == [first.id.rsplit("_", 1)[0], "2"]  # the same session's second turn
    assert u.input_tokens > u.input_tokens_details.cached_tokens
    again = c.responses.retrieve(second.id)
    assert again.output_text == second.output_text and again.usage == second.usage
    # Listed as the API lists input items, whichever form the input took: content as parts, a status.
    for response, text in ((first, "What is the capital of France?"), (second, "And the capital of Germany?")):
        listed = c.responses.input_items.list(response.id, order="asc")
        assert [item.type for item in listed.data] == ["message"]
        item = listed.data[0]
        assert item.role == "user" and item.status == "completed"
        assert [(p.type, p.text) for p in item.content] == [("input_text", text)]


@pytest.mark.slow
def test_streamed_events_assemble_to_the_whole_response(gw: Stack) -> None:
    c = client(gw)
    ask = {"model": "m", "input": "Name three colours.", "max_output_tokens": 30, "temperature": 0,
           "instructions": "Answer briefly."}  # fmt: skip
    whole = c.responses.create(**ask)
    events = list(c.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text and events[-1].response.output_text == whole.output_text
    with c.responses.stream(model="m", input="Say hello.", max_output_tokens=200, temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text and final.status == "completed"
    assert c.responses.retrieve(final.id).output_text == final.output_text


@pytest.mark.slow
def test_continuing_an_older_response_branches_and_keeps_the_newer_one(gw: Stack) -> None:
    c = client(gw)
    root = c.responses.create(model="m", input="Name a fruit.", max_output_tokens=12, temperature=0)
    ask = {"model": "m", "max_output_tokens": 12, "temperature": 0}
    a = c.responses.create(input="Name another one.", previous_response_id=root.id, **ask)
    b = c.responses.create(input="Name a vegetable.", previous_response_id=root.id, **ask)
    # b continues root, not a: a fork of root's session as of root (its KV shared), taking turn 2 there.
    session = root.id.rsplit("_", 1)[0].removeprefix("resp_")
    fork, turn = b.id.removeprefix("resp_").rsplit("_", 1)
    assert fork.startswith(session + ".") and turn == "2"
    assert root.usage is not None and b.usage is not None
    assert b.usage.input_tokens_details.cached_tokens >= root.usage.input_tokens  # root's history was resident
    # The same question asked of root again (greedy) is the same answer as on root's own session.
    a_again = c.responses.create(input="Name another one.", previous_response_id=root.id, **ask)
    assert a_again.output_text == a.output_text and a_again.id != a.id
    # a is still the latest turn of root's session: continuing it is a turn there.
    after_a = c.responses.create(input="And one more?", previous_response_id=a.id, **ask)
    assert after_a.id == f"resp_{session}_3" and a.id == f"resp_{session}_2"


@pytest.mark.slow
def test_a_function_tool_round_trip(gw: Stack) -> None:
    c = client(gw)
    asked = c.responses.create(model="m", input="What is the weather in Paris?", tools=TOOLS,
                               tool_choice="required", max_output_tokens=60, temperature=0)  # fmt: skip
    calls = [item for item in asked.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature_c": 21}'}
    answer = c.responses.create(model="m", input=[result], previous_response_id=asked.id, tools=TOOLS,
                                tool_choice="none", max_output_tokens=40, temperature=0)  # fmt: skip
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    assert answer.usage is not None and answer.usage.input_tokens_details.cached_tokens > 0
    # Streamed, the call's argument deltas add up to the same call.
    events = list(c.responses.create(model="m", input="What is the weather in Paris?", tools=TOOLS,
                                     tool_choice="required", max_output_tokens=60, temperature=0, stream=True))  # fmt: skip
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    pieces = [
        e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == done.item_id
    ]
    assert "".join(pieces) == done.arguments == calls[0].arguments
    assert events[-1].type in ("response.completed", "response.incomplete")


@pytest.mark.slow
def test_text_format_json_schema_validates(gw: Stack) -> None:
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "person", "schema": person, "strict": True}
    reply = client(gw).responses.create(model="m", input="Describe a person as JSON.", max_output_tokens=60,
                                        temperature=0, text={"format": fmt})  # fmt: skip
    jsonschema.validate(json.loads(reply.output_text), person)
    assert reply.text.format.type == "json_schema"


@pytest.mark.slow
def test_background_responses_are_polled_and_cancelled(gw: Stack) -> None:
    c = client(gw)
    quick = c.responses.create(model="m", input="Say yes.", max_output_tokens=8, temperature=0, background=True)
    assert quick.status == "in_progress" and quick.background
    deadline = time.monotonic() + 120
    while (polled := c.responses.retrieve(quick.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert polled.status in ("completed", "incomplete") and polled.output_text
    long = c.responses.create(model="m", input="Count from 1 to 1000.", max_output_tokens=2000, temperature=0,
                              background=True)  # fmt: skip
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and c.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        c.responses.cancel(c.responses.create(model="m", input="Hi", max_output_tokens=2).id)
    running = c.responses.create(model="m", input="Count from 1 to 1000.", max_output_tokens=2000, temperature=0,
                                 background=True)  # fmt: skip
    with pytest.raises(openai.BadRequestError) as early:  # its output is not there yet to continue from
        c.responses.create(model="m", input="Go on.", previous_response_id=running.id, max_output_tokens=4)
    assert early.value.param == "previous_response_id" and "still in_progress" in early.value.message
    assert c.responses.cancel(running.id).status == "cancelled"
    deadline = time.monotonic() + 30
    with Client(gw.daemon.address, timeout=30, token=TOKEN) as daemon:
        while daemon.stats().running:  # the cancelled turn left the engine
            assert time.monotonic() < deadline
            time.sleep(0.1)


@pytest.mark.slow
def test_errors_and_ownership(gw: Stack) -> None:
    c, other = client(gw), client(gw, OTHER_TOKEN)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="m", input="Hi", previous_response_id="resp_nosuch_1", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.create(model="m", input="Hi", max_output_tokens=0)
    assert "max_output_tokens must be an integer from 1" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.create(model="m", input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}])
    assert "names no earlier tool call" in bad.value.message
    mine = c.responses.create(model="m", input="Say yes.", max_output_tokens=4, temperature=0)
    # Another key's response id is not found, exactly as an unknown one.
    for call in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.delete(mine.id),
                 lambda: other.responses.create(model="m", input="Hi", previous_response_id=mine.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        body: Any = missing.value.body  # the SDK types an error body as object: it is the API's error dict
        assert body["message"] == f"no response with id {mine.id!r}"
    assert c.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.AuthenticationError):  # a wrong key is refused as a create refuses it
        client(gw, "wrong").responses.retrieve(mine.id)
    # The daemon's refusals name the field as this API names it.
    for ask, param in (({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]"),
                       ({"input": "word " * 20000}, "input"),
                       ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                       ({"truncation": "sometimes"}, "truncation")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as bad:
            c.responses.create(model="m", **{"input": "Hi", "max_output_tokens": 2, **ask})
        assert bad.value.param == param, bad.value.message
    unenforceable = {"type": "json_schema", "name": "n", "schema": {"not": {}}}  # a schema the daemon refuses
    with pytest.raises(openai.BadRequestError) as bad:  # in this API's words: its path and its param
        c.responses.create(model="m", input="Hi", max_output_tokens=2, text={"format": unenforceable})
    refusal: Any = bad.value.body  # the SDK types an error body as object: it is the API's error dict
    assert bad.value.param == "text.format" and refusal["message"].startswith("text.format.schema.not: "), refusal
    echoed = c.responses.create(model="m", input="Say yes.", max_output_tokens=4, top_p=0, truncation="auto",
                                user="u1")  # fmt: skip
    assert (echoed.truncation, echoed.user, echoed.top_p, echoed.temperature) == ("auto", "u1", 0, 1.0)
    assert echoed.usage is not None and echoed.usage.input_tokens_details.cache_write_tokens >= 0
    c.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="m", input="Hi", previous_response_id=mine.id)


@pytest.mark.slow
def test_a_chain_continues_across_a_gateway_restart(gw: Stack) -> None:
    c = client(gw)
    first = c.responses.create(model="m", input="What is the capital of Italy?", max_output_tokens=20, temperature=0)
    gw.stop_gateway()
    gw.start_gateway()
    assert c.responses.retrieve(first.id).output_text == first.output_text
    # No max_output_tokens: up to the context (the reply ends at its end-of-turn).
    second = c.responses.create(model="m", input="And of Spain?", previous_response_id=first.id, temperature=0)
    assert second.status == "completed" and second.max_output_tokens is None
    assert second.output_text and second.id.rsplit("_", 1) == [first.id.rsplit("_", 1)[0], "2"]
    # The daemon's session outlived the gateway: the stored response continued it, its KV still resident.
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


@pytest.mark.slow
def test_a_chain_continues_across_a_gateway_and_daemon_restart(gw: Stack) -> None:
    c = client(gw)
    first = c.responses.create(model="m", input="What is the capital of Spain?", max_output_tokens=20, temperature=0)
    # The oracle: the next turn on the daemon that still holds the chain's session.
    oracle = c.responses.create(model="m", input="And of Portugal?", previous_response_id=first.id,
                                max_output_tokens=20, temperature=0)  # fmt: skip
    gw.stop_gateway()
    gw.restart_daemon()
    gw.start_gateway()
    again = c.responses.create(model="m", input="And of Portugal?", previous_response_id=first.id,
                               max_output_tokens=20, temperature=0)  # fmt: skip
    assert again.output_text and again.output_text == oracle.output_text and again.status == oracle.status
    # Re-created from the stored items on a daemon with nothing cached: reported as computed, not cached.
    assert first.usage is not None and oracle.usage is not None and again.usage is not None
    assert oracle.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    assert again.usage.input_tokens == oracle.usage.input_tokens  # the same prompt, token for token


@pytest.mark.slow
def test_a_streamed_response_is_stored_while_it_streams_and_when_its_client_leaves(gw: Stack) -> None:
    c = client(gw)
    events = c.responses.create(model="m", input="Count from 1 to 1000.", max_output_tokens=2000, temperature=0,
                                stream=True)  # fmt: skip
    response_id = None
    for event in events:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            break
    assert response_id is not None
    assert c.responses.retrieve(response_id).status == "in_progress"
    events.close()  # the client leaves mid-stream: the turn is cancelled and stored as it ended
    deadline = time.monotonic() + 60
    while (left := c.responses.retrieve(response_id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert left.status == "cancelled" and left.output and left.output[-1].status == "incomplete"


def test_a_response_still_running_is_not_continued_yet() -> None:
    from cbd.gateway.errors import ApiError
    from cbd.gateway.responses.routes import _check_continuable

    _check_continuable(Stored("resp_1", "a", "s1", 1, 0.0, None, [], [], {"status": "completed", "output": []}))
    running = Stored("resp_2", "a", None, 1, 0.0, None, [], [], {"status": "in_progress", "output": []})
    with pytest.raises(ApiError, match="still in_progress") as refused:
        _check_continuable(running)
    assert refused.value.param == "previous_response_id"


def test_a_response_left_in_progress_by_a_stopped_gateway_is_failed_by_the_next(tmp_path) -> None:
    import asyncio

    from cbd.gateway.responses.store import ORPHANED

    async def scenario() -> None:
        before = ResponseStore(StoreSettings(tmp_path))
        await before.put(Stored("resp_1", "a", None, 1, time.time(), None, [], [], {"status": "in_progress"}))
        await before.put(Stored("resp_2", "a", "s2", 1, time.time(), None, [], [], {"status": "completed"}))
        after = ResponseStore(StoreSettings(tmp_path))  # the next gateway on the state directory
        orphan, done = await after.get("a", "resp_1"), await after.get("a", "resp_2")
        assert orphan is not None and orphan[0].response["status"] == "failed"
        assert orphan[0].response["error"] == {"code": "server_error", "message": ORPHANED}
        assert done is not None and done[0].response == {"status": "completed"}

    asyncio.run(scenario())


def _row(owner: str, n: int, created_at: float) -> Stored:
    return Stored(f"resp_{n}", owner, f"s{n}", 1, created_at, None, [], [], {"id": f"resp_{n}"})


def test_the_store_is_scoped_by_owner_and_bounded(tmp_path) -> None:
    import asyncio

    async def scenario() -> None:
        store = ResponseStore(StoreSettings(tmp_path, ttl_seconds=3600, max_rows=2))
        now = time.time()
        await store.put(_row("a", 1, now - 7200))  # older than the TTL: never served, deleted on the next write
        assert await store.get("a", "resp_1") is None
        for n in (2, 3, 4):
            await store.put(_row("a", n, now - 10 + n))
        assert await store.get("a", "resp_2") is None  # beyond the cap of two: the oldest went
        found = await store.get("a", "resp_4")
        assert found is not None and found[1]  # the latest (only) turn of its session
        assert await store.get("b", "resp_4") is None and not await store.delete("b", "resp_4")
        assert await store.delete("a", "resp_4") and await store.get("a", "resp_4") is None
        (rows,) = store._db.execute("SELECT COUNT(*) FROM responses").fetchone()
        assert rows == 1
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        # A rewrite of a stored response (a background one finishing) and a deletion keep the count exact:
        # the cap never takes a row early.
        await store.put(_row("a", 5, now))
        await store.put(_row("a", 5, now))
        assert await store.get("a", "resp_3") is not None and await store.get("a", "resp_5") is not None

    asyncio.run(scenario())


@pytest.mark.slow
def test_prompt_cache_key_is_the_affinity_key_of_the_sessions_it_names(gw: Stack) -> None:
    def session_of(response: Any) -> str:
        return str(response.id).split("_", 1)[1].rsplit("_", 1)[0]  # resp_<session>_<turn>

    def affinity(response: Any) -> str:
        return session_of(response).split(".", 1)[0]  # what a proxy routes by (cbd_client affinity_key)

    c, other = client(gw), client(gw, OTHER_TOKEN)
    a = c.responses.create(model="m", input="Say A.", max_output_tokens=4, prompt_cache_key="repo-1")
    b = c.responses.create(model="m", input="Say B.", max_output_tokens=4, prompt_cache_key="repo-1")
    d = c.responses.create(model="m", input="Say D.", max_output_tokens=4, prompt_cache_key="repo-2")
    e = other.responses.create(model="m", input="Say E.", max_output_tokens=4, prompt_cache_key="repo-1")
    plain = c.responses.create(model="m", input="Say F.", max_output_tokens=4)
    assert session_of(a) != session_of(b) and affinity(a) == affinity(b)  # two sessions, one replica
    assert len({affinity(a), affinity(d), affinity(e), affinity(plain)}) == 4  # per key and per caller
    assert "repo-1" not in a.id and a.prompt_cache_key == "repo-1"  # echoed, never in an id
    then = c.responses.create(model="m", input="Again.", max_output_tokens=4, previous_response_id=a.id)
    assert affinity(then) == affinity(a)
    with pytest.raises(openai.BadRequestError, match="prompt_cache_key"):
        c.responses.create(model="m", input="x", prompt_cache_key="k" * 300)
