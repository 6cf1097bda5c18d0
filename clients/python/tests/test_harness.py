"""The client as a Python agent platform uses it, without the workarounds
it needed: one test per item, each against a real ``serve``.

1. asyncio trees' pipes are ``asyncio.StreamReader``/``StreamWriter``;
2. a cancelled ``wait()`` tears the tree down; a cancelled ``spawn()``
   leaves no tree its caller did not learn of;
3. a timeout is told from a kill by a typed outcome kind;
4. ``owner=`` names a descendant (any process, for root); a non-root
   user's other processes are refused;
5. under load: bounded concurrency, 503 retried then ``Unavailable``, a 413
   reported as such;
6. ``logs(follow=True)`` is one streamed answer; the client spawns without
   ``/proc`` over TCP (as on Windows).

Ground truth is the workload's and the kernel's: pids a workload printed
or carries in its argv, read back from ``/proc``.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional, Set

import pytest

import treewarden
from conftest import Server, alive, marked, scale, wait_until
from conftest import binary as conftest_binary

PACKAGE = Path(treewarden.__file__).resolve().parent


def pids_of(mark: str) -> List[int]:
    return marked(mark)


# 1. asyncio streams --------------------------------------------------------


def test_async_pipes_are_asyncio_streams_and_do_not_block_the_loop(server: Server) -> None:
    async def main() -> None:
        c = server.async_client()
        t = await c.spawn(["sh", "-c", "cat; echo done >&2"], stdin=treewarden.PIPE,
                          stdout=treewarden.PIPE, stderr=treewarden.PIPE,
                          env=server.body_env(), grace="200ms")
        assert isinstance(t.stdin, asyncio.StreamWriter)
        assert isinstance(t.stdout, asyncio.StreamReader)
        assert isinstance(t.stderr, asyncio.StreamReader)
        # While a read waits for a line nobody wrote yet, the loop runs on.
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)  # the ticker's pace, not a wait for a condition

        tick = asyncio.ensure_future(ticker())
        pending = asyncio.ensure_future(t.stdout.readline())
        assert await _until(lambda: ticks >= 5, 5), "the loop did not run while a read waited"
        assert not pending.done()
        t.stdin.write(b"hello\n")
        await t.stdin.drain()
        assert await asyncio.wait_for(pending, 10 * scale()) == b"hello\n"
        tick.cancel()
        # End of input ends cat; the shell then writes to stderr and exits.
        t.stdin.close()
        assert await asyncio.wait_for(t.stdout.read(), 10 * scale()) == b""
        assert await asyncio.wait_for(t.stderr.read(), 10 * scale()) == b"done\n"
        out = await t.wait(timeout=20)
        assert (out.state, out.returncode, out.kind) == ("ended", 0, "exited")
        await t.__aexit__(None, None, None)

    asyncio.run(main())


async def _until(cond, limit: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit * scale()
    while not cond():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.005)  # the poll interval, not a wait for a condition
    return True


# 2. cancellation ------------------------------------------------------------


def test_cancelling_wait_tears_the_tree_down(server: Server) -> None:
    async def main() -> None:
        c = server.async_client()
        t = await c.spawn(["sh", "-c", f"trap '' TERM; sleep 600 & echo $$ $!; wait # {server.mark}"],
                          stdout=treewarden.PIPE, env=server.body_env(), grace="200ms")
        assert t.stdout is not None
        pids = [int(p) for p in (await t.stdout.readline()).split()]
        assert all(alive(p) for p in pids)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(t.wait(), 0.3)
        # The CancelledError went on only once the teardown was done.
        assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
        out = await (await c.tree(t.id)).wait(timeout=10)
        assert (out.state, out.kind, out.forced) == ("ended", "killed", True)
        assert c.left_running == []
        await t.__aexit__(None, None, None)

    asyncio.run(main())


def test_twenty_spawns_cancelled_at_random_points_leave_no_unnamed_tree(server: Server) -> None:
    seed = int(os.environ.get("TW_PY_SEED") or random.randrange(1 << 30))
    print(f"TW_PY_SEED={seed}")
    rng = random.Random(seed)
    label = f"cancel-{server.mark}"

    async def main() -> None:
        c = server.async_client()
        learned: Set[int] = set()
        outcomes = {"returned": 0, "cancelled": 0}

        async def one(i: int) -> None:
            # Each call's processes carry its number in their environment.
            t = await c.spawn(["sh", "-c", "sleep 600 & wait"], label=label, grace="100ms",
                              env=dict(server.body_env(), TW_PY_CALL=f"{server.mark}-n{i}-"))
            learned.add(i)
            trees[i] = t

        trees = {}
        tasks = [asyncio.ensure_future(one(i)) for i in range(20)]
        # Cancelled at random points: before the request, during it, after.
        await asyncio.gather(*[_cancel_later(task, rng.uniform(0.0, 0.4)) for task in tasks])
        for task in tasks:
            try:
                await task
                outcomes["returned"] += 1
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
        print(f"20 spawns: {outcomes}")
        assert outcomes["returned"] + outcomes["cancelled"] == 20
        # The service's own listing: every live tree of the label is one the
        # caller learned.
        live = {x.id for x in await c.trees(label=label, alive=True)}
        assert live == {trees[i].id for i in learned}, (live, learned)
        # The kernel: every live process of the test is one of a learned
        # tree (by the call number in its environment).
        def unnamed() -> List[int]:
            out = []
            for pid in pids_of(server.mark):
                try:
                    cmd = Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                if not any(f"{server.mark}-n{i}-".encode() in cmd for i in learned):
                    out.append(pid)
            return out

        assert unnamed() == []
        assert c.left_running == []
        for i in learned:
            await trees[i].kill()
        assert await _until(lambda: pids_of(server.mark) == [], 10), pids_of(server.mark)
        assert [x.id for x in await c.trees(label=label, alive=True)] == []

    asyncio.run(main())


async def _cancel_later(task: "asyncio.Task[None]", after: float) -> None:
    await asyncio.sleep(after)  # the random point of the cancellation, part of the scenario
    task.cancel()


# 3. typed outcome -----------------------------------------------------------


def test_a_timeout_is_told_from_a_kill_by_a_typed_outcome(server: Server) -> None:
    c = server.client()
    timed = c.spawn(["sleep", "600"], timeout=0.4, grace="200ms", env=server.body_env())
    killed = c.spawn(["sleep", "600"], grace="200ms", env=server.body_env())
    stubborn = c.spawn(["sh", "-c", f"trap '' TERM; echo up; sleep 600 # {server.mark}"],
                       stdout=treewarden.PIPE, grace="200ms", env=server.body_env())
    exited = c.spawn(["sh", "-c", "exit 3"], env=server.body_env())
    killed.kill()
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"up\n"
    stubborn.kill()
    t = timed.wait(timeout=30)
    k = killed.wait(timeout=30)
    # The same status, told apart without reading any text.
    assert t.returncode == k.returncode == -signal.SIGTERM
    assert (t.kind, t.timed_out, t.forced, t.killed_by) == ("timed_out", True, False, None)
    assert (k.kind, k.timed_out, k.forced) == ("killed", False, False)
    assert k.killed_by is not None and k.killed_by.startswith(f"uid {os.getuid()}")
    s = stubborn.wait(timeout=30)
    assert (s.kind, s.forced, s.returncode) == ("killed", True, -signal.SIGKILL)
    e = exited.wait(timeout=30)
    assert (e.kind, e.forced, e.returncode) == ("failed", False, 3)
    # The API's own answer carries it: `outcome` beside the row.
    assert timed.info["outcome"]["kind"] == "timed_out"
    assert "forced" not in timed.info["outcome"]
    assert set(treewarden.OUTCOME_KINDS) >= {t.kind, k.kind, e.kind}


# 4. owner= ------------------------------------------------------------------


def test_owner_names_another_process_and_the_tree_ends_with_it(server: Server) -> None:
    c = server.client()
    worker = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        t = c.spawn(["sh", "-c", f"sleep 600 # {server.mark}"], owner=worker.pid,
                    env=server.body_env(), grace="200ms")
        assert t.info["owner"]["pid"] == worker.pid
        assert t.info["owner"]["start"] == treewarden.start_ticks(worker.pid)
        assert t.info["owner"]["kind"] == "client"
        root = t.info["root_pid"]
        assert alive(root)
        worker.kill()
        worker.wait()
        out = t.wait(timeout=20)
        assert (out.state, out.kind) == ("ended", "owner_gone")
        assert not alive(root)
        # A pid and a start that do not match are a different process.
        with pytest.raises(treewarden.BadRequest):
            c.spawn(["true"], owner=(os.getpid(), 1), env=server.body_env())
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


_AS_USER = r"""
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
import treewarden
c = treewarden.Client(socket=sys.argv[2])
out = {}
child = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL)
try:
    t = c.spawn(["sleep", "600"], owner=child.pid, cwd="/", grace="100ms",
                env={"TW_PY_MARK": sys.argv[3]})
    out["descendant"] = [t.info["owner"]["pid"] == child.pid, child.pid]
