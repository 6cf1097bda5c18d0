"""``treewarden.mcp.stdio_client`` with the real MCP Python SDK (its
``ClientSession``) and a real MCP server (the SDK's own ``MCPServer``, in
mcp_fixtures/server.py), started through an ``npx``/``uvx``-style shim that
spawns it as a child: the server is a grandchild of the tree's root. Which
processes are the server's is what the shim and the server wrote to their
pid file, never the product's word; each check polls with a bound.

The SDK's own ``stdio_client`` runs beside ours on the same shapes, to show
what ours changes: a launcher that starts the server outside its process
group (modelcontextprotocol/typescript-sdk#2023's shape: close signals only
what it started) and a host SIGKILLed mid-session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from conftest import Server, alive, wait_until

try:
    import anyio
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters
    from mcp.client.stdio import stdio_client as sdk_stdio_client
except ImportError:  # tests/setup installs it: a missing SDK is said, or fails a required lane
    if os.environ.get("TREEWARDEN_LANE_REQUIRED") == "1" or os.environ.get("CI"):
        raise
    pytest.skip("skipped: the MCP Python SDK is not installed (tests/setup installs mcp)",
                allow_module_level=True)

import treewarden
from treewarden.mcp import stdio_client

FIXTURES = Path(__file__).resolve().parent / "mcp_fixtures"


def params(pidfile: Path, mark: str, *, detach: bool, linger: bool) -> StdioServerParameters:
    shim = [str(FIXTURES / "shim.py"), str(pidfile)] + (["--detach"] if detach else [])
    srv = [str(FIXTURES / "server.py"), str(pidfile)] + (["--linger"] if linger else [])
    return StdioServerParameters(command=sys.executable, args=[*shim, "--", sys.executable, *srv],
                                 env={"TW_PY_MARK": mark})


def pids(pidfile: Path) -> Dict[str, int]:
    """The shim's and the server's pids, as they wrote them."""
    out: Dict[str, int] = {}
    if pidfile.exists():
        for line in pidfile.read_text().splitlines():
            who, pid = line.split()
            out[who] = int(pid)
    return out


def live(pidfile: Path) -> List[int]:
    return [p for p in pids(pidfile).values() if alive(p)]


def end(pidfile: Path) -> None:
    """Ends what a plain client left (by pid), so the test leaves nothing."""
    for pid in live(pidfile):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert wait_until(lambda: not live(pidfile), 10)


async def session_round(opened) -> Dict[str, object]:  # type: ignore[no-untyped-def]
    """initialize, tools/list and two tool calls; the close is timed."""
    async with opened as (read, write):
        async with ClientSession(read, write) as session:
            init = await session.initialize()
            tools = sorted(t.name for t in (await session.list_tools()).tools)
            added = await session.call_tool("add", {"a": 2, "b": 3})
            ids = await session.call_tool("pids", {})
        started = time.monotonic()
    return {"init": init, "tools": tools, "added": added.content[0].text,  # type: ignore[union-attr]
            "pids": ids.content[0].text, "close": time.monotonic() - started}  # type: ignore[union-attr]


def test_a_session_through_a_launcher_and_close_in_the_spec_order(server: Server,
                                                                   tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    label = f"{server.mark}-polite"
    got = anyio.run(session_round, stdio_client(params(pidfile, server.mark, detach=False,
                                                       linger=False),
                                                socket=server.socket, label=label))
    assert got["init"].server_info.name == "treewarden-fixture"  # type: ignore[attr-defined]
    assert got["tools"] == ["add", "pids"]
    assert got["added"] == "5"
    who = pids(pidfile)
    # The server is the shim's child: a grandchild of the tree's root.
    assert got["pids"] == f"{who['server']} {who['shim']}"
    # Its stdin closed, the server exited by itself, well inside the wait:
    # no signal was needed, and nothing is left.
    assert got["close"] < 2.0, got["close"]
    print(f"measured: polite close {got['close'] * 1000:.0f} ms")
    assert wait_until(lambda: not live(pidfile), 5), live(pidfile)
    [tree] = server.client().trees(label=label)
    outcome = tree.wait(timeout=10)
    assert (outcome.kind, outcome.returncode, outcome.forced) == ("exited", 0, False)


def test_close_ends_a_server_its_launcher_detached_where_the_sdk_leaves_it(
        server: Server, tmp_path: Path) -> None:
    # The SDK's own stdio_client signals the shim's process group: the
    # server, started in a session of its own and alive past its stdin's
    # end, outlives the close (typescript-sdk#2023's shape).
    plain = tmp_path / "plain"
    got = anyio.run(session_round, sdk_stdio_client(params(plain, server.mark, detach=True,
                                                           linger=True)))
    assert got["added"] == "5"
    try:
        assert not alive(pids(plain)["shim"]) or wait_until(lambda: not alive(pids(plain)["shim"]), 5)
        assert alive(pids(plain)["server"]), "the SDK's close was to leave the detached server"
    finally:
        end(plain)

    ours = tmp_path / "ours"
    label = f"{server.mark}-detached"
    got = anyio.run(session_round, stdio_client(params(ours, server.mark, detach=True, linger=True),
                                                socket=server.socket, label=label, exit_wait=0.5,
                                                grace=1))
    assert got["added"] == "5"
    print(f"measured: lingering close (exit_wait 0.5 s) {got['close'] * 1000:.0f} ms")
    # Closed stdin, 0.5 s, then the service's teardown of the whole tree.
    assert not live(ours), live(ours)
    [tree] = server.client().trees(label=label)
    outcome = tree.wait(timeout=10)
    assert outcome.kind == "killed", outcome


@pytest.mark.parametrize("which", ["treewarden", "sdk"])
def test_owner_sigkilled_leaves_no_process_of_the_server(server: Server, tmp_path: Path,
                                                         which: str) -> None:
    pidfile = tmp_path / "pids"
    where = server.socket if which == "treewarden" else "plain"
    env = dict(os.environ, PYTHONPATH=str(Path(treewarden.__file__).resolve().parent.parent))
    owner = subprocess.Popen([sys.executable, str(FIXTURES / "owner.py"), where, str(pidfile),
                              server.mark], stdout=subprocess.PIPE, env=env)
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline() == b"ready\n"
        assert set(pids(pidfile)) == {"shim", "server"}
        owner.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        owner.wait(timeout=10)
        gone = wait_until(lambda: not live(pidfile), 5)
        if which == "treewarden":
            assert gone, f"left running: {live(pidfile)}"
            print(f"measured: owner SIGKILLed -> nothing left in {(time.monotonic() - killed) * 1000:.0f} ms")
        else:
            # The SDK had no chance to clean up: the detached server lives on.
            assert not gone and alive(pids(pidfile)["server"])
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        end(pidfile)


def test_a_cancelled_caller_leaves_nothing(server: Server, tmp_path: Path) -> None:
    # A harness cancels a tool call's task mid-session: the shutdown runs
    # shielded to its end before the cancellation goes on.
    pidfile = tmp_path / "pids"

    async def cancelled() -> bool:
        with anyio.CancelScope() as scope:
            async with stdio_client(params(pidfile, server.mark, detach=True, linger=True),
                                    socket=server.socket, exit_wait=0.3, grace=1) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    scope.cancel()
                    await anyio.sleep_forever()
        return scope.cancelled_caught

    assert anyio.run(cancelled)
    assert set(pids(pidfile)) == {"shim", "server"}
    assert not live(pidfile), live(pidfile)
