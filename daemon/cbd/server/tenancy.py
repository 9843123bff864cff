"""Tenants: who owns what a client can name, and the engine's key for it.

A caller's tenant is the name of its auth token when the daemon has `--auth-token-file`; without one,
every caller is the daemon's single tenant "". Every session (forks included) belongs to the tenant that
opened it. The engine knows a session by a key: the client's id inside its owner's namespace, `TENANT/ID`
(for the single tenant, the id itself). So tenants may use the same ids, and a tenant's lookups reach
only its own sessions: another tenant's id is simply not found, with the message an id that never
existed gets (no oracle for guessing ids). Client-chosen request ids are namespaced the same way, and so
is the prefix cache (`SamplingParams.cache_scope`). The admin token (`--admin-token-name`) may name
another tenant's namespace (GetSession and CloseSession `tenant`) and list every tenant's sessions.

Tenant names and client ids never contain '/' (server/auth.py, engine/sessions/records.py), so a key splits back
into its two parts unambiguously.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

from cbd.engine.sampling_params import MAX_TENANT_CHARS
from cbd.errors import CbdError, InvalidRequest, PermissionDenied


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str  # owns what this caller creates ("" = the single tenant of a daemon without auth)
    admin: bool = False

    def namespace(self, tenant: str = "") -> str:
        """Where a call looks: the caller's own namespace, or (the admin only) the one it names."""
        if not tenant or tenant == self.tenant:
            return self.tenant
        if len(tenant) > MAX_TENANT_CHARS:
            raise InvalidRequest(f"tenant has at most {MAX_TENANT_CHARS} characters, got {len(tenant)}")
        if not self.admin:
            raise PermissionDenied("only the admin token may name another tenant's sessions")
        return tenant

    def key(self, client_id: str, tenant: str = "") -> str:
        """The engine's key for `client_id` in this caller's namespace (or, the admin's, in `tenant`'s)."""
        namespace = self.namespace(tenant)
        return f"{namespace}/{client_id}" if namespace else client_id


def split_key(key: str) -> tuple[str, str]:
    """(the owner tenant, the client's id) of an engine key."""
    tenant, _, client_id = key.rpartition("/")
    return tenant, client_id


def new_session_id() -> str:
    """An id for a session whose client proposed none (no '.': its affinity key is all of it)."""
    return f"s-{secrets.token_hex(8)}"


@contextlib.contextmanager
def in_client_terms(*pairs: tuple[str, str]) -> Iterator[None]:
    """Errors raised inside name each (key, client id) pair's object as its client knows it: the
    namespace is the daemon's business, and a message must not differ with whose id was guessed."""
    try:
        yield
    except CbdError as exc:
        if exc.args and isinstance(exc.args[0], str):
            message = exc.args[0]
            for key, client_id in pairs:
                if key != client_id:
                    message = message.replace(repr(key), repr(client_id))
            exc.args = (message, *exc.args[1:])
        raise
