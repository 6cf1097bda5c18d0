"""A real ``treewarden serve`` on a real Unix socket in a temp dir, for each
test that asks for one.

The binary is ``TREEWARDEN_BIN`` or the repository's ``target/debug/
treewarden`` (``cargo build``); without it every test here is skipped, and
says so. Each server gets its own data dir and, as root with a writable
cgroup v2 hierarchy, its own cgroup root (else the session boundary). Every
tree a test starts carries the test's marker in its environment and argv,
so what survives is found from ``/proc`` (not from the product's word) and
ended by pid at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable, Dict, Iterator, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent.parent
try:
    # The installed package (tests/run installs it with pip first) ...
    import treewarden  # noqa: E402
except ImportError:
    # ... or the source next to these tests.
    sys.path.insert(0, str(HERE.parent))
    import treewarden  # noqa: E402

_SEQ = itertools.count()


def scale() -> float:
    """Poll bounds are scaled by TREEWARDEN_TEST_POLL_SCALE (slow hosts)."""
    try:
        return max(1.0, float(os.environ.get("TREEWARDEN_TEST_POLL_SCALE", "1")))
    except ValueError:
        return 1.0


def wait_until(cond: Callable[[], bool], limit: float, step: float = 0.005) -> bool:
    """Polls ``cond`` until it holds or ``limit`` (scaled) seconds pass."""
    deadline = time.monotonic() + limit * scale()
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)  # the poll interval of wait_until, not a wait for a condition


async def wait_until_async(
    cond: Callable[[], Awaitable[bool]], limit: float, step: float = 0.01
) -> bool:
    """``wait_until`` for a coroutine condition, without blocking the loop."""
    deadline = time.monotonic() + limit * scale()
    while True:
        if await cond():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(step)  # the poll interval, not a wait for a condition


def binary() -> Optional[str]:
    b = os.environ.get("TREEWARDEN_BIN") or str(REPO / "target" / "debug" / "treewarden")
    return b if os.access(b, os.X_OK) else None


def alive(pid: int) -> bool:
    """Exists and is not a zombie (by /proc, not by the product)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")


def marked(mark: str) -> List[int]:
    """Live processes whose environment or argv carries ``mark``."""
    needle = mark.encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        pid = int(d)
        hit = False
        for what in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    if needle in f.read():
                        hit = True
                        break
            except OSError:
                pass
        if hit and alive(pid) and pid != os.getpid():
            out.append(pid)
    return out


def _own_cgroup() -> Optional[Path]:
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
        with open("/proc/self/cgroup") as f:
            rel = next(line[3:] for line in f.read().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    for line in mounts:
        left, _, right = line.partition(" - ")
        if right.startswith("cgroup2 "):
            d = Path(left.split()[4]) / rel.lstrip("/")
            return d if (d / "cgroup.procs").exists() else None
    return None


class Server:
    """One ``treewarden serve`` with its own data dir and socket."""

    def __init__(self, tmp: Path, extra: Optional[List[str]] = None) -> None:
        self.bin = binary() or ""
        self.dir = tmp
        self.data = tmp / "data"
        self.socket = str(tmp / "api.sock")
        n = next(_SEQ)
        self.mark = f"tw-pytest-{os.getpid()}-{n}"
        self.extra = extra or []
        self.cgroup_root: Optional[Path] = None
        own = _own_cgroup() if os.geteuid() == 0 else None
        if own is not None:
            root = own / f"tw-pytest-root-{os.getpid()}-{n}"
            try:
                root.mkdir()
                self.cgroup_root = root
            except OSError:
                self.cgroup_root = None
        self.proc: Optional[subprocess.Popen] = None  # type: ignore[type-arg]
        self.starts = 0
        self.start()

    @property
    def boundary(self) -> str:
        return "cgroup" if self.cgroup_root else "session"

    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env["TREEWARDEN_DATA_DIR"] = str(self.data)
        env["TREEWARDEN_LOG"] = "info"
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        env["TREEWARDEN_BOUNDARY"] = self.boundary
        if self.cgroup_root:
            env["TREEWARDEN_CGROUP_ROOT"] = str(self.cgroup_root)
        else:
            env.pop("TREEWARDEN_CGROUP_ROOT", None)
        return env

    def start(self) -> None:
        ready = self.dir / f"ready-{self.starts}"
        self.stderr_path = self.dir / f"serve-{self.starts}.stderr"
        self.starts += 1
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [self.bin, "serve", "--listen", "127.0.0.1:0", "--socket", self.socket,
                 "--ready-file", str(ready), "--scan-interval", "100ms", *self.extra],
                cwd=self.dir, env=self.env(), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        if not wait_until(lambda: ready.exists(), 30):
            raise RuntimeError(f"serve did not come up: {self.log()}")

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.dir.glob("serve-*.stderr")))

    def client(self) -> treewarden.Client:
        return treewarden.Client(socket=self.socket)

    def async_client(self) -> treewarden.AsyncClient:
        return treewarden.AsyncClient(socket=self.socket)

    def body_env(self) -> Dict[str, str]:
        return {"TW_PY_MARK": self.mark}

    def stop(self, sig: int = signal.SIGTERM, limit: float = 40) -> Optional[int]:
        """Signals the service (by its pid) and waits for its exit."""
        p = self.proc
        if p is None:
            return None
        p.send_signal(sig)
        try:
            rc = p.wait(timeout=limit * scale())
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        self.proc = None
        return rc

    def run_cli(self, *args: str) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        return subprocess.run([self.bin, *args], env=self.env(), capture_output=True, timeout=60)

    def close(self) -> None:
        if self.proc is not None:
            self.stop()
        for pid in marked(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.cgroup_root is not None:
            for d in self.cgroup_root.iterdir() if self.cgroup_root.exists() else []:
                if d.is_dir():
                    try:
                        (d / "cgroup.kill").write_text("1")
                    except OSError:
                        pass

            def gone() -> bool:
                for d in list(self.cgroup_root.iterdir()) if self.cgroup_root else []:
                    if d.is_dir():
                        try:
                            d.rmdir()
                        except OSError:
                            return False
                try:
                    if self.cgroup_root:
                        self.cgroup_root.rmdir()
                    return True
                except OSError:
                    return False

            wait_until(gone, 10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    if binary() is None:
        pytest.skip("skipped: no treewarden binary (cargo build, or set TREEWARDEN_BIN)")
    s = Server(tmp_path)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    if binary() is None:
        pytest.skip("skipped: no treewarden binary (cargo build, or set TREEWARDEN_BIN)")
    made: List[Server] = []

    def make(extra: Optional[List[str]] = None) -> Server:
        d = tmp_path / f"s{len(made)}"
        d.mkdir()
        s = Server(d, extra)
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.close()
