"""The client's interface against a real ``serve`` on its Unix socket:
spawn, wait, kill, members, events, logs, the list filters, stdio passed
as descriptors, errors by code, asyncio, ``run`` over the wrapper, and a
service restart that keeps a client's trees.

Ground truth comes from the workload: pids it prints, markers in its argv,
``/proc`` read by the test, never only the product's answer.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import treewarden
from conftest import Server, alive, marked, wait_until, wait_until_async


def cmdline(pid: int) -> bytes:
    """The process's command line as /proc has it (empty once gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_spawn_wait_gives_the_status_as_popen_does(server: Server) -> None:
    c = server.client()
    t = c.spawn(["sh", "-c", "exit 3"], env=server.body_env(), label="rc")
    out = t.wait(timeout=20)
    assert out == treewarden.Outcome(state="ended", returncode=3, tree_id=t.id, kind="failed")
    t = c.spawn(["sh", "-c", "kill -KILL $$"], env=server.body_env())
    assert t.wait(timeout=20).returncode == -signal.SIGKILL
    # The owner on the record is this process, by pid and start time.
    pid, start = treewarden.own_identity()
    assert t.info["owner"]["pid"] == pid
    assert t.info["owner"]["start"] == start
    assert t.info["owner"]["kind"] == "client"


def test_wait_with_a_timeout_raises_and_the_tree_runs_on(server: Server) -> None:
    c = server.client()
    t = c.spawn(["sleep", "600"], env=server.body_env(), grace="200ms")
    t0 = time.monotonic()
    with pytest.raises(treewarden.TimeoutExpired) as e:
        t.wait(timeout=datetime.timedelta(milliseconds=300))
    assert isinstance(e.value, subprocess.TimeoutExpired)
    assert time.monotonic() - t0 >= 0.3
    assert alive(t.info["root_pid"])
    r = t.kill()
    assert r.state == "ended" and r.tree == t.id
    assert not alive(t.info["root_pid"])


def test_cat_with_pipes_echoes_and_survives_a_sigkill_of_the_service(server: Server) -> None:
    c = server.client()
    t = c.spawn(["cat", "-u"], stdin=treewarden.PIPE, stdout=treewarden.PIPE,
                env=server.body_env(), label="cat", grace="200ms")
    assert t.stdin is not None and t.stdout is not None
    t.stdin.write(b"hello\n")
    t.stdin.flush()
    assert t.stdout.readline() == b"hello\n"
    root = t.info["root_pid"]
    # The pipes are ours and the tree's: the service is not on the path.
    server.stop(signal.SIGKILL)
    t.stdin.write(b"after the crash\n")
    t.stdin.flush()
    assert t.stdout.readline() == b"after the crash\n"
    assert alive(root)
    # The next service adopts it (its owner, this process, lives) and its
    # stdio is still ours.
    server.start()
    c = server.client()
    assert [x.id for x in c.trees(label="cat", alive=True)] == [t.id]
    t.stdin.write(b"adopted\n")
    t.stdin.flush()
    assert t.stdout.readline() == b"adopted\n"
    # End of input ends cat: the tree ends by itself. Its status is
    # unknown (None): the adopting service is not its root's parent, so it
    # never reaped it.
    t.stdin.close()
    assert c.tree(t.id).wait(timeout=20) == treewarden.Outcome("ended", None, t.id, "exited")
    assert t.stdout.read() == b""
    # Nothing was captured: its output went to our pipe.
    assert c.tree(t.id).logs() == b""


def test_stdio_defaults_to_the_captured_log_and_takes_files_and_devnull(server: Server,
                                                                      tmp_path) -> None:
    c = server.client()
    t = c.spawn(["sh", "-c", "echo out; echo err >&2"], env=server.body_env())
    t.wait(timeout=20)
    assert sorted(t.logs().splitlines()) == [b"err", b"out"]
    path = tmp_path / "out.txt"
    with open(path, "wb") as f:
        t = c.spawn(["sh", "-c", "echo to-file; echo also >&2; cat"], stdout=f,
                    stderr=treewarden.STDOUT, stdin=treewarden.DEVNULL, env=server.body_env())
    assert t.wait(timeout=20).returncode == 0
    assert path.read_bytes().splitlines() == [b"to-file", b"also"]


