"""Stored responses: SQLite (stdlib, WAL) in the gateway's state directory, bounded by a TTL and a row cap.

A row is one response: its owner (the caller key, a sha256 of the token: never the token), the cbd
session and turn that produced it, the instructions it ran under, the conversation through its output
(chat messages, without the instructions: what re-creates the session when it is gone), its input
items and the response object. The `sessions` table counts the turns each cbd session has taken: a
response is the latest of its session when its turn equals that count, and only then can it be
continued as a turn of that session. Every read is scoped by owner, so another key's id is not found.

Reads never return a row older than the TTL; such rows are deleted by a sweep on the first write and
then at most every SWEEP_SECONDS. The oldest rows beyond the cap are deleted by the write that passes it
(the row count is kept in memory between sweeps, so a write costs no table scan). Calls run in a worker
thread (one connection, one lock); the event loop never waits on the disk. Commits are WAL appends
without an fsync each (synchronous=NORMAL): a stored response survives the gateway's crash or restart,
and only a crash of the host itself may lose the last moments' responses (whose continuations then
answer not found). Many agents finishing a turn at once would otherwise queue behind one fsync each.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT, turn INTEGER NOT NULL,
    created_at REAL NOT NULL, instructions TEXT, conversation TEXT NOT NULL, input_items TEXT NOT NULL,
    response TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, turns INTEGER NOT NULL, updated_at REAL NOT NULL);
"""
SWEEP_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class StoreSettings:
    directory: Path
    ttl_seconds: float = 30 * 86400.0  # a stored response is deleted this long after it was made
    max_rows: int = 100_000  # the oldest responses beyond this many are deleted

    def __post_init__(self) -> None:
        if not self.ttl_seconds > 0:
            raise ValueError(f"responses TTL must be > 0 seconds, got {self.ttl_seconds}")
        if self.max_rows < 1:
            raise ValueError(f"responses row cap must be >= 1, got {self.max_rows}")


@dataclass(slots=True)
class Stored:
    id: str
    owner: str
    session_id: str | None  # None: not continuable as a session turn (a plain call, or a turn that failed)
    turn: int
    created_at: float
    instructions: str | None
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    response: dict[str, Any]


class ResponseStore:
    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        self.path = settings.directory / "responses.sqlite3"
        self._conn: sqlite3.Connection | None = None  # opened on first use (in a worker thread)
        self._lock = threading.Lock()
        self._rows = 0  # rows in the table: counted by each sweep, kept by the writes and deletes since
        self._next_sweep = 0.0

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self.settings.directory.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            _end_orphans(conn)
            self._conn = conn
        return self._conn

    async def put(self, s: Stored) -> None:
        """Store a response; a response with a session also becomes its session's latest turn."""
        await asyncio.to_thread(self._put, s)

    async def get(self, owner: str, response_id: str) -> tuple[Stored, bool] | None:
        """The owner's response and whether it is the latest turn of its session (None: no such response)."""
        return await asyncio.to_thread(self._get, owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await asyncio.to_thread(self._delete, owner, response_id)

    def _put(self, s: Stored) -> None:
        now = time.time()
        row = (s.id, s.owner, s.session_id, s.turn, s.created_at, s.instructions, json.dumps(s.conversation),
               json.dumps(s.input_items), json.dumps(s.response))  # fmt: skip
        with self._lock, self._db:
            self._db.execute("BEGIN")
            new = self._db.execute("SELECT 1 FROM responses WHERE id = ?", (s.id,)).fetchone() is None
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            if s.session_id is not None:
                self._db.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?)", (s.session_id, s.turn, now))
            self._rows += new
            if time.monotonic() >= self._next_sweep:  # a stepped wall clock never stops the sweeps
                self._next_sweep = time.monotonic() + SWEEP_SECONDS
                self._db.execute("DELETE FROM responses WHERE created_at < ?", (now - self.settings.ttl_seconds,))
                self._db.execute("DELETE FROM sessions WHERE updated_at < ?", (now - self.settings.ttl_seconds,))
                (self._rows,) = self._db.execute("SELECT COUNT(*) FROM responses").fetchone()
            if self._rows > self.settings.max_rows:
                self._db.execute(
                    "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at LIMIT ?)",
                    (self._rows - self.settings.max_rows,),
                )
                self._rows = self.settings.max_rows

    def _get(self, owner: str, response_id: str) -> tuple[Stored, bool] | None:
        oldest = time.time() - self.settings.ttl_seconds
        with self._lock:
            row = self._db.execute(
                "SELECT r.*, s.turns FROM responses r LEFT JOIN sessions s ON r.session_id = s.session_id "
                "WHERE r.id = ? AND r.owner = ? AND r.created_at >= ?",
                (response_id, owner, oldest),
            ).fetchone()
        if row is None:
            return None
        rid, owner_, session_id, turn, created_at, instructions, conversation, given, response, turns = row
        stored = Stored(rid, owner_, session_id, turn, created_at, instructions, json.loads(conversation),
                        json.loads(given), json.loads(response))  # fmt: skip
        return stored, session_id is not None and turns == turn

    def _delete(self, owner: str, response_id: str) -> bool:
        with self._lock, self._db:
            cursor = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
            self._rows -= cursor.rowcount
            return cursor.rowcount > 0


ORPHANED = "the gateway stopped while this response ran"


def _end_orphans(conn: sqlite3.Connection) -> None:
    """Responses stored as in_progress by a gateway that stopped (its background tasks and streams died with
    it) are failed: a client polling one sees it end instead of waiting forever."""
    rows = conn.execute("SELECT id, response FROM responses WHERE response LIKE '%\"in\\_progress\"%' ESCAPE '\\'")
    for response_id, text in rows.fetchall():
        response = json.loads(text)
        if response.get("status") == "in_progress":
            response.update(status="failed", error={"code": "server_error", "message": ORPHANED})
            conn.execute("UPDATE responses SET response = ? WHERE id = ?", (json.dumps(response), response_id))