finally:
    child.kill(); child.wait()
out["descendant_end"] = t.wait(timeout=20).kind
try:
    c.spawn(["true"], owner=int(sys.argv[4]), cwd="/")
    out["other"] = "accepted"
except treewarden.Forbidden as e:
    out["other"] = ["forbidden", e.status]
print(json.dumps(out))
"""


def test_a_non_root_user_names_its_descendant_but_not_another_process() -> None:
    if conftest_binary() is None:
        pytest.skip("skipped: no treewarden binary (cargo build, or set TREEWARDEN_BIN)")
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        _skip("a second user needs root and useradd")
    python = _world_python()
    if python is None:
        _skip("no Python 3.9+ that another user may run")
    name = f"twpy{os.getpid() % 100000}"
    made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                           "--user-group", name], capture_output=True, text=True)
    if made.returncode != 0:
        _skip(f"useradd failed: {made.stderr.strip()}")
    # The server's socket and the package where the user reaches them.
    shared = Path(tempfile.mkdtemp(prefix="tw-py-user-"))
    s: Optional[Server] = None
    try:
        os.chmod(shared, 0o755)
        shutil.copytree(PACKAGE, shared / "pkg" / "treewarden")
        (shared / "srv").mkdir()
        s = Server(shared / "srv")
        sock = s.socket
        uid = pwd.getpwnam(name).pw_uid
        # Another process, not the user's descendant: this test's own.
        r = subprocess.run([python or "", "-c", _AS_USER, str(shared / "pkg"), sock,
                            s.mark, str(os.getpid())], capture_output=True, text=True,
                           user=uid, group=pwd.getpwnam(name).pw_gid, cwd="/", timeout=120)
        assert r.returncode == 0, r.stderr + s.log()
        out = json.loads(r.stdout)
        assert out["descendant"][0] is True, out
        assert out["descendant_end"] == "owner_gone", out
        assert out["other"] == ["forbidden", 403], out
    finally:
        if s is not None:
            s.close()
        subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(shared, ignore_errors=True)


def _world_python() -> Optional[str]:
    """A Python 3.9+ every user may run (this one may sit under /root)."""
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = Path(cand).resolve()
        if not real.is_file():
            continue
        if all(os.stat(d).st_mode & 0o001 for d in real.parents) and os.stat(real).st_mode & 0o001:
            v = subprocess.run([str(real), "-c", "import sys; print(sys.version_info >= (3, 9))"],
                               capture_output=True, text=True)
            if v.stdout.strip() == "True":
                return str(real)
    return None


def _skip(why: str) -> None:
    if os.environ.get("TREEWARDEN_LANE_REQUIRED") == "1":
        pytest.fail(f"skipped: {why} (TREEWARDEN_LANE_REQUIRED=1)")
    pytest.skip(f"skipped: {why}")


# 5. under load --------------------------------------------------------------


def test_a_hundred_concurrent_calls_all_answer(server: Server) -> None:
    label = f"load-{server.mark}"

    async def main(max_connections: int) -> List[int]:
        c = treewarden.AsyncClient(socket=server.socket, max_connections=max_connections)

        async def one(i: int) -> int:
            t = await c.spawn(["sh", "-c", f"exit {i % 7}"], label=label, env=server.body_env())
            return (await t.wait(timeout=60)).returncode or 0

        return list(await asyncio.gather(*[one(i) for i in range(100)]))

    # The client's own bound (16 open at once), and none (all 100 at once:
    # past the service's 64 per peer, its 503s are waited out and retried).
    for bound in (treewarden._http.MAX_CONNECTIONS, 100):
        t0 = time.monotonic()
        codes = asyncio.run(main(bound))
        print(f"100 concurrent spawn+wait, max_connections={bound}: "
              f"{time.monotonic() - t0:.2f} s")
        assert codes == [i % 7 for i in range(100)]
    # The blocking client from 100 threads.
    c = server.client()
    errors: List[BaseException] = []
    counts: List[int] = []

    def call() -> None:
        try:
            counts.append(len(c.trees(label=label)))
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(100)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == [] and counts == [200] * 100, errors[:3]


def test_a_503_is_retried_then_raised_as_unavailable(server: Server) -> None:
    # Hold every connection this uid may have (64), idle: the next is
    # answered 503 with Retry-After until they are let go.
    held = []
    try:
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.socket)
            held.append(s)
        no_retry = treewarden.Client(socket=server.socket, retries=0)
        assert wait_until(lambda: _refused(no_retry), 10), "the 65th connection was not refused"
        with pytest.raises(treewarden.Unavailable) as e:
            no_retry.trees()
        assert e.value.status == 503
        # With retries: the held connections go while it waits, and it
        # gets its answer.
        c = server.client()
        releaser = threading.Timer(0.3, lambda: [h.close() for h in held])
        releaser.start()
        t0 = time.monotonic()
        assert c.trees() == []
        print(f"answered after {time.monotonic() - t0:.2f} s of 503s")
        releaser.join()
    finally:
        for h in held:
            h.close()


def _refused(c: treewarden.Client) -> bool:
    try:
        c.trees()
        return False
    except treewarden.Unavailable:
        return True


def test_a_body_over_the_limit_is_a_413_not_a_broken_pipe(server: Server) -> None:
    addr = (server.dir / "ready-0").read_text().strip()
    token = (server.data / "api-token").read_text().strip()
    for c in (server.client(), treewarden.Client(url=f"http://{addr}", token=token)):
        with pytest.raises(treewarden.PayloadTooLarge) as e:
            c.spawn(["echo", "x" * (1536 * 1024)], env=server.body_env())
        assert e.value.status == 413 and isinstance(e.value, treewarden.BadRequest)
        assert "too large" in str(e.value) or "over 1048576 bytes" in str(e.value), e.value
        # A large body under the limit still goes through (after 100-continue;
        # arguments of at most 128 KiB each, as exec takes them).
        t = c.spawn(["sh", "-c", "exit 0"] + ["x" * (100 * 1024)] * 5, env=server.body_env())
        assert t.wait(timeout=20).returncode == 0

    async def via_async() -> None:
        with pytest.raises(treewarden.PayloadTooLarge):
            await server.async_client().spawn(["echo", "x" * (1536 * 1024)])

    asyncio.run(via_async())


# 6. logs, Windows -----------------------------------------------------------


def test_logs_follow_is_one_streamed_answer(server: Server, tmp_path) -> None:
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    c = server.client()
    t = c.spawn(["sh", "-c", f"echo first; read x < '{fifo}'; echo second"],
                env=server.body_env())
    calls = {"request": 0, "stream": 0}
    request, stream = c._t.request, c._t.stream

    def counted_request(*a, **k):  # type: ignore[no-untyped-def]
        calls["request"] += 1
        return request(*a, **k)

    def counted_stream(*a, **k):  # type: ignore[no-untyped-def]
        calls["stream"] += 1
        return stream(*a, **k)

    c._t.request, c._t.stream = counted_request, counted_stream  # type: ignore[method-assign]
    chunks = iter(t.logs(follow=True))
    assert next(chunks) == b"first\n"
    with open(fifo, "w") as f:
        f.write("go\n")
    t0 = time.monotonic()
    assert next(chunks) == b"second\n"
    latency = time.monotonic() - t0
    print(f"a followed line arrived {1000 * latency:.0f} ms after it was released")
    assert latency < 1.0 * scale()
    assert list(chunks) == []
    assert calls == {"request": 0, "stream": 1}, calls
    assert t.wait(timeout=10).returncode == 0


_NO_PROC = r"""
import asyncio, builtins, json, os, socket, subprocess, sys
sys.path.insert(0, sys.argv[1])
real_open = builtins.open
def guarded(path, *a, **k):
    if str(path).startswith("/proc"):
        raise AssertionError(f"read {path}")
    return real_open(path, *a, **k)
sys.platform = "win32"
import treewarden
builtins.open = guarded
c = treewarden.Client(url=sys.argv[2], token=sys.argv[3])
t = c.spawn(["sh", "-c", "exit 5"], env={"TW_PY_MARK": sys.argv[4]})
print(json.dumps({"owner": t.info["owner"]["pid"], "me": os.getpid(),
                  "rc": t.wait(timeout=20).returncode}))
"""


def test_the_client_spawns_over_tcp_without_proc_as_on_windows(server: Server) -> None:
    addr = (server.dir / "ready-0").read_text().strip()
    token = (server.data / "api-token").read_text().strip()
    p = subprocess.run([sys.executable, "-c", _NO_PROC, str(PACKAGE.parent), f"http://{addr}",
                        token, server.mark], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["rc"] == 5
    assert out["owner"] == out["me"]
