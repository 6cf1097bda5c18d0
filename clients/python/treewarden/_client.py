"""``Client`` and ``AsyncClient``: the service's API as harness code wants
it, reading like :mod:`subprocess`.

The owner of every tree is the calling process (or one it names with
``owner=``), named by its pid and, on Linux, its start time (field 22 of
``/proc/PID/stat``, read here; elsewhere there is no ``/proc`` and the
service reads the start itself): the service watches that process and
tears the tree down within a second of its exit, whatever the caller
forgot. stdio given as ``PIPE``, ``DEVNULL``, a file or
a descriptor reaches the tree as its 0/1/2 over the Unix socket
(``SCM_RIGHTS``), never through the service, so the tree keeps its pipes
when the service restarts.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import (IO, Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, Union)

from . import _http, _stdio
from ._errors import NotFound, TimeoutExpired

#: What ``stdin``/``stdout``/``stderr`` take, as for :class:`subprocess.Popen`.
PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT

Duration = Union[int, float, datetime.timedelta, str]
StdSpec = Union[None, int, IO[Any]]

#: States after which a tree does not change by itself.
FINAL_STATES = frozenset({"ended", "vanished", "spawn_failed", "resolved"})
#: ``wait`` answers at these too: a teardown that left survivors as evidence.
SETTLED_STATES = FINAL_STATES | {"ambiguous"}

#: The longest one wait request holds (the server's bound).
_WAIT_STEP = 60.0


def duration(d: Optional[Duration]) -> Optional[str]:
    """Seconds (int or float), a :class:`datetime.timedelta`, or the CLI's
    strings (``"300ms"``, ``"2s"``) as the API takes them."""
    if d is None:
        return None
    if isinstance(d, str):
        return d
    if isinstance(d, datetime.timedelta):
        seconds = d.total_seconds()
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        seconds = float(d)
    else:
        raise TypeError(f"a duration is seconds, a timedelta or a string like '2s', not {d!r}")
    if seconds < 0:
        raise ValueError(f"a duration is not negative: {d!r}")
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _seconds(d: Optional[Duration]) -> Optional[float]:
    if d is None:
        return None
    if isinstance(d, str):
        s = d.strip()
        for unit, factor in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
            if s.endswith(unit) and s[: -len(unit)].replace(".", "", 1).isdigit():
                return float(s[: -len(unit)]) * factor
        return float(s)
    if isinstance(d, datetime.timedelta):
        return d.total_seconds()
    return float(d)


def start_ticks(pid: int) -> Optional[int]:
    """A process's start time in clock ticks, as Linux's ``/proc/PID/stat``
    has it; ``None`` where there is no ``/proc`` (Windows, macOS), where the
    service reads the owner's start itself. Raises :class:`ProcessLookupError`
    for a pid that is not there."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError as e:
        raise ProcessLookupError(f"no process {pid}") from e
    # The fields after the command name, which may hold spaces and ')'.
    rest = stat[stat.rindex(b")") + 2:].split()
    return int(rest[19])


def own_identity() -> Tuple[int, Optional[int]]:
    """This process's pid and start time in clock ticks (``None`` where
    there is no ``/proc``: see :func:`start_ticks`)."""
    return os.getpid(), start_ticks(os.getpid())


def default_socket() -> str:
    """Where the service's socket is, as the CLI would find it."""
    env = os.environ.get("TREEWARDEN_SOCKET")
    if env:
        return env
    unit = "/run/treewarden/api.sock"
    if os.path.exists(unit):
        return unit
    data = os.environ.get("TREEWARDEN_DATA_DIR")
    if not data:
        if getattr(os, "geteuid", lambda: -1)() == 0:
            data = "/var/lib/treewarden"
        else:
            state = os.environ.get("XDG_STATE_HOME") or os.path.join(
                os.path.expanduser("~"), ".local", "state")
            data = os.path.join(state, "treewarden")
    return os.path.join(data, "api.sock")


