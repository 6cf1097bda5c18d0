"""HTTP/1.1 to the service, over its Unix socket or TCP, sync and asyncio.

One connection per request (``Connection: close``): nothing is pooled, so a
request's descriptors (``SCM_RIGHTS``, sent with its first bytes) can never
be taken for another's. The request and its answer are plain bytes; only
the transport differs between :class:`Transport` and its coroutines.

Under load both keep to the service's rules instead of meeting its caps:
at most ``max_connections`` requests of one client are open at once (the
service answers a peer over its own cap 503); a 503 that is not a closed
dispatch, and a connection refused or reset before the request was
whole, are tried again after ``Retry-After`` or a growing pause, at most
``retries`` times, then raised as :class:`Unavailable` or
:class:`ConnectionFailed` (never a raw ``ConnectionResetError``). A
request whose answer was lost after it was sent is tried again only when
it is a read (``GET``): a spawn or a kill may have happened. A body over
:data:`EXPECT_OVER` bytes is sent after ``Expect: 100-continue``, so the
service's 413 for one over its limit arrives as that answer, not as a
broken pipe.
"""

from __future__ import annotations

import asyncio
import errno
import json
import random
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import (Any, AsyncIterator, Awaitable, Callable, Dict, Iterator, List, Mapping, NoReturn,
                    Optional, Sequence, Tuple, TypeVar)

from ._errors import ConnectionFailed, Error, Unavailable, from_body

_T = TypeVar("_T")


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


#: Bodies larger than this are sent only once the service said it wants them
#: (``Expect: 100-continue``): one over its limit is answered 413 unread.
EXPECT_OVER = 64 * 1024
#: Requests of one client open at once, by default (the service lets one
#: peer hold 64 connections; the rest are for its other clients).
MAX_CONNECTIONS = 16
#: Tries after the first, by default, of a request the service could not
#: take now (503, a connection refused or reset before the request was
#: whole).
RETRIES = 6
#: Errors of a connect or a send that say "not now", never "not there".
_TRANSIENT = {errno.EAGAIN, errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED, errno.ETIMEDOUT}


class _Again(Exception):
    """One try failed in a way a later one may not: ``error`` is raised if
    none is left; ``after`` is the service's ``Retry-After``."""

    def __init__(self, error: Error, after: Optional[float] = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.after = after


def _pause(attempt: int, after: Optional[float]) -> float:
    """How long to wait before try ``attempt`` (1, 2, ...): the service's
    ``Retry-After`` when it gave one, else 50 ms doubling to 2 s, jittered
    so many waiting clients do not come back at once."""
    base = after if after is not None else min(2.0, 0.05 * (2 ** (attempt - 1)))
    return base * (0.5 + random.random())


def _retry_after(head: "_Head") -> Optional[float]:
    v = head.headers.get("retry-after")
    try:
        return max(0.0, float(v)) if v is not None else None
    except ValueError:
        return None


def _transient(e: OSError) -> bool:
    return isinstance(e, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
                          BlockingIOError, socket.timeout)) or e.errno in _TRANSIENT


def _request_bytes(ep: Endpoint, method: str, path: str, body: Optional[bytes],
                   headers: Mapping[str, str], connection: str = "close") -> Tuple[bytes, bytes]:
    host = "localhost" if ep.unix else f"{ep.host}:{ep.port}"
    lines = [f"{method} {ep.scheme_path}{path} HTTP/1.1", f"Host: {host}",
             f"Connection: {connection}", "User-Agent: treewarden-python/0.1"]
    if ep.token:
        lines.append(f"Authorization: Bearer {ep.token}")
    for k, v in headers.items():
        lines.append(f"{k}: {v}")
    if body is not None:
        lines.append("Content-Type: application/json")
        lines.append(f"Content-Length: {len(body)}")
        if len(body) > EXPECT_OVER:
            lines.append("Expect: 100-continue")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head, (body or b"")


