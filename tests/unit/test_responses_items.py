"""The Responses API's items without a daemon: input items listed as the API lists them, and which output
items a reply cut off by max_output_tokens marks incomplete (only the last: the ones before it closed)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
from cbd.gateway.agentic.blocks import Fold  # noqa: E402
from cbd.gateway.responses.items import input_items  # noqa: E402
from cbd.gateway.responses.stream import Events  # noqa: E402
from cbd_client.v1 import cbd_pb2 as pb  # noqa: E402


def test_input_items_list_message_content_as_parts_with_a_status() -> None:
    given = [
        {"role": "user", "content": "one"},
        {"type": "message", "role": "assistant", "content": "two"},
        {"role": "user", "content": [{"type": "input_text", "text": "three"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    listed = input_items(given)
    assert [i["content"] for i in listed[:3]] == [
        [{"type": "input_text", "text": "one"}],
        [{"type": "output_text", "text": "two", "annotations": []}],
        [{"type": "input_text", "text": "three"}],
    ]
    assert [i.get("status") for i in listed] == ["completed"] * 4 + [None]
    assert all(i["id"] for i in listed) and input_items("hi")[0]["content"] == [{"type": "input_text", "text": "hi"}]


def _calls(*calls: tuple[int, str, str], finish: int = pb.FINISH_REASON_UNSPECIFIED) -> pb.GenerateResponse:
    deltas = [pb.ToolCallDelta(index=i, id=f"call_{i}", name="weather", arguments=a) for i, _, a in calls]
    return pb.GenerateResponse(candidates=[pb.CandidateDelta(index=0, tool_calls=deltas, finish_reason=finish)])


@pytest.mark.parametrize(("finish", "last"), [(pb.FINISH_REASON_LENGTH, "incomplete"),
                                              (pb.FINISH_REASON_TOOL_CALLS, "completed")])  # fmt: skip
def test_only_the_last_output_item_of_a_cut_reply_is_incomplete(finish: int, last: str) -> None:
    fold = Fold()
    events = Events(fold)
    chunks = []
    for response in (_calls((0, "", '{"city": "Paris"}')), _calls((1, "", '{"city": "Rome"}')),
                     _calls((2, "", '{"city":'), finish=finish)):  # fmt: skip
        for event in fold.add(response):
            chunks += events.of(event)
    for event in fold.end(at_least_one=True):
        chunks += events.of(event)
    done = [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks if b"response.output_item.done" in c]
    assert [d["item"]["status"] for d in done] == ["completed", "completed", last]
    status = "completed" if last == "completed" else "incomplete"
    assert [i["status"] for i in events.output(status)] == ["completed", "completed", last]


def test_a_last_call_whose_arguments_are_whole_is_completed_though_the_reply_was_cut() -> None:
    """The cut fell in a next call never begun (dropped): the call before it closed whole."""
    fold = Fold()
    events = Events(fold)
    chunks = []
    for response in (_calls((0, "", '{"city": "Oslo"}')), _calls(finish=pb.FINISH_REASON_LENGTH)):
        for event in fold.add(response):
            chunks += events.of(event)
    for event in fold.end(at_least_one=True):
        chunks += events.of(event)
    done = [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks if b"response.output_item.done" in c]
    assert [d["item"]["status"] for d in done] == ["completed"]
    assert [i["status"] for i in events.output("incomplete")] == ["completed"]