def _endpoint(socket: Optional[str], url: Optional[str], token: Optional[str]) -> _http.Endpoint:
    if url is None and socket is None and not hasattr(os, "geteuid"):
        raise ValueError("no Unix socket here: give url='http://127.0.0.1:PORT' and a token")
    if url is not None:
        import urllib.parse

        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"url must be http://HOST:PORT, not {url!r}")
        return _http.Endpoint(host=u.hostname, port=u.port or 80, token=token,
                              scheme_path=u.path.rstrip("/"))
    return _http.Endpoint(socket=socket or default_socket(), token=token)


#: How a tree ended (:attr:`Outcome.kind`), as the service reads it from its
#: ledger (the dashboard's outcome column): ``exited`` (its root exited 0),
#: ``failed`` (non-zero, or a signal no teardown sent), ``timed_out``,
#: ``killed`` (:attr:`Outcome.killed_by` says by whom), ``owner_gone``,
#: ``shutdown`` (the service's drain), ``ambiguous``, ``unkillable``,
#: ``spawn_failed``, ``resolved``, ``vanished``.
OUTCOME_KINDS = frozenset({"exited", "failed", "timed_out", "killed", "owner_gone", "shutdown",
                           "ambiguous", "unkillable", "spawn_failed", "resolved", "vanished"})


@dataclass(frozen=True)
class Outcome:
    """How a tree ended: its ledger ``state``, its root's status as Popen
    has it (negative for a signal; ``None`` if unknown), and, typed, how:
    ``kind`` (one of :data:`OUTCOME_KINDS`; ``None`` from a service too
    old to say), whether the teardown had to force-kill (``forced``: a
    SIGKILL under a committed authorization), and who asked for a kill
    (``killed_by``). A timeout and a kill both end the root with SIGTERM;
    ``kind`` tells them apart."""

    state: str
    returncode: Optional[int]
    tree_id: int
    kind: Optional[str] = None
    forced: bool = False
    killed_by: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.state in FINAL_STATES and self.returncode == 0

    @property
    def timed_out(self) -> bool:
        return self.kind == "timed_out"


@dataclass(frozen=True)
class Report:
    """What a kill did (the kill answer's fields)."""

    tree: int
    state: str
    members_at_start: int
    force_killed: int
    authorizations: int
    elapsed_ms: int
    phases: List[Dict[str, Any]] = field(default_factory=list)


def _returncode(row: Mapping[str, Any]) -> Optional[int]:
    exit_ = row.get("exit") or {}
    if exit_.get("code") is not None:
        return int(exit_["code"])
    if exit_.get("signal") is not None:
        return -int(exit_["signal"])
    return None


def _outcome(row: Mapping[str, Any]) -> Outcome:
    seen = row.get("outcome") or {}
    kind = seen.get("kind")
    by = seen.get("by")
    return Outcome(state=str(row["state"]), returncode=_returncode(row), tree_id=int(row["id"]),
                   kind=str(kind) if kind is not None else None,
                   forced=seen.get("forced") is not None,
                   killed_by=by if kind == "killed" and isinstance(by, str) else None)


def _report(v: Mapping[str, Any]) -> Report:
    return Report(tree=int(v["tree"]), state=str(v["state"]),
                  members_at_start=int(v.get("members_at_start", 0)),
                  force_killed=int(v.get("force_killed", 0)),
                  authorizations=int(v.get("authorizations", 0)),
                  elapsed_ms=int(v.get("elapsed_ms", 0)), phases=list(v.get("phases") or []))


