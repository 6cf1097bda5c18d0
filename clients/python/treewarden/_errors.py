"""Exceptions, named for what the caller does next.

Every failure of the service arrives as a JSON body ``{"error": ...,
"code": ...}``; the exception class is chosen by ``code``, never by the
HTTP status alone (a 503 is a closed dispatch, which waits for an
operator, or a drain, which a retry outlives).
"""

from __future__ import annotations

import subprocess
from typing import Any, Dict, Optional, Sequence, Type, Union


class Error(Exception):
    """Any failure of treewarden itself (never the workload's own exit)."""

    #: The server's ``code`` (``None`` when the failure is the client's).
    code: Optional[str] = None

    def __init__(self, message: str, *, status: Optional[int] = None,
                 tree: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.tree = tree


class DispatchClosed(Error):
    """A tree in your scope is unsettled: new work is refused until an
    operator (or the next settle) acts. Do not retry in a loop. ``tree``
    names the unsettled tree."""

    code = "DispatchClosed"


class Ambiguous(Error):
    """A teardown could not prove its authority: survivors were left alive
    as evidence. ``tree`` names the tree; ``treewarden show`` lists them."""

    code = "Ambiguous"


class Forbidden(Error):
    """The principal may not do this (another user's tree, a small scope)."""

    code = "Forbidden"


class NotFound(Error):
    """No such tree (or endpoint)."""

    code = "NotFound"


class BadRequest(Error, ValueError):
    """The request itself is wrong; the message is the server's."""

    code = "BadRequest"


class PayloadTooLarge(BadRequest):
    """The request is over the service's body limit (413): a smaller one
    (a shorter argv, a smaller environment) is needed, not a retry."""


class Unavailable(Error):
    """Not now: the service is draining, its ledger is busy, or a bound of
    yours is reached (your connections, your trees). A later retry may
    succeed; a 503 from a connection cap says when (``Retry-After``)."""

    code = "Unavailable"


class Unauthorized(Error):
    """No token, a wrong one, or a revoked one (TCP)."""

    code = "Unauthorized"


class Conflict(Error):
    """The tree's state does not allow it."""

    code = "Conflict"


class ServiceError(Error):
    """The service failed (500); the detail is in its log."""

    code = "Internal"


class ConnectionFailed(Error):
    """The service could not be reached (no socket, nothing listening)."""


class TimeoutExpired(subprocess.TimeoutExpired, Error):
    """A timeout passed. Raised by :func:`treewarden.run` after the tree is
    torn down (as :func:`subprocess.run` does), and by ``Tree.wait``."""

    def __init__(self, cmd: Union[str, Sequence[str]], timeout: float,
                 output: Optional[bytes] = None, stderr: Optional[bytes] = None,
                 *, tree: Optional[int] = None) -> None:
        subprocess.TimeoutExpired.__init__(self, cmd, timeout, output, stderr)
        self.message = str(self)
        self.status = None
        self.tree = tree
        self.tree_id = tree


_BY_CODE: Dict[str, Type[Error]] = {
    cls.code or cls.__name__: cls
    for cls in (DispatchClosed, Ambiguous, Forbidden, NotFound, BadRequest,
                Unavailable, Unauthorized, Conflict, ServiceError)
}


def from_body(status: int, body: Any) -> Error:
    """The exception for an error answer (``body`` parsed JSON, or text)."""
    if isinstance(body, dict):
        message = str(body.get("error") or f"HTTP {status}")
        code = body.get("code")
        tree = body.get("tree") if isinstance(body.get("tree"), int) else None
    else:
        message, code, tree = (str(body).strip() or f"HTTP {status}"), None, None
    cls = _BY_CODE.get(code) if isinstance(code, str) else None
    if status == 413:
        cls = PayloadTooLarge
    if cls is None:
        # No code to go by (an answer from something in front of the
        # service): a 503 is still "not now", whoever said it.
        cls = Unavailable if status == 503 else Error
    return cls(message, status=status, tree=tree)
