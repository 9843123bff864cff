"""Chat transcripts of sessions: the frontend's half of a chat session.

The engine keeps a session's token ids and KV and knows only whether its history is a rendered
conversation; the messages live here, one `ChatLog` per chat session, and are touched only on the
event loop's thread. A chat turn is rendered and submitted in one synchronous step (no await
between reading the transcript and queueing the turn), and the log refuses a second turn until the
first has ended, so a turn never renders a stale history. What the turn did to the session is
decided by the engine's answers alone (its last output's `turn_ok`), whether or not the caller is still
listening:

  refused (the engine did not take it)      nothing changes
  ended, every candidate STOP / LENGTH      n = 1: the reply joins the conversation;
                                            n > 1: each candidate's conversation waits as a branch
  ended otherwise (cancelled, failed)       the conversation the turn continued (a chosen branch
                                            becomes the history, as it does in the engine)

Replies are decoded here from the streamed token ids (EOS dropped, special tokens skipped).

With session files (`--disk-kv-dir`) a chat's transcript is saved with its session as the session's
note (`notes`: the logs changed since they were last handed over, as JSON) and comes back from the
notes of the sessions restored at start (`restore`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cbd.engine.outputs import RequestOutput
from cbd.errors import SessionBusy


@dataclass(slots=True)
class ChatTurn:
    base: list[dict]  # the conversation the turn continues
    messages: list[dict]  # base + the turn's new messages: what was rendered
    n: int
    from_branch: bool  # base is a pending candidate's conversation (the engine adopts it at once)
    replies: dict[int, list[int]] = field(default_factory=dict)  # candidate -> streamed token ids


@dataclass(slots=True)
class ChatLog:
    # Lists are replaced, never changed in place, so a snapshot (fork) needs no copy.
    messages: list[dict] = field(default_factory=list)
    branches: list[list[dict]] = field(default_factory=list)  # pending candidates' conversations
    turn: ChatTurn | None = None  # the turn in flight


class ChatLogs:
    def __init__(self, tokenizer: Any | None, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.logs: dict[str, ChatLog] = {}
        self._forks: dict[str, list[dict]] = {}  # forks being made -> the conversation each continues
        self._noted: dict[str, bytes] = {}  # the note each log had when it was last handed over

    def open(self, session_id: str, messages: list[dict]) -> None:
        self.logs[session_id] = ChatLog(list(messages))

    def fork_pending(self, session_id: str, messages: list[dict]) -> list[dict]:
        """A fork about to be made continues `messages`: known before the engine makes it, so that a fork of
        the new session that races with this one (it can only succeed once the engine has made it) finds
        its conversation (`conversation`). Nothing else sees it (turns, notes) until `fork_made`. Returns
        the token that fork_made / fork_refused take."""
        pending = self._forks[session_id] = list(messages)
        return pending

    def fork_made(self, session_id: str, pending: list[dict]) -> None:
        """The engine made the fork: its transcript is the conversation it continues."""
        self.fork_refused(session_id, pending)  # no longer pending
        self.logs[session_id] = ChatLog(pending)
        self._noted.pop(session_id, None)

    def fork_refused(self, session_id: str, pending: list[dict]) -> None:
        """The fork was not made (or is made now): it is no longer pending (unless another took its id)."""
        if self._forks.get(session_id) is pending:
            del self._forks[session_id]

    def forget(self, session_id: str) -> None:
        """The session was closed or expired."""
        self.logs.pop(session_id, None)
        self._noted.pop(session_id, None)

    def notes(self) -> dict[str, bytes]:
        """Each chat's transcript (messages and pending candidates' conversations) that changed since the
        last call, as its session's note; a turn in flight is not in it (the session is saved as before it)."""
        changed = {}
        for session_id, log in self.logs.items():
            note = json.dumps({"messages": log.messages, "branches": log.branches}, separators=(",", ":")).encode()
            if self._noted.get(session_id) != note:
                changed[session_id] = self._noted[session_id] = note
        return changed

    def restore(self, notes: dict[str, bytes]) -> None:
        """The transcripts of sessions restored from their files at start."""
        for session_id, note in notes.items():
            if session_id in self.logs:
                continue
            saved = json.loads(note)
            self.logs[session_id] = ChatLog(saved["messages"], saved["branches"])
            self._noted[session_id] = note

    def conversation(self, session_id: str, candidate: int | None) -> list[dict] | None:
        """The conversation a fork continues (None: not a chat session); of a fork being made too."""
        log = self.logs.get(session_id)
        if log is None:
            return self._forks.get(session_id)
        if log.branches and candidate is not None and 0 <= candidate < len(log.branches):
            return log.branches[candidate]
        return log.messages

    def begin_turn(
        self, session_id: str, parent: int | None, new_messages: list[dict], n: int, whole: bool = False
    ) -> ChatTurn:
        """Start a chat turn: the conversation it renders (`whole`: new_messages are all of it, and the
        engine checks they extend the history token for token). Refused while another turn is in flight.
        The engine still decides whether the turn may run (it reports back through `refused`)."""
        log = self.logs.setdefault(session_id, ChatLog())
        if log.turn is not None:
            raise SessionBusy(f"session {session_id!r} already has a turn in flight")
        from_branch = bool(log.branches) and parent is not None and 0 <= parent < len(log.branches)
        base = log.branches[parent] if from_branch else log.messages  # type: ignore[index]
        log.turn = ChatTurn(base, list(new_messages) if whole else base + new_messages, n, from_branch)
        return log.turn

    def refused(self, session_id: str, turn: ChatTurn) -> None:
        """The engine did not take the turn: nothing changes."""
        log = self.logs.get(session_id)
        if log is not None and log.turn is turn:
            log.turn = None
            self._drop_if_empty(session_id, log)

    def on_output(self, session_id: str, turn: ChatTurn, out: RequestOutput) -> None:
        """Fold one output of the turn in; at its last output, settle the conversation."""
        for d in out.candidates:
            if d.token_ids:
                turn.replies.setdefault(d.index, []).extend(d.token_ids)
        if not out.finished:
            return
        log = self.logs.get(session_id)
        if log is None or log.turn is not turn:
            return  # closed or expired meanwhile
        log.turn = None
        if not out.turn_ok:  # the engine's verdict (RequestOutput.turn_ok): the history is what it says
            if turn.from_branch:
                log.messages, log.branches = turn.base, []
            self._drop_if_empty(session_id, log)
            return
        conversations = [turn.messages + [self._reply(turn.replies.get(i, []))] for i in range(turn.n)]
        if turn.n == 1:
            log.messages, log.branches = conversations[0], []
        else:
            log.messages, log.branches = turn.base, conversations

    def _reply(self, token_ids: list[int]) -> dict:
        text = ""
        if self.tokenizer is not None:
            reply = [t for t in token_ids if t not in self.eos_token_ids]
            text = self.tokenizer.decode(reply, skip_special_tokens=True)
        return {"role": "assistant", "content": text}

    def _drop_if_empty(self, session_id: str, log: ChatLog) -> None:
        """A log made by a first turn that did not end well: the session is not a chat (yet)."""
        if not log.messages and not log.branches and log.turn is None:
            del self.logs[session_id]
