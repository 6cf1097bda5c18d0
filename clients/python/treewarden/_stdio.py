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
tree. :class:`AsyncRelay` does the same as two tasks on the running loop
(``AsyncClient`` over TCP): a pipe, socket or terminal is read and written
as an asyncio stream (the descriptor is made non-blocking), a regular file
directly.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import struct
import threading
from typing import IO, Any, Dict, List, Optional, Union

PROTOCOL = "treewarden-stdio/1"
STDIN, STDOUT, STDERR, EXIT = 0, 1, 2, 3
#: The largest stdin frame the service takes.
MAX_IN_FRAME = 1 << 20


def _frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BI", stream, len(payload)) + payload


#: The output streams' names, by frame stream number.
_NAMES = {STDOUT: "stdout", STDERR: "stderr"}


def _exit_of(payload: bytes) -> Optional[Dict[str, Any]]:
    """The exit frame's status (``None`` when it does not parse)."""
    try:
        return json.loads(payload.decode("utf-8"))
    except ValueError:
        return None


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
                    self.exit = _exit_of(payload)
                    return
                name = _NAMES.get(stream)
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


def _streamable(fd: int) -> bool:
    """A pipe, a socket or a character device: what the loop can watch
    (a regular file is always ready, and read or written directly)."""
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)


#: Where an output frame goes: an asyncio stream, or a regular file's descriptor.
_Sink = Union[asyncio.StreamWriter, int]
#: Where stdin frames come from: an asyncio stream, or a regular file's descriptor.
_Source = Union[asyncio.StreamReader, int]


class AsyncRelay:
    """:class:`Relay` on the running loop: the upgraded connection's
    ``reader`` and ``writer`` joined to the spawn's descriptors (``fds``,
    which this relay owns and closes at their stream's end), by two tasks.
    Call :meth:`start` once, on the loop that owns the connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 fds: Dict[str, int]) -> None:
        self._reader = reader
        self._writer = writer
        self._fds = dict(fds)
        self._sinks: Dict[str, _Sink] = {}
        self._transports: List[asyncio.BaseTransport] = []
        self._tasks: List["asyncio.Task[None]"] = []
        #: The exit frame's JSON, once it came (the tree's row and ``outcome``).
        self.exit: Optional[Dict[str, Any]] = None
        #: Set once the connection is done (the exit frame came, or it dropped).
        self.done = asyncio.Event()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            for name in ("stdout", "stderr"):
                fd = self._fds.pop(name, None)
                if fd is not None:
                    self._sinks[name] = await self._sink(loop, fd)
            fd = self._fds.pop("stdin", None)
            source = None if fd is None else await self._source(loop, fd)
        except BaseException:
            self._release()
            self.close()
            raise
        self._tasks.append(loop.create_task(self._outputs()))
        if source is None:
            self._writer.write(_frame(STDIN, b""))
        else:
            self._tasks.append(loop.create_task(self._stdin(source)))

    async def _sink(self, loop: asyncio.AbstractEventLoop, fd: int) -> _Sink:
        if not _streamable(fd):
            return fd
        f = os.fdopen(fd, "wb", buffering=0)
        t, p = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), f)
        self._transports.append(t)
        return asyncio.StreamWriter(t, p, None, loop)

    async def _source(self, loop: asyncio.AbstractEventLoop, fd: int) -> _Source:
        if not _streamable(fd):
            return fd
        reader = asyncio.StreamReader()
        f = os.fdopen(fd, "rb", buffering=0)
        t, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), f)
        self._transports.append(t)
        return reader

    async def _stdin(self, source: _Source) -> None:
        try:
            while True:
                if isinstance(source, int):
                    data = os.read(source, 65536)
                else:
                    data = await source.read(65536)
                self._writer.write(_frame(STDIN, data))
                await self._writer.drain()
                if not data:
                    return
        except (OSError, ConnectionError):
            return
        finally:
            if isinstance(source, int):
                os.close(source)

    async def _outputs(self) -> None:
        try:
            while True:
                stream, length = struct.unpack(">BI", await self._reader.readexactly(5))
                payload = await self._reader.readexactly(length) if length else b""
                if stream == EXIT:
                    self.exit = _exit_of(payload)
                    return
                name = _NAMES.get(stream)
                sink = self._sinks.get(name) if name else None
                if sink is None:
                    continue
                if not payload:
                    _close_sink(self._sinks.pop(name))  # type: ignore[arg-type]
                elif isinstance(sink, int):
                    view = memoryview(payload)
                    while view:
                        view = view[os.write(sink, view):]
                else:
                    sink.write(payload)
                    await sink.drain()
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._release()
            self.done.set()
            self.close()

    def _release(self) -> None:
        for sink in self._sinks.values():
            _close_sink(sink)
        self._sinks.clear()
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

    def close(self) -> None:
        """Hangs up: the tree's stdin is closed, the tree lives by its
        lifetime rules."""
        for t in self._transports:
            t.close()
        self._writer.close()


def _close_sink(sink: _Sink) -> None:
    try:
        if isinstance(sink, int):
            os.close(sink)
        else:
            sink.close()
    except OSError:
        pass
