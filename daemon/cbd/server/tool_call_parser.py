"""Streams a reply apart into text and tool calls as it is generated.

Text that could still be the start of a call is held back until it cannot (as stop strings are); a call is
announced (id and name) once its name is complete, and its arguments follow as fragments while they are
generated. The arguments object ends where its braces balance (strings and escapes respected): the end
marker of some formats is a bare `}`, which a nested object also contains. The reply was constrained by
the format's grammar, so what follows the begin marker is well formed; a reply cut by max_tokens may end
inside a call, whose arguments are then incomplete, or before its name is complete, when nothing of it
is announced and nothing of it is text. With calls_only (tool_choice required or named) the grammar lets
nothing but calls and the separators between them through, so nothing is text. With formatted (calls or
text in a response format) a reply is one or the other: after a call nothing is text (the separators), and
a reply that ended after a call's begin marker with a closed string where the name should be (names have
no quotes) but no complete call start was text in the format that contains the marker (a JSON object whose
first key is "name", for llama3_json): it is released as text at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from cbd.server.tool_calls import CallFormat, new_call_id


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # which call of the candidate, from 0
    id: str = ""  # set on the call's first delta
    name: str = ""  # set on the call's first delta
    arguments: str = ""  # the next fragment of the arguments' JSON text


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    complete: bool


class ToolCallParser:
    def __init__(self, fmt: CallFormat, calls_only: bool = False, formatted: bool = False) -> None:
        self.fmt = fmt
        self.calls_only = calls_only
        self.formatted = formatted
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._state = "text"  # text -> name -> arguments -> end -> text
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The plain text that is certain now, and the call deltas, for the next piece of the reply."""
        self._buffer += text
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        progressed = True
        while progressed and self._buffer:
            progressed = getattr(self, f"_{self._state}")(out, deltas)
        return "".join(out), deltas

    def finish(self) -> str:
        """The reply has ended: text still held back is text after all, unless it is a call's start (the
        trigger was written, so the grammar had begun a call that the end cut short)."""
        if self._state == "end":  # the arguments balanced; only (part of) the end marker was left
            self.calls[-1].complete = True
            self._state, self._buffer = "text", ""
        quote = self._buffer.find('"')
        if (
            self._state == "name"
            and self.formatted
            and quote >= 0
            and not self.fmt.between.startswith(self._buffer[quote:])
        ):
            # A name has no quotes: what followed the begin marker closed a string that was no tool's name.
            rest, self._buffer, self._state = self.fmt.begin + self._buffer, "", "text"
            return rest
        if self._state != "text":
            return ""
        rest, self._buffer = self._buffer, ""
        return "" if self._no_text or rest.startswith(self.fmt.trigger) else rest

    @property
    def _no_text(self) -> bool:
        return self.calls_only or (self.formatted and bool(self.calls))

    @property
    def complete_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if c.complete]

    def _text(self, out: list[str], deltas: list[ToolCallDelta]) -> bool:
        begin = self.fmt.begin
        at = self._buffer.find(begin)
        if at < 0:
            keep = _partial_suffix(self._buffer, begin)
            if not self._no_text:
                out.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        if not self._no_text:
            out.append(self._buffer[:at])
        self._buffer = self._buffer[at + len(begin) :]
        self._state = "name"
        return True

    def _name(self, out: list[str], deltas: list[ToolCallDelta]) -> bool:
        at = self._buffer.find(self.fmt.between)
        if at < 0:
            return False
        call = ToolCall(new_call_id(), self._buffer[:at], "", False)
        self.calls.append(call)
        deltas.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name))
        self._buffer = self._buffer[at + len(self.fmt.between) :]
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
        return True

    def _arguments(self, out: list[str], deltas: list[ToolCallDelta]) -> bool:
        taken = 0
        for ch in self._buffer:
            taken += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "end"
                    break
        fragment, self._buffer = self._buffer[:taken], self._buffer[taken:]
        call = self.calls[-1]
        call.arguments += fragment
        deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=fragment))
        return self._state == "end"

    def _end(self, out: list[str], deltas: list[ToolCallDelta]) -> bool:
        end = self.fmt.end
        if len(self._buffer) < len(end) and end.startswith(self._buffer):
            return False
        if self._buffer.startswith(end):
            self._buffer = self._buffer[len(end) :]
        self.calls[-1].complete = True
        self._state = "text"
        return True


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