def test_trees_filters_by_label_state_and_liveness_in_one_request(server: Server) -> None:
    c = server.client()
    label = f"call-{server.mark}"
    a = c.spawn(["sleep", "600"], label=label, env=server.body_env(), grace="100ms")
    b = c.spawn(["sh", "-c", "exit 0"], label=label, env=server.body_env())
    b.wait(timeout=20)
    other = c.spawn(["sleep", "600"], label="other", env=server.body_env(),
                    grace="100ms")
    assert [t.id for t in c.trees(label=label, alive=True)] == [a.id]
    assert sorted(t.id for t in c.trees(label=label)) == sorted([a.id, b.id])
    assert [t.id for t in c.trees(label=label, state="ended")] == [b.id]
    assert [t.id for t in c.trees(label=label, alive=False)] == [b.id]
    a.kill()
    other.kill()
    assert c.trees(label=label, alive=True) == []


def test_members_events_and_kill_report(server: Server) -> None:
    c = server.client()
    t = c.spawn(["sh", "-c", f"sleep 600 & echo $!; wait # {server.mark}"],
                stdout=treewarden.PIPE, env=server.body_env(), grace="300ms",
                first_signal="INT")
    assert t.stdout is not None
    child = int(t.stdout.readline())
    assert wait_until(lambda: child in [m["pid"] for m in t.members()], 10)
    # The shell's background child ignores SIGINT only from the moment it
    # sets that up, after its fork, before it execs sleep: a SIGINT sent
    # in between (seen as a member already, under load) ended it inside
    # the grace and nothing was force-killed. Kill once it is sleep.
    assert wait_until(lambda: cmdline(child).startswith(b"sleep"), 10)
    r = t.kill(grace=0.3)
    assert r.state == "ended"
    assert r.force_killed >= 1, r
    assert not alive(child)
    kinds = [e["kind"] for e in t.events()]
    assert kinds[0] == "tree.created"
    assert "kill.authorized" in kinds and "tree.ended" in kinds
    for e in t.events():
        assert {"seq", "kind", "data", "hash", "prev_hash"} <= set(e)
    sent = [e["data"]["signal"] for e in t.events() if e["kind"] == "signal.sent"]
    assert sent[0] == "SIGINT", sent
    # The followed stream ends with the tree.
    followed = list(t.events(follow=True))
    assert [e["seq"] for e in followed] == [e["seq"] for e in t.events()]


def test_errors_are_exceptions_by_code(server_factory) -> None:
    s = server_factory(["--max-grace", "2s"])
    c = s.client()
    with pytest.raises(treewarden.NotFound):
        c.tree(999999)
    with pytest.raises(treewarden.BadRequest) as e:
        c.spawn(["true"], grace=3, env=s.body_env())
    assert "--max-grace" in str(e.value) and e.value.status == 422
    with pytest.raises(treewarden.BadRequest):
        c.spawn(["true"], first_signal="KILL")
    with pytest.raises(treewarden.BadRequest):
        c.spawn(["tw-no-such-command-" + s.mark])
    with pytest.raises(treewarden.ConnectionFailed):
        treewarden.Client(socket=str(s.dir / "nothing.sock")).trees()
    assert issubclass(treewarden.DispatchClosed, treewarden.Error)
    assert issubclass(treewarden.TimeoutExpired, subprocess.TimeoutExpired)


