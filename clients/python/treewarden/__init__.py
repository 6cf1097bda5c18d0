"""treewarden: process trees in custody, from Python.

A client of ``treewarden serve`` that reads like :mod:`subprocess`::

    import subprocess, treewarden

    client = treewarden.Client()            # the service's Unix socket
    tree = client.spawn(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        label="tool-call-7")
    tree.stdin.write(b"hi\\n"); tree.stdin.flush()
    tree.stdout.readline()                  # b"hi\\n"
    tree.kill()                             # TERM, grace, authorization, KILL, verified
    client.trees(label="tool-call-7", alive=True)   # []

and :func:`run`, :func:`subprocess.run` over the wrapper (``treewarden
run``). No runtime dependency; Python 3.9 or later; Linux (the Unix socket,
stdio passed as descriptors), or any OS over TCP with a token (Windows).
"""

from ._client import (OUTCOME_KINDS, DEVNULL, FINAL_STATES, PIPE, SETTLED_STATES, STDOUT, AsyncClient,
                      AsyncTree, Client, Outcome, Report, Tree, default_socket, duration,
                      own_identity, start_ticks)
from ._errors import (Ambiguous, BadRequest, Conflict, ConnectionFailed, DispatchClosed, Error,
                      Forbidden, NotFound, PayloadTooLarge, ServiceError, TimeoutExpired,
                      Unauthorized, Unavailable)
from ._run import CompletedProcess, run

__version__ = "0.1.0"

__all__ = [
    "Client", "AsyncClient", "Tree", "AsyncTree", "Outcome", "Report", "run", "CompletedProcess",
    "PIPE", "DEVNULL", "STDOUT", "FINAL_STATES", "SETTLED_STATES", "OUTCOME_KINDS", "default_socket",
    "duration", "own_identity", "start_ticks", "Error", "DispatchClosed", "Ambiguous", "Forbidden",
    "NotFound", "BadRequest", "PayloadTooLarge", "Unavailable", "Unauthorized", "Conflict",
    "ServiceError", "ConnectionFailed", "TimeoutExpired",
]
