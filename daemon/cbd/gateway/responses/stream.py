"""The Responses API's streaming events, numbered by sequence_number, from a folded Generate stream.

Order: response.created, response.in_progress; per output item: response.output_item.added, then for a
message response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, and for a call response.function_call_arguments.delta...,
response.function_call_arguments.done; then response.output_item.done. Last: response.completed,
response.incomplete (max_output_tokens) or response.failed (with the error).
"""

from __future__ import annotations

import json
from typing import Any

from cbd.gateway.agentic.blocks import BlockKind, Event, EventKind, Fold
from cbd.gateway.errors import ApiError
from cbd.gateway.responses import items
from cbd_client.v1 import cbd_pb2 as pb


def reply_status(finish: pb.FinishReason) -> str:
    """A response's status by how its reply ended: cut off by max_output_tokens, ended by the daemon, or done."""
    return {pb.FINISH_REASON_LENGTH: "incomplete", pb.FINISH_REASON_ERROR: "failed",
            pb.FINISH_REASON_ABORT: "failed"}.get(finish, "completed")  # fmt: skip


class Events:
    def __init__(self, fold: Fold) -> None:
        self.fold = fold
        self.ids: list[str] = []  # one output item id per block, made when the block opens
        self._seq = 0

    def sse(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def lifecycle(self, kind: str, response: dict[str, Any]) -> bytes:
        return self.sse(kind, response=response)

    def of(self, event: Event) -> list[bytes]:
        block = self.fold.blocks[event.index]
        text = block.kind is BlockKind.TEXT
        if event.kind is EventKind.OPEN:
            self.ids.append(items.new_id("msg" if text else "fc"))
        where = {"item_id": self.ids[event.index], "output_index": event.index}
        if event.kind is EventKind.OPEN:
            item = (items.message_item(self.ids[event.index], "", "in_progress") if text else
                    items.call_item(self.ids[event.index], block.call_id, block.name, "", "in_progress"))  # fmt: skip
            if not text:
                return [self.sse("response.output_item.added", output_index=event.index, item=item)]
            item["content"] = []
            return [self.sse("response.output_item.added", output_index=event.index, item=item),
                    self.sse("response.content_part.added", **where, content_index=0, part=_part(""))]  # fmt: skip
        if event.kind is EventKind.DELTA:
            if text:
                return [
                    self.sse("response.output_text.delta", **where, content_index=0, delta=event.delta, logprobs=[])
                ]
            return [self.sse("response.function_call_arguments.delta", **where, delta=event.delta)]
        done = self.item(event.index, self._closed_status(event.index))
        if text:
            return [
                self.sse("response.output_text.done", **where, content_index=0, text=block.text, logprobs=[]),
                self.sse("response.content_part.done", **where, content_index=0, part=_part(block.text)),
                self.sse("response.output_item.done", output_index=event.index, item=done),
            ]
        return [self.sse("response.function_call_arguments.done", **where, name=block.name, arguments=block.text),
                self.sse("response.output_item.done", output_index=event.index, item=done)]  # fmt: skip

    def item(self, index: int, status: str) -> dict[str, Any]:
        block = self.fold.blocks[index]
        if block.kind is BlockKind.TEXT:
            return items.message_item(self.ids[index], block.text, status)
        return items.call_item(self.ids[index], block.call_id, block.name, block.text, status)

    def output(self, status: str) -> list[dict[str, Any]]:
        """The output items; `status` is the last one's (only the last can have been cut off: a block
        closes when the next one starts), every one before it is completed, as is a last call whose
        arguments are whole (the cut fell after them, e.g. in a next call never begun)."""
        last = len(self.fold.blocks) - 1
        return [self.item(i, status if i == last and not self._whole_call(i) else "completed") for i in range(last + 1)]

    def _closed_status(self, index: int) -> str:
        """A closing block's status: incomplete when it is the last and the reply was cut off in it."""
        cut = reply_status(self.fold.finish) != "completed"
        return (
            "incomplete" if cut and index == len(self.fold.blocks) - 1 and not self._whole_call(index) else "completed"
        )

    def _whole_call(self, index: int) -> bool:
        """The block is a call whose arguments are a whole JSON object."""
        block = self.fold.blocks[index]
        if block.kind is not BlockKind.CALL:
            return False
        try:
            return isinstance(json.loads(block.text), dict)
        except ValueError:
            return False


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def failure(error: ApiError) -> dict[str, str]:
    """A failed response's `error`, with one of the API's codes."""
    code = {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(error.status, "server_error")
    return {"code": code, "message": error.message}
