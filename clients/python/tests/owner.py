"""An owner as the seeds' harnesses are: a process that starts trees
through the client and is then killed. Run by test_incidents.py.

    owner.py SOCKET MARK KIND COUNT

It spawns COUNT trees of KIND, prints one JSON line per tree with the pids
the *workload* printed (never the product's), then ``ready``, and waits.
On SIGTERM it prints ``term`` and goes on waiting (a hub member that does
not clean up), so only its SIGKILL ends it.
"""

from __future__ import annotations

import json
import signal
import sys

import treewarden

# Each workload prints its own pids on its first line and ignores SIGTERM,
# so only a forced kill, with its authorization, ends it.
WORKLOADS = {
    # A hub member's tool: a shell with a child that outlives it.
    "tool": "trap '' TERM; sleep 600 & echo $$ $!; wait",
    # An ACP delegate: it holds its stdin and keeps a child running past
    # end-of-file (codex-acp's helpers).
    "acp": "trap '' TERM HUP; sleep 600 & echo $$ $!; cat >/dev/null; wait",
    # A stdio MCP server: it answers over its pipes and keeps its child
    # past end-of-file.
    "mcp": "trap '' TERM HUP PIPE; sleep 600 & echo $$ $!; while read line; do echo \"re: $line\"; done; wait",
}


def main() -> None:
    sock, mark, kind, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    signal.signal(signal.SIGTERM, lambda *_: print("term", flush=True))
    client = treewarden.Client(socket=sock)
    trees = []
    for i in range(count):
        t = client.spawn(["sh", "-c", WORKLOADS[kind] + f" # {mark}"], label=f"{mark}-{kind}",
                         env={"TW_PY_MARK": mark}, grace="300ms", stdin=treewarden.PIPE,
                         stdout=treewarden.PIPE)
        trees.append(t)
    for t in trees:
        assert t.stdout is not None
        pids = [int(p) for p in t.stdout.readline().split()]
        if kind == "mcp":
            assert t.stdin is not None
            t.stdin.write(b"ping\n")
            t.stdin.flush()
            answer = t.stdout.readline().decode().strip()
        else:
            answer = None
        print(json.dumps({"tree": t.id, "pids": pids, "answer": answer}), flush=True)
    print("ready", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
