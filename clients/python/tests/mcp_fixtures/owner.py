"""A host that holds an MCP server and is then SIGKILLed (test_mcp.py).

    owner.py SOCKET|plain PIDFILE MARK

It starts the fixture server through the shim (detached, lingering: the
hardest shape), with ``treewarden.mcp.stdio_client`` on SOCKET or the SDK's
own ``stdio_client`` (``plain``), initializes, calls a tool, prints
``ready`` and waits for its kill.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters

HERE = Path(__file__).resolve().parent


async def main() -> None:
    where, pidfile, mark = sys.argv[1], sys.argv[2], sys.argv[3]
    params = StdioServerParameters(
        command=sys.executable,
        args=[str(HERE / "shim.py"), pidfile, "--detach", "--", sys.executable,
              str(HERE / "server.py"), pidfile, "--linger"],
        env={"TW_PY_MARK": mark})
    if where == "plain":
        from mcp.client.stdio import stdio_client

        opened = stdio_client(params)
    else:
        from treewarden.mcp import stdio_client as ours

        opened = ours(params, socket=where, label=f"{mark}-owner")
    async with opened as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            await session.call_tool("add", {"a": 1, "b": 1})
            print("ready", flush=True)
            await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main)
