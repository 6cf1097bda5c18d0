"""``treewarden.run``: :func:`subprocess.run` over the wrapper
(``treewarden run``), for code that runs one command and reads its status.

The wrapper writes the tree id (``--id-fd``) and its own verdict
(``--status-fd``: one JSON line, on every path) to pipes this function
reads, so a command's own exit 125 is told from treewarden's failure, and a
timeout from a command that exits 124 by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any, Dict, Optional, Sequence

from ._client import Duration, _seconds, duration
from ._errors import Ambiguous, DispatchClosed, Error, TimeoutExpired


class CompletedProcess(subprocess.CompletedProcess):  # type: ignore[type-arg]
    """:class:`subprocess.CompletedProcess` with the tree's id and state."""

    def __init__(self, args: Any, returncode: int, stdout: Any = None, stderr: Any = None, *,
                 tree_id: Optional[int] = None, state: Optional[str] = None) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.tree_id = tree_id
        self.state = state


def binary() -> str:
    """The ``treewarden`` executable: ``TREEWARDEN_BIN``, else ``PATH``."""
    b = os.environ.get("TREEWARDEN_BIN") or shutil.which("treewarden")
    if not b:
        raise Error("treewarden is not installed (set TREEWARDEN_BIN or put it in PATH)")
    return b


def run(argv: Sequence[str], *, timeout: Optional[Duration] = None,
        grace: Optional[Duration] = None, die_with_parent: bool = True,
        label: Optional[str] = None, lifetime: str = "root", first_signal: Optional[str] = None,
        check: bool = False, **popen_kwargs: Any) -> CompletedProcess:
    """Runs ``argv`` as a tree in custody and waits for it, as
    :func:`subprocess.run` does (``capture_output``, ``input``, ``stdout``,
    ``env``, ``cwd``, … pass through). Everything the command started is
    torn down when it exits. ``timeout`` tears the whole tree down, then
    raises :class:`treewarden.TimeoutExpired`. treewarden's own failures
    raise (:class:`DispatchClosed`, :class:`Ambiguous`, :class:`Error`);
    they are never returned as 125."""
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv is a sequence of strings")
    for k in ("pass_fds", "shell", "timeout"):
        if k in popen_kwargs:
            raise TypeError(f"run() does not take {k}")
    id_r, id_w = os.pipe()
    st_r, st_w = os.pipe()
    cmd = [binary(), "run", "--id-fd", str(id_w), "--status-fd", str(st_w)]
    if timeout is not None:
        cmd += ["--timeout", duration(timeout) or "0s"]
    if grace is not None:
        cmd += ["--grace", duration(grace) or "0s"]
    if die_with_parent:
        cmd.append("--die-with-parent")
    if label is not None:
        cmd += ["--label", label]
    if lifetime != "root":
        cmd += ["--lifetime", lifetime]
    if first_signal is not None:
        cmd += ["--signal", first_signal]
    cmd += ["--quiet", "--"] + [os.fspath(a) for a in argv]
    try:
        proc = subprocess.run(cmd, pass_fds=(id_w, st_w), **popen_kwargs)
    finally:
        os.close(id_w)
        os.close(st_w)
        with os.fdopen(id_r, "rb") as f:
            id_text = f.read()
        with os.fdopen(st_r, "rb") as f:
            status_text = f.read()
    status = _last_json(status_text) or {}
    tree_id = status.get("tree")
    if tree_id is None and id_text.strip().isdigit():
        tree_id = int(id_text.strip())
    state = status.get("state")
    error = status.get("error")
    exit_ = status.get("exit") or {}
    if error:
        if "dispatch refused" in error:
            raise DispatchClosed(error, tree=tree_id)
        if state == "ambiguous" or "ambiguous" in error:
            raise Ambiguous(error, tree=tree_id)
        raise Error(error, tree=tree_id)
    if status == {} and proc.returncode == 125:
        raise Error("treewarden run failed before it could report (exit 125)")
    # 124 is the wrapper's timeout unless the command itself exited 124.
    if timeout is not None and proc.returncode == 124 and exit_.get("code") != 124:
        raise TimeoutExpired(list(argv), _seconds(timeout) or 0.0, proc.stdout, proc.stderr,
                             tree=tree_id)
    if exit_.get("code") is not None:
        rc = int(exit_["code"])
    elif exit_.get("signal") is not None:
        rc = -int(exit_["signal"])
    else:
        rc = proc.returncode
    done = CompletedProcess(list(argv), rc, proc.stdout, proc.stderr, tree_id=tree_id,
                            state=state)
    if check:
        done.check_returncode()
    return done


def _last_json(text: bytes) -> Optional[Dict[str, Any]]:
    for line in reversed(text.decode("utf-8", "replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if isinstance(v, dict):
                return v
    return None


__all__ = ["run", "CompletedProcess", "binary"]