class _Stdio:
    """The descriptors a spawn passes, and the parent's ends of its pipes."""

    def __init__(self, stdin: StdSpec, stdout: StdSpec, stderr: StdSpec) -> None:
        self.slots: List[str] = []
        self.fds: List[int] = []
        self._close_after: List[int] = []
        self.parent: Dict[str, Optional[IO[bytes]]] = {"stdin": None, "stdout": None,
                                                        "stderr": None}
        try:
            for name, spec in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
                self._one(name, spec)
        except BaseException:
            self.abandon()
            raise

    def _one(self, name: str, spec: StdSpec) -> None:
        if spec is None:
            return
        if spec == STDOUT and not isinstance(spec, io.IOBase):
            if name != "stderr":
                raise ValueError("STDOUT is for stderr only")
            if "stdout" not in self.slots:
                raise ValueError("stderr=STDOUT needs stdout given too")
            fd = self.fds[self.slots.index("stdout")]
        elif spec == PIPE and not isinstance(spec, io.IOBase):
            r, w = os.pipe()
            if name == "stdin":
                fd, mine = r, w
                self.parent[name] = os.fdopen(mine, "wb")
            else:
                fd, mine = w, r
                self.parent[name] = os.fdopen(mine, "rb")
            self._close_after.append(fd)
        elif spec == DEVNULL and not isinstance(spec, io.IOBase):
            fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            self._close_after.append(fd)
        elif isinstance(spec, int):
            if spec < 0:
                raise ValueError(f"{name}: {spec} is not a descriptor")
            fd = spec
        elif hasattr(spec, "fileno"):
            fd = spec.fileno()
        else:
            raise TypeError(f"{name}: PIPE, DEVNULL, a file object or a descriptor, not {spec!r}")
        self.slots.append(name)
        self.fds.append(fd)

    @property
    def header(self) -> Dict[str, str]:
        return {"Treewarden-Stdio": ",".join(self.slots)} if self.slots else {}

    def sent(self) -> None:
        """The request is answered: our copies of the tree's ends close, so
        the pipes see end-of-file when the tree closes its own."""
        for fd in self._close_after:
            os.close(fd)
        self._close_after = []

    def abandon(self) -> None:
        self.sent()
        for f in self.parent.values():
            if f is not None:
                f.close()


#: ``owner=`` takes a pid, or a pid and its start time in clock ticks.
OwnerSpec = Union[None, int, Tuple[int, int]]


def _owner(owner: OwnerSpec) -> Tuple[int, Optional[int]]:
    """The owner's pid and start time: this process by default; a pid
    named (its start read now, so a pid reused meanwhile is refused, not
    watched); or a pid with the start the caller read when it knew it."""
    if owner is None:
        return own_identity()
    if isinstance(owner, tuple):
        pid, start = owner
        return int(pid), int(start)
    if isinstance(owner, bool) or not isinstance(owner, int):
        raise TypeError(f"owner is a pid or (pid, start_ticks), not {owner!r}")
    return owner, start_ticks(owner)


def _spawn_body(argv: Sequence[str], label: Optional[str], grace: Optional[Duration],
                timeout: Optional[Duration], env: Optional[Mapping[str, str]],
                cwd: Optional[Union[str, "os.PathLike[str]"]], limits: Optional[Mapping[str, Any]],
                lifetime: str, first_signal: Optional[str],
                owner: OwnerSpec = None) -> Dict[str, Any]:
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv is a sequence of strings, as for subprocess without shell=True")
    if lifetime not in ("root", "owner"):
        raise ValueError(f"lifetime is 'root' or 'owner', not {lifetime!r}")
    pid, start = _owner(owner)
    body: Dict[str, Any] = {"argv": [os.fspath(a) for a in argv], "owner_pid": pid}
    if start is not None:
        body["owner_start_ticks"] = start
    if label is not None:
        body["label"] = label
    if grace is not None:
        body["grace"] = duration(grace)
    if timeout is not None:
        body["timeout"] = duration(timeout)
    if env is not None:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = os.path.abspath(os.fspath(cwd))
    if limits is not None:
        body["limits"] = dict(limits)
    if lifetime != "root":
        body["lifetime"] = lifetime
    if first_signal is not None:
        body["first_signal"] = first_signal
    return body


def _list_query(label: Optional[str], state: Union[None, str, Sequence[str]],
                alive: Optional[bool]) -> Dict[str, Any]:
    states = state if state is None or isinstance(state, str) else ",".join(state)
    q: Dict[str, Any] = {"label": label, "state": states, "alive": alive}
    if states is None and alive is None:
        q["all"] = True
    return q


