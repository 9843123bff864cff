"""A daemon's hold on its folder of a session directory: an exclusive flock on `<owner>.lock` beside it,
for the daemon's life (and taken for a moment by another daemon claiming a session from a folder whose
owner is gone). No torch here: the frontend's pre-flight check asks it too, before anything is bound."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path
from typing import IO

from cbd.errors import SettingError

LOCK_WAIT = 5.0  # seconds a starting daemon waits for its owner lock (held for a moment by a claim)


def hold(root: Path, owner: str, wait: float) -> IO[str] | None:
    """The owner's lock (its folder made), waiting up to `wait` seconds for it (another daemon may hold it for
    the moment of a claim); None if it stayed held."""
    try:
        (root / owner).mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = open(root / f"{owner}.lock", "a+")  # noqa: SIM115 (held for the daemon's life, or a claim)
    except OSError as exc:
        raise SettingError(f"disk_kv_dir {str(root)!r}: {exc.strerror or exc}") from None
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() >= deadline:
                lock.close()
                return None
            time.sleep(0.05)
