"""HTTP/1.1 to the service, over its Unix socket or TCP, sync and asyncio.

One connection per request (``Connection: close``): nothing is pooled, so a
request's descriptors (``SCM_RIGHTS``, sent with its first bytes) can never
be taken for another's. The request and its answer are plain bytes; only
the transport differs between :class:`Transport` and its coroutines.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ._errors import ConnectionFailed, from_body


@dataclass
class Response:
    status: int
    headers: Dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8")) if self.body else None


@dataclass
class Endpoint:
    """Where the service answers: a Unix socket path, or host and port."""

    socket: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 7878
    token: Optional[str] = None
    scheme_path: str = field(default="")

    @property
    def unix(self) -> bool:
        return self.socket is not None


def _request_bytes(ep: Endpoint, method: str, path: str, body: Optional[bytes],
                   headers: Mapping[str, str]) -> bytes:
    host = "localhost" if ep.unix else f"{ep.host}:{ep.port}"
    lines = [f"{method} {ep.scheme_path}{path} HTTP/1.1", f"Host: {host}", "Connection: close",
             "User-Agent: treewarden-python/0.1"]
    if ep.token:
        lines.append(f"Authorization: Bearer {ep.token}")
    for k, v in headers.items():
        lines.append(f"{k}: {v}")
    if body is not None:
        lines.append("Content-Type: application/json")
        lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + (body or b"")


def query(path: str, params: Mapping[str, Any]) -> str:
    items = [(k, _q(v)) for k, v in params.items() if v is not None]
    return path + ("?" + urllib.parse.urlencode(items) if items else "")


def _q(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def _connect(ep: Endpoint, timeout: Optional[float]) -> socket.socket:
    try:
        if ep.unix:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(ep.socket or "")
            return s
        return socket.create_connection((ep.host, ep.port), timeout=timeout)
    except OSError as e:
        where = ep.socket if ep.unix else f"{ep.host}:{ep.port}"
        raise ConnectionFailed(f"cannot reach treewarden at {where}: {e}") from e


def _send(s: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    if fds:
        sent = socket.send_fds(s, [data], list(fds))
        data = data[sent:]
    s.sendall(data)


class _Head:
    """An answer's status line and headers, parsed."""

    def __init__(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise ConnectionFailed(f"not an HTTP answer: {lines[0]!r}")
        self.status = int(parts[1])
        self.headers: Dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                self.headers[k.strip().lower()] = v.strip()

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    @property
    def length(self) -> Optional[int]:
        v = self.headers.get("content-length")
        return int(v) if v is not None else None


class _SyncReader:
    def __init__(self, s: socket.socket) -> None:
        self.f = s.makefile("rb")

    def head(self) -> _Head:
        raw = b""
        while not raw.endswith(b"\r\n\r\n"):
            line = self.f.readline(65536)
            if not line:
                raise ConnectionFailed("the service closed the connection before answering")
            raw += line
        return _Head(raw[:-4])

    def chunks(self, head: _Head) -> Iterator[bytes]:
        if head.chunked:
            while True:
                size_line = self.f.readline(1024)
                if not size_line:
                    return
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.f.readline(1024)
                    return
                data = self.f.read(size)
                self.f.readline(1024)
                yield data
        elif head.length is not None:
            left = head.length
            while left > 0:
                data = self.f.read1(min(left, 65536))
                if not data:
                    return
                left -= len(data)
                yield data
        else:
            while True:
                data = self.f.read1(65536)
                if not data:
                    return
                yield data


class Transport:
    """Blocking requests."""

    def __init__(self, ep: Endpoint, timeout: Optional[float] = 120.0) -> None:
        self.ep = ep
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None, *,
                headers: Optional[Mapping[str, str]] = None, fds: Sequence[int] = (),
                timeout: Optional[float] = None) -> Response:
        s = self._open(method, path, body, headers or {}, fds, timeout)
        try:
            r = _SyncReader(s)
            head = r.head()
            data = b"".join(r.chunks(head))
        except socket.timeout as e:
            raise ConnectionFailed(f"{method} {path}: no answer in time") from e
        finally:
            s.close()
        return _answer(head, data)

    def stream(self, path: str) -> Iterator[bytes]:
        """A GET whose body is read as it comes (no timeout between chunks)."""
        s = self._open("GET", path, None, {"Accept": "text/event-stream"}, (), None)
        try:
            s.settimeout(None)
            r = _SyncReader(s)
            head = r.head()
            if head.status >= 300:
                raise from_body(head.status, _parse(b"".join(r.chunks(head))))
            for chunk in r.chunks(head):
                yield chunk
        finally:
            s.close()

    def _open(self, method: str, path: str, body: Any, headers: Mapping[str, str],
              fds: Sequence[int], timeout: Optional[float]) -> socket.socket:
        payload = None if body is None else json.dumps(body).encode("utf-8")
        s = _connect(self.ep, timeout if timeout is not None else self.timeout)
        try:
            _send(s, _request_bytes(self.ep, method, path, payload, headers), fds)
        except OSError as e:
            s.close()
            raise ConnectionFailed(f"{method} {path}: {e}") from e
        return s