def _next_link(headers: Mapping[str, str]) -> Optional[str]:
    link = headers.get("link", "")
    if 'rel="next"' in link and link.startswith("<"):
        return link[1: link.index(">")]
    return None


class Tree:
    """One tree in the service's custody (as ``Popen`` is one process)."""

    def __init__(self, client: "Client", row: Mapping[str, Any],
                 stdio: Optional[_Stdio] = None) -> None:
        self._client = client
        self.id: int = int(row["id"])
        #: The tree's row as the service last answered it.
        self.info: Dict[str, Any] = dict(row)
        #: Over TCP, what carries the streamed stdio (``relay.close()`` hangs it up).
        self.relay: Optional[_stdio.Relay] = None
        self.stdin: Optional[IO[bytes]] = stdio.parent["stdin"] if stdio else None
        self.stdout: Optional[IO[bytes]] = stdio.parent["stdout"] if stdio else None
        self.stderr: Optional[IO[bytes]] = stdio.parent["stderr"] if stdio else None

    def __repr__(self) -> str:
        return f"<treewarden.Tree {self.id} {self.info.get('state')}>"

    @property
    def state(self) -> str:
        return str(self.info.get("state"))

    def refresh(self) -> Dict[str, Any]:
        self.info = self._client._t.request("GET", f"/api/trees/{self.id}").json()["tree"]
        return self.info

    def wait(self, timeout: Optional[Duration] = None) -> Outcome:
        """Until the tree ended (or is ambiguous). Raises
        :class:`TimeoutExpired` when ``timeout`` passes first (the tree
        runs on, as with ``Popen.wait``)."""
        limit = _seconds(timeout)
        import time

        deadline = None if limit is None else time.monotonic() + limit
        while True:
            step = _WAIT_STEP if deadline is None else max(0.0, min(_WAIT_STEP, deadline - time.monotonic()))
            row = self._client._t.request(
                "GET", _http.query(f"/api/trees/{self.id}/wait", {"timeout": f"{int(step * 1000)}ms"}),
                timeout=step + 30).json()
            self.info = row
            if row["state"] in SETTLED_STATES:
                return _outcome(row)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutExpired(self.info.get("argv") or [], limit or 0.0, tree=self.id)

    def kill(self, grace: Optional[Duration] = None) -> Report:
        """Tears the tree down (first signal, grace, a committed
        authorization, SIGKILL, verified); answers when it is done."""
        q = _http.query(f"/api/trees/{self.id}/kill", {"grace": duration(grace)})
        g = _seconds(grace) or 0.0
        r = _report(self._client._t.request("POST", q, timeout=g + 120).json())
        return r

    def detail(self) -> Dict[str, Any]:
        """The whole record: members, observations, signals, authorizations, events."""
        d: Dict[str, Any] = self._client._t.request("GET", f"/api/trees/{self.id}").json()
        self.info = d["tree"]
        return d

    def members(self) -> List[Dict[str, Any]]:
        return list(self.detail()["members"])

    def authorizations(self) -> List[Dict[str, Any]]:
        return list(self.detail()["authorizations"])

    def events(self, follow: bool = False) -> Union[List[Dict[str, Any]], Iterator[Dict[str, Any]]]:
        """The tree's audit trail (dicts as in the export: ``seq``, ``kind``,
        ``data``, …). ``follow=True``: an iterator that yields them as they
        are committed and ends when the tree has ended."""
        if follow:
            return _http.sse_events(self._client._t.stream(f"/api/events/stream?tree={self.id}"))
        out: List[Dict[str, Any]] = []
        after = 0
        while True:
            page = self._client._t.request(
                "GET", _http.query("/api/events", {"tree": self.id, "after": after, "limit": 10000})
            ).json()
            out.extend(page)
            if len(page) < 10000:
                return out
            after = page[-1]["seq"]

    def logs(self, follow: bool = False) -> Union[bytes, Iterator[bytes]]:
        """The captured stdout and stderr (where they were not passed).
        ``follow=True``: an iterator of the output as it is written, over one
        streamed answer (``GET /api/trees/{id}/log?follow=1``: what is kept
        first, then each write, until the tree has ended)."""
        if not follow:
            return self._client._t.request("GET", f"/api/trees/{self.id}/log").body
        return self._client._t.stream(f"/api/trees/{self.id}/log?follow=1", accept="text/plain")

    def __enter__(self) -> "Tree":
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None:
                f.close()
        if self.state not in SETTLED_STATES:
            try:
                self.kill()
            except NotFound:
                pass