def test_asyncio_client_has_the_same_methods(server: Server) -> None:
    async def main() -> None:
        c = server.async_client()
        label = f"async-{server.mark}"
        t = await c.spawn(["cat"], stdin=treewarden.PIPE, stdout=treewarden.PIPE, label=label,
                          env=server.body_env(), grace="200ms")
        assert t.stdin is not None and t.stdout is not None
        t.stdin.write(b"ping\n")
        await t.stdin.drain()
        assert await t.stdout.readline() == b"ping\n"
        assert [x.id for x in await c.trees(label=label, alive=True)] == [t.id]
        # Members are recorded by the service's scans (every 100 ms here).
        async def root_recorded() -> bool:
            return t.info["root_pid"] in [m["pid"] for m in await t.members()]

        assert await wait_until_async(root_recorded, 10), "root never recorded as a member"
        waiting = asyncio.ensure_future(t.wait(timeout=30))
        r = await t.kill()
        assert r.state == "ended"
        out = await waiting
        assert out.state == "ended" and out.returncode == -signal.SIGTERM
        assert "tree.ended" in [e["kind"] for e in await t.events()]
        assert [e["kind"] async for e in t.follow_events()][-1] in ("tree.ended", "tree.state")
        with pytest.raises(treewarden.NotFound):
            await c.tree(999999)
        t = await c.spawn(["sh", "-c", "echo one; echo two"], env=server.body_env())
        assert b"".join([x async for x in t.follow_logs()]) == b"one\ntwo\n"

    asyncio.run(main())


def test_run_over_the_wrapper_is_subprocess_run(server: Server) -> None:
    env = dict(server.env(), TW_PY_MARK=server.mark)
    os.environ["TREEWARDEN_BIN"] = server.bin
    r = treewarden.run(["sh", "-c", "echo hi; exit 4"], capture_output=True, env=env)
    assert (r.returncode, r.stdout, r.tree_id is not None) == (4, b"hi\n", True)
    assert r.state == "ended"
    # A command's own 124 is its status, not a timeout.
    assert treewarden.run(["sh", "-c", "exit 124"], timeout=30, env=env).returncode == 124
    # The timeout tears the whole tree down, then raises.
    t0 = time.monotonic()
    with pytest.raises(treewarden.TimeoutExpired) as e:
        treewarden.run(["sh", "-c", f"sleep 600 & sleep 600 # {server.mark}"], timeout=0.5,
                       grace="200ms", env=env)
    assert e.value.tree_id is not None
    assert time.monotonic() - t0 < 20
    assert wait_until(lambda: marked(server.mark) == [], 5), marked(server.mark)
    # treewarden's own failure raises; it is never returned as 125.
    with pytest.raises(treewarden.Error):
        treewarden.run(["true"], env=dict(env, TREEWARDEN_BOUNDARY="no-such-boundary"))


