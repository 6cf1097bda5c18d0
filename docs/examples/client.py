#!/usr/bin/env python3
"""A treewarden API client, standard library only (docs/INTEGRATION.md).

Spawns a tree owned by this process (owner_pid = our pid, so the service
tears the tree down within a second if we die), lists it, kills it, and
fetches its audit trail.

    TREEWARDEN_URL=http://127.0.0.1:7878 \
    TREEWARDEN_TOKEN_FILE=/var/lib/treewarden/api-token \
    python3 docs/examples/client.py

The last line printed is a JSON summary. The test
`docs::the_python_client_example_runs_against_a_real_server` runs this file.
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request

BASE = os.environ.get("TREEWARDEN_URL", "http://127.0.0.1:7878").rstrip("/")
TOKEN_FILE = os.environ.get(
    "TREEWARDEN_TOKEN_FILE",
    os.path.join(os.environ.get("TREEWARDEN_DATA_DIR", "/var/lib/treewarden"), "api-token"),
)
with open(TOKEN_FILE) as f:
    TOKEN = f.read().strip()


def call(method, path, body=None):
    """One request; returns (status, parsed JSON or text). Every request
    carries the token: reads over TCP need one too (unless serve --open-reads)."""
    data = None
    headers = {"Authorization": "Bearer " + TOKEN}
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(BASE + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        # Every error is JSON: {"error": "...", "tree": id-or-null}
        status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
    text = raw.decode()
    return status, (json.loads(text) if ctype.startswith("application/json") else text)


def start_ticks(pid):
    """Field 22 of /proc/PID/stat: lets the service verify the owner is us, not a recycled pid."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def main():
    me = os.getpid()
    # 1. Spawn. 201 with the tree row; 503 while dispatch is closed.
    status, tree = call("POST", "/api/trees", {
        "argv": ["sh", "-c", "sleep 300 & sleep 300 & wait"],
        "label": "python-example",
        "grace": "2s",
        "owner_pid": me,
        "owner_start_ticks": start_ticks(me),
    })
    if status != 201:
        sys.exit(f"spawn refused ({status}): {tree}")
    tid = tree["id"]
    print(f"spawned tree {tid}, owned by pid {me}")

    # 2. List live trees; ours is there. Wait (bounded) for its members.
    status, trees = call("GET", "/api/trees")
    assert status == 200 and any(t["id"] == tid for t in trees), trees
    deadline = time.monotonic() + 20
    while True:
        status, detail = call("GET", f"/api/trees/{tid}")
        if len(detail["members"]) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    pids = sorted(m["pid"] for m in detail["members"])
    print(f"tree {tid} is {detail['tree']['state']} with members {pids}")

    # 3. Kill: TERM, grace, committed authorization, KILL, verification.
    status, report = call("POST", f"/api/trees/{tid}/kill?grace=1s")
    if status != 200:
        sys.exit(f"kill failed ({status}): {report}")
    print(f"tree {tid} {report['state']} in {report['elapsed_ms']} ms")

    # 4. The audit trail of this tree (one hash-chained JSON event per line).
    status, text = call("GET", f"/api/export?format=ndjson&tree={tid}")
    events = [json.loads(line) for line in text.splitlines() if line]
    print(f"{len(events)} events: " + ", ".join(sorted({e['kind'] for e in events})))

    print(json.dumps({"tree": tid, "state": report["state"],
                      "member_pids": pids, "events": len(events)}))
    return 0 if report["state"] == "ended" else 1


if __name__ == "__main__":
    sys.exit(main())
