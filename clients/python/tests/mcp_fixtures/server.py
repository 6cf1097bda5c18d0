"""A real MCP server, written with the MCP Python SDK (``MCPServer``, the
SDK's FastMCP), for the transport tests.

    server.py PIDFILE [--linger]

It writes its pid to PIDFILE (the tests' only word on which processes are
the server's) and serves ``add`` and ``pids`` over stdio. ``--linger``:
after its stdin ends it stays up (as servers with timers or workers do,
e.g. server-everything), so only a signal ends it.
"""

from __future__ import annotations

import os
import sys
import threading

from mcp.server.mcpserver import MCPServer

server = MCPServer("treewarden-fixture")


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def pids() -> str:
    """The server's pid and its parent's."""
    return f"{os.getpid()} {os.getppid()}"


def main() -> None:
    with open(sys.argv[1], "a") as f:
        f.write(f"server {os.getpid()}\n")
    server.run("stdio")
    if "--linger" in sys.argv[2:]:
        threading.Event().wait()


if __name__ == "__main__":
    main()