class Client:
    """The service's API: over its Unix socket (``socket``, default as the
    CLI finds it), or TCP with a token (``url="http://127.0.0.1:7878"``).

    At most ``max_connections`` requests are open at once (other threads
    wait their turn); a request the service cannot take now (503 but a
    closed dispatch, a connection refused or reset before it was whole) is
    tried again up to ``retries`` times, after the service's ``Retry-After``
    or a growing pause, then raised as :class:`Unavailable` or
    :class:`ConnectionFailed`."""

    def __init__(self, socket: Optional[str] = None, url: Optional[str] = None,
                 token: Optional[str] = None, *, timeout: Optional[float] = 120.0,
                 max_connections: int = _http.MAX_CONNECTIONS,
                 retries: int = _http.RETRIES) -> None:
        self.endpoint = _endpoint(socket, url, token)
        self._t = _http.Transport(self.endpoint, timeout, max_connections=max_connections,
                                  retries=retries)

    def spawn(self, argv: Sequence[str], *, label: Optional[str] = None,
              grace: Optional[Duration] = None, timeout: Optional[Duration] = None,
              env: Optional[Mapping[str, str]] = None,
              cwd: Optional[Union[str, "os.PathLike[str]"]] = None,
              limits: Optional[Mapping[str, Any]] = None, lifetime: str = "root",
              first_signal: Optional[str] = None, stdin: StdSpec = None, stdout: StdSpec = None,
              stderr: StdSpec = None, owner: OwnerSpec = None) -> Tree:
        """Starts ``argv`` as a tree owned by this process, or by ``owner``
        (a pid, or a pid and its start time): the tree ends within a second
        of that process's exit. On the Unix socket a principal may name its
        own descendants (root, any process); else 403, :class:`Forbidden`."""
        body = _spawn_body(argv, label, grace, timeout, env, cwd, limits, lifetime, first_signal,
                           owner)
        stdio = _Stdio(stdin, stdout, stderr)
        if not self.endpoint.unix and stdio.slots:
            return self._spawn_streamed(body, stdio)
        try:
            row = self._t.request("POST", "/api/trees", body, headers=stdio.header,
                                  fds=stdio.fds).json()
        except BaseException:
            stdio.abandon()
            raise
        stdio.sent()
        return Tree(self, row, stdio)

    def _spawn_streamed(self, body: Dict[str, Any], stdio: _Stdio) -> Tree:
        """Over TCP: the descriptors the Unix socket would pass are relayed
        over the spawn's own connection (streamed stdio, ``_stdio.py``)."""
        fds = {name: os.dup(fd) for name, fd in zip(stdio.slots, stdio.fds)}
        try:
            headers, sock, reader = self._t.upgrade("POST", "/api/trees",
                                                    {**body, "stdio": "stream"}, _stdio.PROTOCOL)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            stdio.abandon()
            raise
        relay = _stdio.Relay(sock, reader, fds)
        stdio.sent()
        tree_id = int(headers.get("treewarden-tree", "0"))
        row = self._t.request("GET", f"/api/trees/{tree_id}").json()["tree"]
        tree = Tree(self, row, stdio)
        tree.relay = relay
        return tree

    def tree(self, tree_id: int) -> Tree:
        return Tree(self, self._t.request("GET", f"/api/trees/{int(tree_id)}").json()["tree"])

    def trees(self, label: Optional[str] = None, state: Union[None, str, Sequence[str]] = None,
              alive: Optional[bool] = None) -> List[Tree]:
        """Trees as the ledger has them, in one request (per page of 1000):
        ``label`` exactly, ``state`` one or several, ``alive`` True for
        trees not yet in a final state."""
        path: Optional[str] = _http.query("/api/trees", _list_query(label, state, alive))
        out: List[Tree] = []
        while path:
            r = self._t.request("GET", path)
            out.extend(Tree(self, row) for row in r.json())
            path = _next_link(r.headers)
        return out

    def health(self) -> Dict[str, Any]:
        v: Dict[str, Any] = self._t.request("GET", "/healthz").json()
        return v