def _parse(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError:
        return data.decode("utf-8", "replace")


def _answer(head: _Head, data: bytes) -> Response:
    if head.status >= 300:
        raise from_body(head.status, _parse(data))
    return Response(head.status, head.headers, data)


class _AsyncReader:
    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.r = reader

    async def head(self) -> _Head:
        try:
            raw = await self.r.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            raise ConnectionFailed("the service closed the connection before answering") from e
        return _Head(raw[:-4])

    async def chunks(self, head: _Head) -> AsyncIterator[bytes]:
        if head.chunked:
            while True:
                size_line = await self.r.readline()
                if not size_line:
                    return
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await self.r.readline()
                    return
                data = await self.r.readexactly(size)
                await self.r.readline()
                yield data
        elif head.length is not None:
            left = head.length
            while left > 0:
                data = await self.r.read(min(left, 65536))
                if not data:
                    return
                left -= len(data)
                yield data
        else:
            while True:
                data = await self.r.read(65536)
                if not data:
                    return
                yield data


class AsyncTransport:
    """The same requests, as coroutines on the running loop."""

    def __init__(self, ep: Endpoint, timeout: Optional[float] = 120.0) -> None:
        self.ep = ep
        self.timeout = timeout

    async def _open(self, method: str, path: str, body: Any, headers: Mapping[str, str],
                    fds: Sequence[int]) -> Tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        payload = None if body is None else json.dumps(body).encode("utf-8")
        data = _request_bytes(self.ep, method, path, payload, headers)
        try:
            if self.ep.unix:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                loop = asyncio.get_running_loop()
                await loop.sock_connect(s, self.ep.socket or "")
                if fds:
                    # The descriptors ride on the first bytes; a fresh
                    # connection's send buffer takes them at once.
                    s.setblocking(True)
                    try:
                        sent = socket.send_fds(s, [data], list(fds))
                    finally:
                        s.setblocking(False)
                    data = data[sent:]
                reader, writer = await asyncio.open_unix_connection(sock=s)
            else:
                reader, writer = await asyncio.open_connection(self.ep.host, self.ep.port)
        except OSError as e:
            where = self.ep.socket if self.ep.unix else f"{self.ep.host}:{self.ep.port}"
            raise ConnectionFailed(f"cannot reach treewarden at {where}: {e}") from e
        writer.write(data)
        await writer.drain()
        return reader, writer

    async def request(self, method: str, path: str, body: Any = None, *,
                      headers: Optional[Mapping[str, str]] = None, fds: Sequence[int] = (),
                      timeout: Optional[float] = None) -> Response:
        limit = timeout if timeout is not None else self.timeout

        async def go() -> Response:
            reader, writer = await self._open(method, path, body, headers or {}, fds)
            try:
                r = _AsyncReader(reader)
                head = await r.head()
                parts: List[bytes] = [c async for c in r.chunks(head)]
            finally:
                writer.close()
            return _answer(head, b"".join(parts))

        try:
            return await asyncio.wait_for(go(), limit)
        except asyncio.TimeoutError as e:
            raise ConnectionFailed(f"{method} {path}: no answer in time") from e

    async def stream(self, path: str) -> AsyncIterator[bytes]:
        reader, writer = await self._open("GET", path, None, {"Accept": "text/event-stream"}, ())
        try:
            r = _AsyncReader(reader)
            head = await r.head()
            if head.status >= 300:
                raise from_body(head.status, _parse(b"".join([c async for c in r.chunks(head)])))
            async for chunk in r.chunks(head):
                yield chunk
        finally:
            writer.close()


def sse_events(chunks: Iterator[bytes]) -> Iterator[Dict[str, Any]]:
    """Server-Sent Events from a byte stream: each event's ``data`` as JSON."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            ev = _sse_block(block)
            if ev is not None:
                yield ev


async def asse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[Dict[str, Any]]:
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            ev = _sse_block(block)
            if ev is not None:
                yield ev


def _sse_block(block: bytes) -> Optional[Dict[str, Any]]:
    data = [line[5:].lstrip() for line in block.split(b"\n") if line.startswith(b"data:")]
    if not data:
        return None
    v = json.loads(b"\n".join(data).decode("utf-8"))
    return v if isinstance(v, dict) else None
