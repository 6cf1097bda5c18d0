"""The seeds' four incidents, as a harness would meet them, with treewarden.

Each was measured first with ``Popen(start_new_session=True)`` + ``killpg``
(issue 25): there, processes survive at ppid 1. Here each test asserts,
from the workload's own word (the pids it printed, the marker in its argv
and environment, read from ``/proc``), that nothing of the trees survives
within a bound, and that the ledger holds the kill authorization naming
exactly what was force-killed, committed before the SIGKILL.

1. a hub SIGKILLs a member (the owner) after its SIGTERM, with three trees
   (the hub's 3 s are the owner's acknowledgement of the SIGTERM here: a
   condition, not a sleep);
2. sixteen stdin-holding ACP delegates of an owner that is SIGKILLed;
3. a launcher that exits during the grace, leaving a TERM-ignoring child;
4. a stdio MCP server over pipes whose owner crashes three times.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Set

import treewarden
from conftest import Server, alive, marked, wait_until

OWNER = str(Path(__file__).resolve().parent / "owner.py")
#: Within this long (scaled) of the owner's death, nothing of its trees lives:
#: its death is seen at once (a pidfd), then a 300 ms grace and the kill.
BOUND = 10.0


class Owner:
    """The owner process: started, read until ``ready``, then killed."""

    def __init__(self, server: Server, kind: str, count: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.p = subprocess.Popen([sys.executable, OWNER, server.socket, server.mark, kind,
                                   str(count)], stdout=subprocess.PIPE, env=env,
                                  start_new_session=True)
        self.trees: List[Dict[str, Any]] = []
        assert self.p.stdout is not None
        for line in self.p.stdout:
            text = line.decode().strip()
            if text == "ready":
                break
            self.trees.append(json.loads(text))
        assert len(self.trees) == count, f"the owner started {len(self.trees)} of {count} trees"

    @property
    def pids(self) -> Set[int]:
        return {p for t in self.trees for p in t["pids"]}

    def term(self) -> None:
        """SIGTERM, and its acknowledgement (the owner ignores it)."""
        assert self.p.stdout is not None
        self.p.send_signal(signal.SIGTERM)
        assert self.p.stdout.readline().strip() == b"term"

    def kill(self) -> float:
        """SIGKILL; the moment it was reaped."""
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=10)
        return time.monotonic()


def authorized_pids(client: treewarden.Client, tree_id: int) -> Set[int]:
    return {i["pid"] for a in client.tree(tree_id).authorizations()
            for t in a["targets"] for i in t["identities"]}


def sigkilled(client: treewarden.Client, tree_id: int) -> List[Dict[str, Any]]:
    d = client.tree(tree_id).detail()
    return [s for s in d["signals"] if s["signal"] == "SIGKILL"]


def assert_settled(server: Server, owner: Owner, since: float, what: str) -> float:
    """Nothing of the owner's trees lives within BOUND of ``since``; every
    tree ended; the workload's pids are in the authorization its SIGKILL
    names. Returns how long the last survivor took (ms)."""
    pids = owner.pids
    assert len(pids) == 2 * len(owner.trees), owner.trees
    ok = wait_until(lambda: not any(alive(p) for p in pids), BOUND)
    took = (time.monotonic() - since) * 1000
    assert ok, f"{what}: survivors {sorted(p for p in pids if alive(p))} after {BOUND}s"
    c = server.client()
    for t in owner.trees:
        tree = c.tree(t["tree"])
        assert tree.wait(timeout=BOUND).state == "ended", (what, tree.info)
        assert tree.info["owner"]["pid"] == owner.p.pid
        named = authorized_pids(c, t["tree"])
        assert set(t["pids"]) <= named, f"{what}: tree {t['tree']}: {t['pids']} not in {named}"
        kills = sigkilled(c, t["tree"])
        assert kills and all(k["authorization"] is not None for k in kills), kills
    assert wait_until(lambda: marked(server.mark) == [], BOUND), marked(server.mark)
    print(f"{what}: {len(pids)} processes of {len(owner.trees)} trees gone "
          f"{took:.0f} ms after the owner's death")
    return took


def test_1_a_member_sigkilled_after_its_sigterm_leaves_nothing_of_its_three_trees(
        server: Server) -> None:
    owner = Owner(server, "tool", 3)
    assert all(alive(p) for p in owner.pids)
    owner.term()
    # The hub's SIGTERM ended nothing (the owner ignores it; its tools too).
    assert all(alive(p) for p in owner.pids)
    t = owner.kill()
    assert_settled(server, owner, t, "incident 1")


def test_2_sixteen_stdin_holding_delegates_of_a_sigkilled_owner_are_all_ended(
        server: Server) -> None:
    owner = Owner(server, "acp", 16)
    assert len(owner.pids) == 32
    t = owner.kill()
    took = assert_settled(server, owner, t, "incident 2")
    assert took < BOUND * 1000


def test_3_a_launcher_that_exits_during_the_grace_leaves_no_term_ignoring_child(
        server: Server) -> None:
    c = server.client()
    # The launcher exits at SIGTERM (during the grace); its child ignores
    # it. Each says its pid once its disposition is set.
    tree = c.spawn(["sh", "-c", "sh -c 'trap \"\" TERM; echo child $$; exec sleep 600' & "
                               f"trap 'exit 0' TERM; echo launcher $$; wait # {server.mark}"],
                   stdout=treewarden.PIPE, env=server.body_env(), grace="1s",
                   label=f"{server.mark}-launcher")
    assert tree.stdout is not None
    said = dict(tree.stdout.readline().decode().split() for _ in range(2))
    launcher, child = int(said["launcher"]), int(said["child"])
    r = tree.kill()
    assert r.state == "ended" and r.force_killed == 1, r
    assert not alive(launcher) and not alive(child)
    # The launcher's own exit (status 0, at its SIGTERM) is recorded, and
    # the authorization names the child it left, not the launcher.
    d = tree.detail()
    assert d["tree"]["exit"]["code"] == 0, d["tree"]
    named = authorized_pids(c, tree.id)
    assert child in named and launcher not in named, named
    assert marked(server.mark) == []


def test_4_a_stdio_server_whose_owner_crashes_three_times_never_piles_up(
        server: Server) -> None:
    seen: Set[int] = set()
    for crash in range(3):
        owner = Owner(server, "mcp", 1)
        assert owner.trees[0]["answer"] == "re: ping", owner.trees
        assert not (owner.pids & seen)
        seen |= owner.pids
        # Before the crash only this server lives: nothing of the earlier ones.
        assert sorted(marked(server.mark)) != [] and not any(
            alive(p) for p in seen - owner.pids)
        t = owner.kill()
        assert_settled(server, owner, t, f"incident 4, crash {crash + 1}")
        assert marked(server.mark) == []
