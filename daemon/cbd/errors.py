"""Errors the engine raises at its boundary; the server maps each class to one gRPC status."""

from __future__ import annotations


class CbdError(Exception):
    """Base class of every error cbd raises on purpose."""


class InvalidRequest(CbdError, ValueError):
    """The request is malformed or asks for something this engine cannot do."""


class CapacityExceeded(CbdError):
    """The engine is full (live requests, queued tokens, sessions); `retry_after` is a hint in seconds."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UnknownRequest(CbdError, KeyError):
    """No live request carries the given id."""


class EngineStopped(CbdError):
    """The engine is shutting down or has stopped."""


class UnsupportedModel(CbdError, ValueError):
    """The checkpoint's architecture is not one this engine implements."""


class UnknownSession(CbdError, KeyError):
    """No open session carries the given id (never opened, closed, or expired)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SessionExists(CbdError):
    """A session with the proposed id is open already (ALREADY_EXISTS)."""


class PermissionDenied(CbdError):
    """The caller may not ask this, whatever the object it names (PERMISSION_DENIED): e.g. another
    tenant's namespace without the admin token. Never raised for an id that is merely someone else's."""


class SessionBusy(CbdError):
    """The session cannot take this call in its current state (a turn in flight, candidates pending)."""


class HistoryMismatch(CbdError):
    """A turn that must extend the session's history token for token does not (ABORTED): the session is
    unchanged, and the conversation belongs on a new session."""


class EngineFailure(CbdError):
    """The engine failed while running the request (INTERNAL)."""


class SettingError(CbdError, ValueError):
    """A setting that cannot work on this host, found while the engine starts (the daemon exits 78)."""