def test_sigterm_leaves_a_live_owners_tree_running_and_the_next_start_adopts_it(
        server: Server) -> None:
    from test_incidents import Owner, authorized_pids

    # A live owner (a separate process, as a harness is) with one tree.
    owner = Owner(server, "tool", 1)
    tree_id = owner.trees[0]["tree"]
    kept = owner.trees[0]["pids"]
    # A tree whose owner is gone by the shutdown is the service's to end.
    code = ("import sys, treewarden; c = treewarden.Client(socket=sys.argv[1]);"
            f"print(c.spawn(['sleep', '600'], grace='200ms', env={{'TW_PY_MARK': '{server.mark}'}})"
            ".info['root_pid'])")
    orphan_root = int(subprocess.run([sys.executable, "-c", code, server.socket],
                                     capture_output=True, check=True,
                                     env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
                      .stdout)
    rc = server.stop(signal.SIGTERM)
    assert rc == 0, server.log()
    assert all(alive(p) for p in kept), "the tree of a live owner was torn down at shutdown"
    assert not alive(orphan_root)
    log = server.log()
    assert "left running" in log and f"left=[{tree_id}]" in log, log
    server.start()
    c = server.client()
    assert c.tree(tree_id).state == "running"
    assert wait_until(lambda: "adopted a client tree" in server.log(), 10), server.log()
    # Adopted: the new instance watches the owner; its death ends the tree,
    # with the authorization naming what was force-killed.
    t = owner.kill()
    assert wait_until(lambda: not any(alive(p) for p in kept), 10)
    print(f"adopted tree gone {1000 * (time.monotonic() - t):.0f} ms after its owner's death")
    assert c.tree(tree_id).wait(timeout=10).state == "ended"
    assert set(kept) <= authorized_pids(c, tree_id)


def test_logs_follow_yields_output_as_it_comes_until_the_tree_ends(server: Server,
                                                                  tmp_path) -> None:
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    c = server.client()
    t = c.spawn(["sh", "-c", f"echo first; read x < '{fifo}'; echo second"],
                env=server.body_env())
    chunks = t.logs(follow=True)
    assert next(iter(chunks)) == b"first\n"
    with open(fifo, "w") as f:
        f.write("go\n")
    assert b"".join(chunks) == b"second\n"
    assert t.wait(timeout=10).returncode == 0


def test_package_installs_with_pip_and_is_typed(tmp_path) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(target), here], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and ("setuptools" in r.stderr and "No matching distribution" in r.stderr):
        pytest.skip("skipped: pip cannot fetch setuptools to build the package (offline)")
    assert r.returncode == 0, r.stderr
    assert (target / "treewarden" / "py.typed").exists()
    probe = subprocess.run([sys.executable, "-c", "import treewarden, json;"
                            "print(json.dumps([treewarden.__file__, treewarden.__version__]))"],
                           capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(target)), cwd=str(tmp_path))
    where, version = json.loads(probe.stdout)
    assert where.startswith(str(target)), probe.stderr
    assert version == treewarden.__version__


def test_durations_and_the_default_socket(monkeypatch, tmp_path) -> None:
    assert treewarden.duration(2) == "2s"
    assert treewarden.duration(0.3) == "300ms"
    assert treewarden.duration(datetime.timedelta(minutes=1)) == "60s"
    assert treewarden.duration("1500ms") == "1500ms"
    with pytest.raises(ValueError):
        treewarden.duration(-1)
    with pytest.raises(TypeError):
        treewarden.duration([1])  # type: ignore[arg-type]
    monkeypatch.setenv("TREEWARDEN_SOCKET", str(tmp_path / "a.sock"))
    assert treewarden.default_socket() == str(tmp_path / "a.sock")
    monkeypatch.delenv("TREEWARDEN_SOCKET")
    monkeypatch.setenv("TREEWARDEN_DATA_DIR", str(tmp_path / "data"))
    if not os.path.exists("/run/treewarden/api.sock"):
        assert treewarden.default_socket() == str(tmp_path / "data" / "api.sock")
    # The owner is this process: pid and start time as /proc has them.
    pid, start = treewarden.own_identity()
    assert pid == os.getpid()
    with open(f"/proc/{pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[19]) == start


def test_tcp_with_a_token(server: Server) -> None:
    addr = (server.dir / "ready-0").read_text().strip()
    token = (server.data / "api-token").read_text().strip()
    c = treewarden.Client(url=f"http://{addr}", token=token)
    t = c.spawn(["sh", "-c", "exit 7"], env=server.body_env(), label="tcp")
    assert t.wait(timeout=20).returncode == 7
    assert [x.id for x in c.trees(label="tcp")] == [t.id]
    with pytest.raises(treewarden.Unauthorized):
        treewarden.Client(url=f"http://{addr}").spawn(["true"])


def test_a_503_is_unavailable_with_or_without_a_code() -> None:
    # The serving loop's cap answer carries the code; a 503 from anything
    # in front of the service may not: both are "not now".
    from treewarden._errors import from_body
    capped = from_body(503, {"error": "you hold your cap of connections; retry later",
                             "code": "Unavailable"})
    assert isinstance(capped, treewarden.Unavailable) and capped.status == 503
    assert isinstance(from_body(503, "Service Unavailable"), treewarden.Unavailable)
    assert type(from_body(502, "Bad Gateway")) is treewarden.Error
