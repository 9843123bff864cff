"""The frontend's part in saving sessions (`--disk-kv-dir`): the engine writes the files
(engine/sessions/checkpoints.py); the frontend hands it the chat transcripts that go with them.

  start       the transcripts of the sessions the engine restored come back (`restore_transcripts`)
  serving     every few seconds, the transcripts that changed go over and the engine saves the changed
              sessions idle for `session_save_idle` seconds (`save_in_background`)
  shutdown    after live requests have ended: every changed session, with its KV within
              `session_save_seconds` (`save_at_shutdown`)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re

from cbd.engine import api
from cbd.engine.outputs import SaveReport
from cbd.ipc.remote import RemoteEngine
from cbd.server.chats import ChatLogs

log = logging.getLogger(__name__)


def owner_name(addresses: list[str]) -> str:
    """The default `--disk-kv-owner`: the listen addresses, readable and made unique by a short hash."""
    text = ",".join(addresses)
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_.-")[:80] or "daemon"
    return f"{readable}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


async def restore_transcripts(engine: RemoteEngine, chats: ChatLogs) -> None:
    chats.restore(await asyncio.wrap_future(engine.ask(api.SavedNotes())))


async def save_in_background(engine: RemoteEngine, chats: ChatLogs, idle_for: float) -> None:
    """Runs until cancelled; a failed round is logged and the next one tries again."""
    interval = min(5.0, max(0.5, idle_for / 2))
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.wrap_future(engine.ask(api.SaveSessions(chats.notes(), None, idle_for)))
        except Exception as exc:  # the engine stopping, or a bug: sessions are saved at shutdown anyway
            log.warning("saving idle sessions failed: %s", exc)


async def save_at_shutdown(engine: RemoteEngine, chats: ChatLogs, seconds: float) -> SaveReport | None:
    try:
        return await asyncio.wrap_future(engine.ask(api.SaveSessions(chats.notes(), seconds), draining=True))
    except Exception as exc:
        log.error("saving sessions at shutdown failed: %s", exc)
        return None
