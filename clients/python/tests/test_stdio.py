"""Streamed stdio over loopback TCP (where descriptors cannot be passed):
the same ``PIPE``s as on the Unix socket, relayed over the spawn's own
connection; a lost connection closes the tree's stdin and nothing else."""

from __future__ import annotations

import asyncio
import json
import os

import treewarden

from conftest import Server, alive, wait_until


def _tcp(server: Server) -> treewarden.Client:
    addr = (server.dir / "ready-0").read_text().strip()
    token = (server.data / "api-token").read_text().strip()
    return treewarden.Client(url=f"http://{addr}", token=token)


def test_pipes_over_tcp_stdin_stdout_stderr_and_the_exit(server: Server) -> None:
    c = _tcp(server)
    t = c.spawn(["sh", "-c", "cat; echo oops >&2; exit 5"], env=server.body_env(),
                stdin=treewarden.PIPE, stdout=treewarden.PIPE, stderr=treewarden.PIPE)
    assert t.stdin and t.stdout and t.stderr and t.relay
    t.stdin.write(b"hello over tcp\n")
    t.stdin.close()
    assert t.stdout.read() == b"hello over tcp\n"
    assert t.stderr.read() == b"oops\n"
    assert t.wait(timeout=20).returncode == 5
    assert t.relay.done.wait(20)
    assert t.relay.exit is not None and t.relay.exit["state"] == "ended"


def test_a_hundred_json_rpc_round_trips_over_tcp(server: Server) -> None:
    c = _tcp(server)
    echo = "while IFS= read -r line; do printf '%s\\n' \"$line\"; done"
    t = c.spawn(["sh", "-c", echo], env=server.body_env(), stdin=treewarden.PIPE,
                stdout=treewarden.PIPE)
    assert t.stdin and t.stdout
    for i in range(1, 101):
        t.stdin.write(json.dumps({"jsonrpc": "2.0", "id": i, "method": "ping"}).encode() + b"\n")
        t.stdin.flush()
        assert json.loads(t.stdout.readline())["id"] == i
    t.stdin.close()
    assert t.wait(timeout=20).returncode == 0


def test_a_lost_connection_closes_stdin_only(server: Server) -> None:
    c = _tcp(server)
    flag = server.dir / "stdin-closed"
    t = c.spawn(["sh", "-c", f"cat >/dev/null; touch {flag}; exec sleep 600"],
                env=server.body_env(), grace="200ms", stdin=treewarden.PIPE,
                stdout=treewarden.PIPE)
    assert t.relay
    pid = int(t.refresh()["root_pid"])
    t.relay.close()
    assert wait_until(flag.exists, 10), "the tree never read its stdin's end"
    assert t.refresh()["state"] == "running" and alive(pid)
    t.kill()
    assert wait_until(lambda: not alive(pid), 10)
    if t.stdin:
        try:
            t.stdin.close()
        except OSError:
            pass
    assert os.path.exists(flag)


def test_the_async_client_streams_pipes_over_tcp_too(server: Server) -> None:
    addr = (server.dir / "ready-0").read_text().strip()
    token = (server.data / "api-token").read_text().strip()

    async def main() -> None:
        c = treewarden.AsyncClient(url=f"http://{addr}", token=token)
        t = await c.spawn(["cat"], env=server.body_env(), stdin=treewarden.PIPE,
                          stdout=treewarden.PIPE)
        assert t.stdin and t.stdout and t.relay
        lines = [f"line {i} over tcp\n".encode() for i in range(20)]
        for line in lines:
            t.stdin.write(line)
            await t.stdin.drain()
            assert await asyncio.wait_for(t.stdout.readline(), 20) == line
        t.stdin.close()
        assert await asyncio.wait_for(t.stdout.read(), 20) == b""
        outcome = await t.wait(timeout=20)
        assert outcome.returncode == 0
        await asyncio.wait_for(t.relay.done.wait(), 20)
        assert t.relay.exit is not None and t.relay.exit["state"] == "ended"
        d = await t.detail()
        assert d["tree"]["state"] == "ended"
        assert "tree.ended" in [e["kind"] for e in d["events"]]

    asyncio.run(main())
