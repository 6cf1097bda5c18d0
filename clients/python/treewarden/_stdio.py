"""Streamed stdio: a tree's stdin, stdout and stderr over the spawn's own
connection, where descriptors cannot be passed (TCP, Windows).

The spawn asks for ``"stdio": "stream"`` with ``Upgrade: treewarden-stdio/1``
and is answered 101; the connection then carries frames
``[stream u8][length u32 big-endian][payload]``: 0 stdin (to the service),
1 stdout, 2 stderr (a frame of length 0 ends its stream), 3 exit, last (the
tree's end, as ``wait`` answers it).

:class:`Relay` joins the connection to the descriptors the caller gave
(the same ones the Unix socket would have passed: a ``PIPE``'s far end, a
file, ``DEVNULL``), each on a thread: what the descriptors hold back (a
full pipe) holds the connection back, so the service stops reading the
tree.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from typing import IO, Any, Dict, Optional

PROTOCOL = "treewarden-stdio/1"
STDIN, STDOUT, STDERR, EXIT = 0, 1, 2, 3
#: The largest stdin frame the service takes.
MAX_IN_FRAME = 1 << 20


def _frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BI", stream, len(payload)) + payload


class Relay:
    """Copies between an upgraded connection and the spawn's descriptors
    (``fds``: ``"stdin"``, ``"stdout"``, ``"stderr"`` to a descriptor this
    relay owns and closes at its stream's end)."""

    def __init__(self, sock: socket.socket, reader: IO[bytes], fds: Dict[str, int]) -> None:
        self._sock = sock
        self._reader = reader
        self._fds = dict(fds)
        self._lock = threading.Lock()
        #: The exit frame's JSON, once it came (the tree's row and ``outcome``).
        self.exit: Optional[Dict[str, Any]] = None
        self.done = threading.Event()
        threading.Thread(target=self._outputs, name="treewarden-stdio-out", daemon=True).start()
        fd = self._fds.pop("stdin", None)
        if fd is None:
            self._send(_frame(STDIN, b""))
        else:
            threading.Thread(target=self._stdin, args=(fd,), name="treewarden-stdio-in",
                             daemon=True).start()

    def _send(self, data: bytes) -> bool:
        try:
            with self._lock:
                self._sock.sendall(data)
            return True
        except OSError:
            return False

    def _stdin(self, fd: int) -> None:
        try:
            while True:
                data = os.read(fd, 65536)
                if not self._send(_frame(STDIN, data)) or not data:
                    return
        except OSError:
            self._send(_frame(STDIN, b""))
        finally:
            os.close(fd)

    def _outputs(self) -> None:
        names = {STDOUT: "stdout", STDERR: "stderr"}
        try:
            while True:
                head = self._reader.read(5)
                if len(head) < 5:
                    return
                stream, length = struct.unpack(">BI", head)
                payload = self._reader.read(length) if length else b""
                if len(payload) < length:
                    return
                if stream == EXIT:
                    try:
                        self.exit = json.loads(payload.decode("utf-8"))
                    except ValueError:
                        self.exit = None
                    return
                name = names.get(stream)
                fd = self._fds.get(name) if name else None
                if fd is None:
                    continue
                if not payload:
                    os.close(self._fds.pop(name))  # type: ignore[arg-type]
                    continue
                view = memoryview(payload)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
        except OSError:
            return
        finally:
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
            self.done.set()
            self.close()

    def close(self) -> None:
        """Hangs up: the tree's stdin is closed, the tree lives by its
        lifetime rules."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
