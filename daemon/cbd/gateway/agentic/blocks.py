"""One candidate's Generate stream folded into output blocks: runs of text and tool calls, in order.

Both agent APIs answer with a list of blocks (Responses: `message` and `function_call` output items;
Messages: `text` and `tool_use` content blocks) and stream each as open, deltas, close. `Fold` turns
the daemon's deltas into those three events once, so each API only names them in its own vocabulary.
A block is open until the next one starts or the stream ends: at most one is open at a time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cbd_client.v1 import cbd_pb2 as pb


class BlockKind(enum.Enum):
    TEXT = "text"
    CALL = "call"


class EventKind(enum.Enum):
    OPEN = "open"
    DELTA = "delta"
    CLOSE = "close"


@dataclass(slots=True)
class Block:
    kind: BlockKind
    text: str = ""  # the text, or a call's arguments (JSON text)
    call_id: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    index: int  # the block's position in Fold.blocks
    delta: str = ""


@dataclass(slots=True)
class Fold:
    blocks: list[Block] = field(default_factory=list)
    finish: pb.FinishReason = pb.FINISH_REASON_UNSPECIFIED
    usage: pb.Usage | None = None
    request_id: str = ""
    token_texts: list[str] = field(default_factory=list)  # the tokens' texts, when logprobs were asked for
    _open: int | None = None
    _calls: dict[int, int] = field(default_factory=dict)  # the daemon's call index -> block index

    def add(self, response: pb.GenerateResponse) -> list[Event]:
        """Fold one response of the stream in (candidate 0: these APIs sample one); the events it makes."""
        self.request_id = self.request_id or response.request_id
        if response.HasField("usage"):
            self.usage = response.usage
        events: list[Event] = []
        for c in response.candidates:
            if c.index != 0:
                continue
            if c.text:
                if self._open is None or self.blocks[self._open].kind is not BlockKind.TEXT:
                    self._start(Block(BlockKind.TEXT), events)
                assert self._open is not None
                self.blocks[self._open].text += c.text
                events.append(Event(EventKind.DELTA, self._open, c.text))
            for t in c.tool_calls:
                if t.index not in self._calls:
                    self._start(Block(BlockKind.CALL, call_id=t.id, name=t.name), events)
                    assert self._open is not None
                    self._calls[t.index] = self._open
                if t.arguments:
                    at = self._calls[t.index]
                    self.blocks[at].text += t.arguments
                    events.append(Event(EventKind.DELTA, at, t.arguments))
            self.token_texts.extend(lp.token for lp in c.logprobs)
            if c.finish_reason:
                self.finish = c.finish_reason
        return events

    def end(self, at_least_one: bool = False) -> list[Event]:
        """Close the open block (at the end of the stream); `at_least_one`: an empty reply is one empty
        text block."""
        events: list[Event] = []
        if at_least_one and not self.blocks:
            self._start(Block(BlockKind.TEXT), events)
        if self._open is not None:
            events.append(Event(EventKind.CLOSE, self._open))
            self._open = None
        return events

    def _start(self, block: Block, events: list[Event]) -> None:
        events.extend(self.end())
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        events.append(Event(EventKind.OPEN, self._open))

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind is BlockKind.TEXT)

    def reply(self) -> dict[str, object]:
        """The reply as a normalised chat message (as a client sends it back)."""
        calls = [
            {"id": b.call_id, "name": b.name, "arguments": b.text} for b in self.blocks if b.kind is BlockKind.CALL
        ]
        message: dict[str, object] = {"role": "assistant", "content": self.text}
        if calls:
            message["tool_calls"] = calls
        return message