def query(path: str, params: Mapping[str, Any]) -> str:
    items = [(k, _q(v)) for k, v in params.items() if v is not None]
    return path + ("?" + urllib.parse.urlencode(items) if items else "")


def _q(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def _where(ep: Endpoint) -> str:
    return ep.socket or "" if ep.unix else f"{ep.host}:{ep.port}"


def _connect(ep: Endpoint, timeout: Optional[float]) -> socket.socket:
    try:
        if ep.unix:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(timeout)
                s.connect(ep.socket or "")
            except BaseException:
                s.close()
                raise
            return s
        return socket.create_connection((ep.host, ep.port), timeout=timeout)
    except OSError as e:
        err = ConnectionFailed(f"cannot reach treewarden at {_where(ep)}: {e}")
        if _transient(e):
            raise _Again(err) from e
        raise err from e


def _send(s: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    if fds:
        sent = socket.send_fds(s, [data], list(fds))
        data = data[sent:]
    s.sendall(data)


class _Closed(ConnectionFailed):
    """The connection ended before an answer's head."""


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
                raise _Closed("the service closed the connection before answering")
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


def _unknown(method: str, path: str, e: BaseException) -> _Again:
    """A connection lost after the request was whole: a read is tried
    again; a change (a spawn, a kill) is raised, for it may have happened."""
    err = ConnectionFailed(f"{method} {path}: the connection was lost after the request "
                           f"was sent ({e}); whether it was acted on is unknown")
    if method == "GET":
        return _Again(err)
    raise err from e


def _not_upgraded(method: str, path: str, head: _Head, data: bytes) -> NoReturn:
    """Raises for an upgrade answered with anything but 101: a refusal to
    try again, the answer's own error, else that it was not upgraded."""
    again = _refused_now(head, data)
    if again is not None:
        raise again
    _answer(head, data)
    raise ConnectionFailed(f"{method} {path}: answered {head.status}, not upgraded")


def _refused_now(head: _Head, data: bytes) -> Optional[_Again]:
    """A 503 a retry may outlive (a drain, a busy ledger, a cap): not a
    closed dispatch, which waits for an operator."""
    if head.status != 503:
        return None
    err = from_body(head.status, _parse(data))
    if not isinstance(err, Unavailable):
        return None
    return _Again(err, _retry_after(head))


class Transport:
    """Blocking requests, at most ``max_connections`` at once (threads
    beyond it wait their turn), each tried again ``retries`` times when
    the service could not take it now."""

    def __init__(self, ep: Endpoint, timeout: Optional[float] = 120.0, *,
                 max_connections: int = MAX_CONNECTIONS, retries: int = RETRIES) -> None:
        if max_connections < 1:
            raise ValueError("max_connections is 1 or more")
        self.ep = ep
        self.timeout = timeout
        self.retries = retries
        self._slots = threading.BoundedSemaphore(max_connections)

    def request(self, method: str, path: str, body: Any = None, *,
                headers: Optional[Mapping[str, str]] = None, fds: Sequence[int] = (),
                timeout: Optional[float] = None) -> Response:
        payload = None if body is None else json.dumps(body).encode("utf-8")
        return self._retrying(lambda: self._once(method, path, payload, headers or {}, fds, timeout))

    def _retrying(self, once: Callable[[], _T]) -> _T:
        """``once()`` in a connection slot, again after each ``_Again`` (a
        503 or a connection that never reached the service), up to
        ``retries`` times."""
        attempt = 0
        while True:
            try:
                with self._slots:
                    return once()
            except _Again as again:
                attempt += 1
                if attempt > self.retries:
                    raise again.error from None
                time.sleep(_pause(attempt, again.after))  # a retry's backoff, not a wait for a condition

    def _once(self, method: str, path: str, payload: Optional[bytes],
              headers: Mapping[str, str], fds: Sequence[int],
              timeout: Optional[float]) -> Response:
        s = _connect(self.ep, timeout if timeout is not None else self.timeout)
        try:
            r = _SyncReader(s)
            head = self._write(s, r, method, path, payload, headers, fds)
            try:
                if head is None:
                    head = r.head()
                data = b"".join(r.chunks(head))
            except socket.timeout:
                raise
            except (OSError, _Closed) as e:
                raise _unknown(method, path, e) from e
        except socket.timeout as e:
            raise ConnectionFailed(f"{method} {path}: no answer in time") from e
        finally:
            s.close()
        again = _refused_now(head, data)
        if again is not None:
            raise again
        return _answer(head, data)

    def _write(self, s: socket.socket, r: _SyncReader, method: str, path: str,
               payload: Optional[bytes], headers: Mapping[str, str],
               fds: Sequence[int]) -> Optional[_Head]:
        """Sends the request; returns the answer's head when the service
        answered before taking the body (a 413 after ``Expect``)."""
        head, body = _request_bytes(self.ep, method, path, payload, headers)
        expect = len(body) > EXPECT_OVER
        try:
            if not expect:
                _send(s, head + body, fds)
                return None
            _send(s, head, fds)
            first = r.head()
            if first.status != 100:
                return first
            s.sendall(body)
            return None
        except (OSError, _Closed) as e:
            # The service may have answered before it closed (a 413, a 503).
            try:
                return r.head()
            except (OSError, ConnectionFailed):
                pass
            err = ConnectionFailed(f"{method} {path}: {e}")
            if isinstance(e, _Closed) or _transient(e):
                raise _Again(err) from e
            raise err from e

    def upgrade(self, method: str, path: str, body: Any, protocol: str
                ) -> Tuple[Dict[str, str], socket.socket, Any]:
        """A request answered 101, its connection upgraded to ``protocol``:
        the answer's headers, the socket, and its buffered reader (which
        may hold the stream's first bytes). Any other answer raises as
        :meth:`request` does; a 503 ``Unavailable`` is tried again."""
        payload = json.dumps(body).encode("utf-8")
        return self._retrying(lambda: self._upgrade_once(method, path, payload, protocol))

    def _upgrade_once(self, method: str, path: str, payload: bytes, protocol: str
                      ) -> Tuple[Dict[str, str], socket.socket, Any]:
        s = _connect(self.ep, self.timeout)
        try:
            r = _SyncReader(s)
            head, body = _request_bytes(self.ep, method, path, payload, {"Upgrade": protocol},
                                        connection="Upgrade")
            try:
                s.sendall(head + body)
                answer = r.head()
                if answer.status == 100:
                    answer = r.head()
                if answer.status == 101:
                    s.settimeout(None)
                    return answer.headers, s, r.f
                data = b"".join(r.chunks(answer))
            except socket.timeout:
                raise
            except (OSError, _Closed) as e:
                raise _unknown(method, path, e) from e
        except socket.timeout as e:
            s.close()
            raise ConnectionFailed(f"{method} {path}: no answer in time") from e
        except BaseException:
            s.close()
            raise
        s.close()
        _not_upgraded(method, path, answer, data)

    def stream(self, path: str, accept: str = "text/event-stream") -> Iterator[bytes]:
        """A GET whose body is read as it comes (no timeout between chunks)."""
        attempt = 0
        while True:
            try:
                s = _connect(self.ep, self.timeout)
                try:
                    r = _SyncReader(s)
                    self._write(s, r, "GET", path, None, {"Accept": accept}, ())
                    head = r.head()
                    if head.status >= 300:
                        data = b"".join(r.chunks(head))
                        again = _refused_now(head, data)
                        if again is not None:
                            raise again
                        raise from_body(head.status, _parse(data))
                except BaseException:
                    s.close()
                    raise
                break
            except (OSError, _Closed) as e:
                again = _Again(ConnectionFailed(f"GET {path}: {e}"))
            except _Again as a:
                again = a
            attempt += 1
            if attempt > self.retries:
                raise again.error from None
            time.sleep(_pause(attempt, again.after))  # a retry's backoff, not a wait for a condition
        try:
            s.settimeout(None)
            for chunk in r.chunks(head):
                yield chunk
        except OSError as e:
            raise ConnectionFailed(f"GET {path}: the stream broke: {e}") from e
        finally:
            s.close()


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
            raise _Closed("the service closed the connection before answering") from e
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
    """The same requests, as coroutines on the running loop, with the same
    bound (tasks beyond ``max_connections`` wait their turn) and retries."""

    def __init__(self, ep: Endpoint, timeout: Optional[float] = 120.0, *,
                 max_connections: int = MAX_CONNECTIONS, retries: int = RETRIES) -> None:
        if max_connections < 1:
            raise ValueError("max_connections is 1 or more")
        self.ep = ep
        self.timeout = timeout
        self.retries = retries
        self._max = max_connections
        self._slots: Optional[asyncio.Semaphore] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def _sem(self) -> asyncio.Semaphore:
        # A semaphore belongs to one loop: a client used from a second
        # loop (a second asyncio.run) gets a fresh one.
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:
            self._slots, self._loop = asyncio.Semaphore(self._max), loop
        return self._slots

    async def _connect(self, first: bytes, fds: Sequence[int]
                       ) -> Tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """Connects and sends ``first``'s start with the descriptors;
        returns what of ``first`` is left to write."""
        try:
            if self.ep.unix:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.setblocking(False)
                    loop = asyncio.get_running_loop()
                    await loop.sock_connect(s, self.ep.socket or "")
                    if fds:
                        # The descriptors ride on the first bytes; a fresh
                        # connection's send buffer takes them at once.
                        s.setblocking(True)
                        try:
                            sent = socket.send_fds(s, [first], list(fds))
                        finally:
                            s.setblocking(False)
                        first = first[sent:]
                    reader, writer = await asyncio.open_unix_connection(sock=s)
                except BaseException:
                    s.close()
                    raise
            else:
                reader, writer = await asyncio.open_connection(self.ep.host, self.ep.port)
        except OSError as e:
            err = ConnectionFailed(f"cannot reach treewarden at {_where(self.ep)}: {e}")
            if _transient(e):
                raise _Again(err) from e
            raise err from e
        return reader, writer, first

    async def _open(self, method: str, path: str, payload: Optional[bytes],
                    headers: Mapping[str, str], fds: Sequence[int]
                    ) -> Tuple[_AsyncReader, asyncio.StreamWriter, Optional[_Head]]:
        """Connects and sends the request; the head is the answer's when
        the service answered before taking the body (a 413 after ``Expect``)."""
        head, body = _request_bytes(self.ep, method, path, payload, headers)
        expect = len(body) > EXPECT_OVER
        reader, writer, rest = await self._connect(head if expect else head + body, fds)
        r = _AsyncReader(reader)
        try:
            writer.write(rest)
            await writer.drain()
            if expect:
                first = await r.head()
                if first.status != 100:
                    return r, writer, first
                writer.write(body)
                await writer.drain()
        except (OSError, _Closed) as e:
            # The service may have answered before it closed (a 413, a 503).
            try:
                return r, writer, await r.head()
            except (OSError, ConnectionFailed):
                pass
            writer.close()
            err = ConnectionFailed(f"{method} {path}: {e}")
            if isinstance(e, _Closed) or _transient(e):
                raise _Again(err) from e
            raise err from e
        except BaseException:
            writer.close()
            raise
        return r, writer, None

    async def request(self, method: str, path: str, body: Any = None, *,
                      headers: Optional[Mapping[str, str]] = None, fds: Sequence[int] = (),
                      timeout: Optional[float] = None) -> Response:
        payload = None if body is None else json.dumps(body).encode("utf-8")
        limit = timeout if timeout is not None else self.timeout
        return await self._retrying(
            lambda: self._once(method, path, payload, headers or {}, fds, limit))

    async def _retrying(self, once: Callable[[], Awaitable[_T]]) -> _T:
        """:meth:`Transport._retrying` on the running loop."""
        attempt = 0
        while True:
            try:
                async with self._sem():
                    return await once()
            except _Again as again:
                attempt += 1
                if attempt > self.retries:
                    raise again.error from None
                await asyncio.sleep(_pause(attempt, again.after))  # a retry's backoff

    async def _once(self, method: str, path: str, payload: Optional[bytes],
                    headers: Mapping[str, str], fds: Sequence[int],
                    limit: Optional[float]) -> Response:
        async def go() -> Response:
            r, writer, head = await self._open(method, path, payload, headers, fds)
            try:
                if head is None:
                    head = await r.head()
                parts: List[bytes] = [c async for c in r.chunks(head)]
            except (OSError, _Closed, asyncio.IncompleteReadError) as e:
                raise _unknown(method, path, e) from e
            finally:
                writer.close()
            data = b"".join(parts)
            again = _refused_now(head, data)
            if again is not None:
                raise again
            return _answer(head, data)

        try:
            return await asyncio.wait_for(go(), limit)
        except asyncio.TimeoutError as e:
            raise ConnectionFailed(f"{method} {path}: no answer in time") from e

    async def upgrade(self, method: str, path: str, body: Any, protocol: str
                      ) -> Tuple[Dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
        """:meth:`Transport.upgrade` on the running loop: the answer's
        headers and the connection's streams (the reader may hold the
        stream's first bytes)."""
        payload = json.dumps(body).encode("utf-8")
        return await self._retrying(lambda: self._upgrade_once(method, path, payload, protocol))

    async def _upgrade_once(self, method: str, path: str, payload: bytes, protocol: str
                            ) -> Tuple[Dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
        head, body = _request_bytes(self.ep, method, path, payload, {"Upgrade": protocol},
                                    connection="Upgrade")
        reader, writer, rest = await self._connect(head + body, ())
        r = _AsyncReader(reader)

        async def answer() -> Tuple[_Head, bytes]:
            writer.write(rest)
            await writer.drain()
            got = await r.head()
            if got.status == 100:
                got = await r.head()
            if got.status == 101:
                return got, b""
            return got, b"".join([c async for c in r.chunks(got)])

        try:
            try:
                got, data = await asyncio.wait_for(answer(), self.timeout)
            except asyncio.TimeoutError as e:
                raise ConnectionFailed(f"{method} {path}: no answer in time") from e
            except (OSError, _Closed, asyncio.IncompleteReadError) as e:
                raise _unknown(method, path, e) from e
        except BaseException:
            writer.close()
            raise
        if got.status == 101:
            return got.headers, reader, writer
        writer.close()
        _not_upgraded(method, path, got, data)

    async def stream(self, path: str, accept: str = "text/event-stream") -> AsyncIterator[bytes]:
        attempt = 0
        while True:
            try:
                r, writer, _ = await self._open("GET", path, None, {"Accept": accept}, ())
                try:
                    head = await r.head()
                    if head.status >= 300:
                        data = b"".join([c async for c in r.chunks(head)])
                        again = _refused_now(head, data)
                        if again is not None:
                            raise again
                        raise from_body(head.status, _parse(data))
                except BaseException:
                    writer.close()
                    raise
                break
            except (OSError, _Closed) as e:
                again = _Again(ConnectionFailed(f"GET {path}: {e}"))
            except _Again as a:
                again = a
            attempt += 1
            if attempt > self.retries:
                raise again.error from None
            await asyncio.sleep(_pause(attempt, again.after))  # a retry's backoff
        try:
            async for chunk in r.chunks(head):
                yield chunk
        except (OSError, asyncio.IncompleteReadError) as e:
            raise ConnectionFailed(f"GET {path}: the stream broke: {e}") from e
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
