"""Routing a call through a proxy in front of several daemons: its affinity key, and the replica to ask for.

Every call about a session carries the `x-cbd-affinity` header with the session's affinity key (the id
up to its first '.'; a fork's id starts with its source's key, so it lands where the shared KV is); a
plain call may name a key of its own (`affinity=`). Behind Envoy (deploy/envoy.py), a call with `x-cbd-affinity` is routed by hashing that key; the proxy
answers with `x-cbd-replica` (the replica it chose, opaque to the client), and a later call that sends it
back goes to that same replica while it is healthy, whatever else changed: a consistent-hash ring moves
some keys between the remaining replicas when one leaves, which would otherwise strand sessions that
are alive. If that replica is gone, the proxy hashes the key again and says which replica it chose
instead. Without a proxy the header never comes and nothing is sent. Remembered per affinity key, the
most recent `MAX_KEYS` keys.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable

from cbd_client.contract import AFFINITY_HEADER, REPLICA_HEADER

MAX_KEYS = 65536
Metadata = tuple[tuple[str, str], ...]


def affinity_key(session_id: str) -> str:
    """The part of a session id a proxy routes by: up to the first '.'."""
    return session_id.split(".", 1)[0]


def new_session_id() -> str:
    return uuid.uuid4().hex


def fork_session_id(source: str) -> str:
    """A fork's id: its source's affinity key, so that it lands on the daemon that holds the shared KV."""
    return f"{affinity_key(source)}.{uuid.uuid4().hex[:16]}"


def with_affinity(metadata: Metadata | None, session_id: str | None, routes: Routes | None = None) -> Metadata | None:
    """metadata plus the affinity header of session_id (a session id or a plain call's key) and, when a
    proxy named one for that key earlier, the replica header (`routes`)."""
    if not session_id:
        return metadata
    key = affinity_key(session_id)
    replica = routes.header(key) if routes is not None else None
    return (*(metadata or ()), (AFFINITY_HEADER, key), *((replica,) if replica else ()))


class Routes:
    def __init__(self) -> None:
        self._replicas: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def header(self, key: str) -> tuple[str, str] | None:
        """The header to send with a call routed by `key`, if the proxy named a replica for it."""
        with self._lock:
            replica = self._replicas.get(key)
            if replica is not None:
                self._replicas.move_to_end(key)
        return (REPLICA_HEADER, replica) if replica else None

    def learn(self, key: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """Remember the replica the proxy named in a response's headers for `key` (if it named one)."""
        for name, value in metadata or ():
            if name == REPLICA_HEADER and value:
                with self._lock:
                    self._replicas[key] = value if isinstance(value, str) else value.decode()
                    self._replicas.move_to_end(key)
                    while len(self._replicas) > MAX_KEYS:
                        self._replicas.popitem(last=False)
                return
