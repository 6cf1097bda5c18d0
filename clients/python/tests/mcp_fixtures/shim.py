"""An ``npx``/``uvx``-style launcher: it *spawns* the real server as its
child and waits for it, so the server is a grandchild of whoever started
the shim (the shape of modelcontextprotocol/typescript-sdk#2023).

    shim.py PIDFILE [--detach] -- ARGV...

It writes its own pid to PIDFILE, then runs ARGV with its stdio. On
SIGTERM it exits without passing the signal on (as npx does). ``--detach``
starts the server in a session of its own (as launchers that spawn
``detached`` do), so a signal to the shim's process group misses it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def main() -> None:
    sep = sys.argv.index("--")
    pidfile, flags, argv = sys.argv[1], sys.argv[2:sep], sys.argv[sep + 1:]
    with open(pidfile, "a") as f:
        f.write(f"shim {os.getpid()}\n")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    child = subprocess.Popen(argv, start_new_session="--detach" in flags)
    sys.exit(child.wait())


if __name__ == "__main__":
    main()
