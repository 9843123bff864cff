"""Which replica a proxy should send an affinity key's calls to: the `x-cbd-replica` header it returned.

Behind Envoy (deploy/envoy.py), a call with `x-cbd-affinity` is routed by hashing that key; the proxy
answers with `x-cbd-replica` (the replica it chose, opaque to the client), and a later call that sends it
back goes to that same replica while it is healthy, whatever else changed: a consistent-hash ring moves
some keys between the remaining replicas when one leaves, which would otherwise strand sessions that
are alive. If that replica is gone, the proxy hashes the key again and says which replica it chose
instead. Without a proxy the header never comes and nothing is sent. Remembered per affinity key, the
most recent `MAX_KEYS` keys.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

REPLICA_HEADER = "x-cbd-replica"
MAX_KEYS = 65536


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