async def _through_cancellation(work: "asyncio.Future[Any]") -> None:
    """Waits for ``work`` to finish whatever cancellations arrive meanwhile
    (each is honoured by the caller's re-raise once ``work`` is done)."""
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            continue
        except Exception:  # noqa: BLE001 - its outcome is read below
            break


class AsyncTree:
    """A :class:`Tree` whose methods are coroutines, and whose pipes are
    asyncio streams: ``stdin`` an :class:`asyncio.StreamWriter`,
    ``stdout``/``stderr`` :class:`asyncio.StreamReader` (for ``PIPE``).

    Cancellation means teardown: a task cancelled in :meth:`wait` (an
    ``asyncio.timeout``, a ``wait_for``, a harness cancelling its tool
    call) tears the tree down (first signal, grace, forced kill, verified)
    before the ``CancelledError`` goes on; a ``wait(timeout=...)`` that
    expires raises :class:`TimeoutExpired` and leaves the tree running, as
    ``Popen.wait`` does."""

    def __init__(self, client: "AsyncClient", row: Mapping[str, Any]) -> None:
        self._client = client
        self.id: int = int(row["id"])
        self.info: Dict[str, Any] = dict(row)
        self.stdin: Optional[asyncio.StreamWriter] = None
        self.stdout: Optional[asyncio.StreamReader] = None
        self.stderr: Optional[asyncio.StreamReader] = None
        #: Over TCP, what carries the streamed stdio (``relay.close()`` hangs it up).
        self.relay: Optional[_stdio.AsyncRelay] = None
        self._transports: List[asyncio.BaseTransport] = []

    async def _attach(self, stdio: _Stdio) -> None:
        """The parent's ends of the pipes, as streams on the running loop."""
        loop = asyncio.get_running_loop()
        f = stdio.parent["stdin"]
        if f is not None:
            stdio.parent["stdin"] = None
            wt, wp = await loop.connect_write_pipe(
                lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), f)
            self._transports.append(wt)
            self.stdin = asyncio.StreamWriter(wt, wp, None, loop)
        for name in ("stdout", "stderr"):
            f = stdio.parent[name]
            if f is not None:
                stdio.parent[name] = None
                reader = asyncio.StreamReader()
                rt, _ = await loop.connect_read_pipe(
                    lambda r=reader: asyncio.StreamReaderProtocol(r), f)  # type: ignore[misc]
                self._transports.append(rt)
                setattr(self, name, reader)

    def _close_pipes(self) -> None:
        for t in self._transports:
            t.close()
        self._transports = []

    def __repr__(self) -> str:
        return f"<treewarden.AsyncTree {self.id} {self.info.get('state')}>"

    @property
    def state(self) -> str:
        return str(self.info.get("state"))

    async def wait(self, timeout: Optional[Duration] = None) -> Outcome:
        import time

        limit = _seconds(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            step = _WAIT_STEP if deadline is None else max(0.0, min(_WAIT_STEP, deadline - time.monotonic()))
            try:
                row = (await self._client._t.request(
                    "GET", _http.query(f"/api/trees/{self.id}/wait",
                                       {"timeout": f"{int(step * 1000)}ms"}),
                    timeout=step + 30)).json()
            except asyncio.CancelledError:
                await self._teardown_cancelled()
                raise
            self.info = row
            if row["state"] in SETTLED_STATES:
                return _outcome(row)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutExpired(self.info.get("argv") or [], limit or 0.0, tree=self.id)

    async def _teardown_cancelled(self) -> None:
        """The task was cancelled: the tree is torn down first (a failed
        teardown leaves the tree named in ``AsyncClient.left_running``)."""
        work = asyncio.ensure_future(self.kill())
        await _through_cancellation(work)
        if work.cancelled() or work.exception() is not None:
            self._client.left_running.append(self.id)

    async def kill(self, grace: Optional[Duration] = None) -> Report:
        q = _http.query(f"/api/trees/{self.id}/kill", {"grace": duration(grace)})
        g = _seconds(grace) or 0.0
        return _report((await self._client._t.request("POST", q, timeout=g + 120)).json())

    async def detail(self) -> Dict[str, Any]:
        d: Dict[str, Any] = (await self._client._t.request("GET", f"/api/trees/{self.id}")).json()
        self.info = d["tree"]
        return d

    async def members(self) -> List[Dict[str, Any]]:
        return list((await self.detail())["members"])

    async def authorizations(self) -> List[Dict[str, Any]]:
        return list((await self.detail())["authorizations"])

    async def events(self) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        after = 0
        while True:
            page = (await self._client._t.request(
                "GET", _http.query("/api/events", {"tree": self.id, "after": after, "limit": 10000})
            )).json()
            out.extend(page)
            if len(page) < 10000:
                return out
            after = page[-1]["seq"]

    def follow_events(self) -> AsyncIterator[Dict[str, Any]]:
        """The trail as it is committed, until the tree has ended."""
        return _http.asse_events(self._client._t.stream(f"/api/events/stream?tree={self.id}"))

    async def logs(self) -> bytes:
        return (await self._client._t.request("GET", f"/api/trees/{self.id}/log")).body

    def follow_logs(self) -> AsyncIterator[bytes]:
        """The captured output as it is written, over one streamed answer
        (what is kept first, then each write), until the tree has ended."""
        return self._client._t.stream(f"/api/trees/{self.id}/log?follow=1", accept="text/plain")

    async def __aenter__(self) -> "AsyncTree":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._close_pipes()
        if self.state not in SETTLED_STATES:
            try:
                await self.kill()
            except NotFound:
                pass
        if self.relay is not None:
            self.relay.close()


class AsyncClient:
    """:class:`Client`'s methods as coroutines (asyncio), with the same
    bound on open requests (``max_connections``) and retries.

    A cancelled :meth:`spawn` never leaves a tree its caller cannot name:
    the request runs on to its answer, and a tree it made is torn down
    before the ``CancelledError`` goes on (one whose teardown failed is
    named in :attr:`left_running`)."""

    def __init__(self, socket: Optional[str] = None, url: Optional[str] = None,
                 token: Optional[str] = None, *, timeout: Optional[float] = 120.0,
                 max_connections: int = _http.MAX_CONNECTIONS,
                 retries: int = _http.RETRIES) -> None:
        self.endpoint = _endpoint(socket, url, token)
        self._t = _http.AsyncTransport(self.endpoint, timeout, max_connections=max_connections,
                                       retries=retries)
        #: Trees a cancellation was to tear down whose teardown failed.
        self.left_running: List[int] = []

    async def spawn(self, argv: Sequence[str], *, label: Optional[str] = None,
                    grace: Optional[Duration] = None, timeout: Optional[Duration] = None,
                    env: Optional[Mapping[str, str]] = None,
                    cwd: Optional[Union[str, "os.PathLike[str]"]] = None,
                    limits: Optional[Mapping[str, Any]] = None, lifetime: str = "root",
                    first_signal: Optional[str] = None, stdin: StdSpec = None,
                    stdout: StdSpec = None, stderr: StdSpec = None,
                    owner: OwnerSpec = None) -> AsyncTree:
        body = _spawn_body(argv, label, grace, timeout, env, cwd, limits, lifetime, first_signal,
                           owner)
        stdio = _Stdio(stdin, stdout, stderr)
        if not self.endpoint.unix and stdio.slots:
            return await self._spawn_streamed(body, stdio)
        request = asyncio.ensure_future(self._t.request(
            "POST", "/api/trees", body, headers=stdio.header, fds=stdio.fds))
        try:
            row = (await asyncio.shield(request)).json()
        except asyncio.CancelledError:
            await self._undo(request, stdio)
            raise
        except BaseException:
            stdio.abandon()
            raise
        stdio.sent()
        tree = AsyncTree(self, row)
        try:
            await tree._attach(stdio)
        except BaseException:
            stdio.abandon()
            tree._close_pipes()
            await tree._teardown_cancelled()
            raise
        return tree

    async def _spawn_streamed(self, body: Dict[str, Any], stdio: _Stdio) -> AsyncTree:
        """Over TCP: the descriptors the Unix socket would pass are relayed
        over the spawn's own connection by two tasks (streamed stdio,
        ``_stdio.py``); the tree's pipes are asyncio streams, as on the
        socket. Cancelled in flight, it undoes the tree as :meth:`spawn` does."""
        fds = {name: os.dup(fd) for name, fd in zip(stdio.slots, stdio.fds)}

        def drop() -> None:
            for fd in fds.values():
                os.close(fd)
            fds.clear()
            stdio.abandon()

        request = asyncio.ensure_future(self._t.upgrade(
            "POST", "/api/trees", {**body, "stdio": "stream"}, _stdio.PROTOCOL))
        try:
            headers, reader, writer = await asyncio.shield(request)
        except asyncio.CancelledError:
            await _through_cancellation(request)
            drop()
            if not request.cancelled() and request.exception() is None:
                headers, _, writer = request.result()
                writer.close()
                await AsyncTree(self, {"id": headers.get("treewarden-tree", "0")}
                                )._teardown_cancelled()
            raise
        except BaseException:
            drop()
            raise
        tree = AsyncTree(self, {"id": headers.get("treewarden-tree", "0"), "state": "running"})
        relay = _stdio.AsyncRelay(reader, writer, fds)
        fds.clear()
        try:
            tree.relay = relay
            await relay.start()
            stdio.sent()
            tree.info = (await self._t.request("GET", f"/api/trees/{tree.id}")).json()["tree"]
            await tree._attach(stdio)
        except BaseException:
            relay.close()
            stdio.abandon()
            tree._close_pipes()
            await tree._teardown_cancelled()
            raise
        return tree

    async def _undo(self, request: "asyncio.Future[_http.Response]", stdio: _Stdio) -> None:
        """A spawn cancelled in flight: its request runs on to its answer;
        a tree it made is torn down before the cancellation goes on."""
        await _through_cancellation(request)
        stdio.abandon()
        if request.cancelled() or request.exception() is not None:
            return
        await AsyncTree(self, request.result().json())._teardown_cancelled()

    async def tree(self, tree_id: int) -> AsyncTree:
        """The tree ``tree_id`` (without pipes: those are its spawner's)."""
        r = await self._t.request("GET", f"/api/trees/{int(tree_id)}")
        return AsyncTree(self, r.json()["tree"])

    async def trees(self, label: Optional[str] = None,
                    state: Union[None, str, Sequence[str]] = None,
                    alive: Optional[bool] = None) -> List[AsyncTree]:
        path: Optional[str] = _http.query("/api/trees", _list_query(label, state, alive))
        out: List[AsyncTree] = []
        while path:
            r = await self._t.request("GET", path)
            out.extend(AsyncTree(self, row) for row in r.json())
            path = _next_link(r.headers)
        return out

    async def health(self) -> Dict[str, Any]:
        v: Dict[str, Any] = (await self._t.request("GET", "/healthz")).json()
        return v
