"""``stdio_client``: the MCP Python SDK's stdio transport, with the server
launched in treewarden's custody.

A drop-in for :func:`mcp.client.stdio.stdio_client`: the same parameters
(:class:`mcp.client.stdio.StdioServerParameters`, ``errlog``), the same
async context manager yielding ``(read_stream, write_stream)`` for
:class:`mcp.ClientSession`::

    from mcp import ClientSession, StdioServerParameters
    from treewarden.mcp import stdio_client

    params = StdioServerParameters(command="npx", args=["-y", "some-mcp-server"])
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()

What differs is who holds the server. The SDK starts it as its own child
and on close signals the child's process group, which misses whatever a
launcher (``npx``, ``uvx``, a shell) started elsewhere, and does nothing
at all when the host is SIGKILLed. Here the server is a tree in the
service's custody, owned by this process:

- it dies with its owner: the service tears it down within a second of
  this process's exit, however it exited;
- on close, the MCP specification's shutdown order, for the whole tree:
  stdin is closed, the server is given ``exit_wait`` seconds to exit, then
  the service's teardown does the rest (SIGTERM to every member, ``grace``
  seconds, a committed authorization, SIGKILL, verified empty).

The SDK is not a dependency of this package: this module imports it when
it is used (``pip install mcp``; tested with the version tests/setup pins).
asyncio only (the client's pipes are asyncio streams): under anyio, the
asyncio backend.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, AsyncIterator, Dict, Optional, TextIO, Tuple

from ._client import PIPE, AsyncClient, AsyncTree, Duration, _seconds
from ._errors import Error, NotFound, TimeoutExpired

#: How long a server has to exit by itself once its stdin is closed (the
#: SDK's ``PROCESS_TERMINATION_TIMEOUT``).
EXIT_WAIT = 2.0
#: The teardown's grace between SIGTERM and SIGKILL (the SDK's
#: ``FORCE_KILL_TIMEOUT``).
GRACE = 2.0
#: How long the writer has to flush accepted messages before stdin closes.
_FLUSH = 0.5


def _sdk() -> Tuple[Any, Any, Any]:
    """The SDK's pieces this transport uses: ``SessionMessage``, a line
    parser, and the default environment (the SDK 2 layout first, then 1)."""
    try:
        from mcp.client.stdio import get_default_environment
        from mcp.shared.message import SessionMessage
    except ImportError as e:  # pragma: no cover - said once, as one line
        raise ImportError("treewarden.mcp needs the MCP Python SDK: pip install mcp") from e
    try:
        import mcp_types

        adapter = mcp_types.jsonrpc_message_adapter

        def parse(line: str) -> Any:
            return adapter.validate_json(line, by_name=False)
    except ImportError:  # the SDK 1 layout
        from mcp.types import JSONRPCMessage

        def parse(line: str) -> Any:
            return JSONRPCMessage.model_validate_json(line)
    return SessionMessage, parse, get_default_environment


def _errlog_fd(errlog: Optional[TextIO]) -> Optional[int]:
    """``errlog`` as a descriptor the server can write to, or ``None``
    (then the server's stderr goes to the service's log of the tree)."""
    if errlog is None:
        return None
    try:
        errlog.flush()
        return errlog.fileno()
    except (AttributeError, OSError, ValueError):
        return None


@contextlib.asynccontextmanager
async def stdio_client(server: Any, errlog: Optional[TextIO] = sys.stderr, *,
                       client: Optional[AsyncClient] = None, socket: Optional[str] = None,
                       label: Optional[str] = None, exit_wait: Duration = EXIT_WAIT,
                       grace: Duration = GRACE,
                       limits: Optional[Dict[str, Any]] = None) -> AsyncIterator[Tuple[Any, Any]]:
    """Starts ``server`` (``StdioServerParameters``) in the service's
    custody and yields ``(read_stream, write_stream)`` as the SDK's
    ``stdio_client`` does.

    ``client``: the :class:`~treewarden.AsyncClient` to use (else one on
    ``socket``, or the default socket). ``label``: the tree's label
    (default ``mcp:COMMAND``). ``exit_wait``: how long the server has to
    exit after its stdin closes; ``grace``: the teardown's grace after
    SIGTERM. ``errlog``: the server's stderr, where it has a descriptor
    (else the service keeps it as the tree's log).

    Raises what :meth:`AsyncClient.spawn` raises (e.g. ``BadRequest`` for
    a command that is not found)."""
    import anyio

    session_message, parse, default_env = _sdk()
    encoding = getattr(server, "encoding", "utf-8")
    errors = getattr(server, "encoding_error_handler", "strict")
    tw = client or AsyncClient(socket=socket)
    env = {**default_env(), **(server.env or {})}
    cwd = getattr(server, "cwd", None)
    err = _errlog_fd(errlog)
    tree = await tw.spawn([server.command, *server.args], label=label or f"mcp:{server.command}",
                          env=env, cwd=cwd, grace=grace, limits=limits, stdin=PIPE,
                          stdout=PIPE, stderr=err)
    assert tree.stdin is not None and tree.stdout is not None, "spawned with stdin and stdout piped"
    stdin, stdout = tree.stdin, tree.stdout

    read_writer, read_stream = anyio.create_memory_object_stream(0)
    write_stream, write_reader = anyio.create_memory_object_stream(0)
    writer_done = anyio.Event()

    async def stdout_reader() -> None:
        buffer = b""
        async with read_writer:
            try:
                while True:
                    chunk = await stdout.read(65536)
                    if not chunk:
                        return
                    lines = (buffer + chunk).split(b"\n")
                    buffer = lines.pop()
                    for raw in lines:
                        try:
                            item: Any = session_message(parse(raw.decode(encoding, errors)))
                        except ValueError as e:  # the SDK hands a bad line to the session
                            item = e
                        try:
                            await read_writer.send(item)
                        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                            return
            except (anyio.ClosedResourceError, ConnectionError, OSError):
                return

    async def stdin_writer() -> None:
        try:
            async with write_reader:
                async for message in write_reader:
                    json = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    stdin.write((json + "\n").encode(encoding, errors))
                    await stdin.drain()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError, OSError):
            # The server stopped reading: the session sees the end of its
            # stream rather than a request hanging.
            await read_writer.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(_FLUSH):
            await writer_done.wait()
        await _stop(tree, exit_wait, grace)
        for s in (read_stream, write_stream, read_writer, write_reader):
            await s.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            # Shielded, and each step bounded: a cancelled caller neither
            # leaks the server nor hangs on it.
            with anyio.CancelScope(shield=True):
                await shutdown()
            tg.cancel_scope.cancel()


async def _stop(tree: AsyncTree, exit_wait: Duration, grace: Duration) -> None:
    """The specification's shutdown order, for the whole tree: stdin
    closed, ``exit_wait`` for the server to exit by itself (its launcher's
    exit ends the tree, and the service ends what it left), then the
    service's teardown: SIGTERM, ``grace``, authorization, SIGKILL."""
    import anyio

    if tree.stdin is not None:
        tree.stdin.close()
        with anyio.move_on_after(1), contextlib.suppress(ConnectionError, OSError):
            await tree.stdin.wait_closed()
    try:
        await tree.wait(timeout=_seconds(exit_wait))
    except TimeoutExpired:
        try:
            await tree.kill(grace=grace)
        except NotFound:
            pass
    except Error:
        # The service could not answer the wait: the teardown is still asked
        # for, so nothing is left to the owner's exit alone.
        with contextlib.suppress(Error):
            await tree.kill(grace=grace)
    finally:
        tree._close_pipes()


__all__ = ["stdio_client", "EXIT_WAIT", "GRACE"]
