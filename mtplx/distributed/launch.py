"""Starting N ranks: on this machine over loopback (no ssh), or on several machines through
`mlx.launch --hostfile` (which reaches them with ssh).

For local ranks each process gets what `mlx.launch` would give it (MLX_RANK, and MLX_HOSTFILE
naming one loopback port per rank), but the exit status is kept: `mlx.launch` exits 0 even when
a rank failed, and a supervisor must see a failure. When one rank exits non-zero the others get
`grace_s` to end on their own (their watchdog or the ring's lost-peer error ends them with their
own line), then are terminated. SIGINT/SIGTERM go to rank 0, which stops every rank in order.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_hostfile(n: int, directory: Path) -> Path:
    path = Path(directory) / "mtplx-ring.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


class LocalRing:
    """`argv` started as ranks 0..n-1 on loopback (a context manager: leaving it kills what is left)."""

    def __init__(self, argv: list[str], n: int, env: dict | None = None):
        if n < 2:
            raise ValueError(f"a ring needs at least 2 ranks, got {n}")
        self._tmp = tempfile.TemporaryDirectory(prefix="mtplx-ring-")
        hostfile = local_hostfile(n, Path(self._tmp.name))
        base = {**os.environ, **(env or {}), "MLX_HOSTFILE": str(hostfile)}
        self.started = time.monotonic()
        self.procs = [subprocess.Popen(argv, env={**base, "MLX_RANK": str(r)}) for r in range(n)]
        self.ended: list[float | None] = [None] * n  # seconds from the start to each rank's exit

    def __enter__(self) -> "LocalRing":
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._tmp.cleanup()

    def wait(self, grace_s: float = 30.0, timeout_s: float | None = None) -> list[int]:
        """Every rank's exit status; after the first failure the others get `grace_s` to end on
        their own before they are terminated (-15)."""
        failed_at = None
        while None in [p.poll() for p in self.procs]:  # a list: every rank polled each time
            now = time.monotonic()
            for r, p in enumerate(self.procs):
                if p.returncode is not None and self.ended[r] is None:
                    self.ended[r] = now - self.started
            if failed_at is None and any(p.returncode not in (None, 0) for p in self.procs):
                failed_at = now
            if (failed_at is not None and now - failed_at > grace_s) or (timeout_s and now - self.started > timeout_s):
                for p in self.procs:
                    if p.poll() is None:
                        p.terminate()
                break
            time.sleep(0.05)
        for r, p in enumerate(self.procs):
            p.wait()
            if self.ended[r] is None:
                self.ended[r] = time.monotonic() - self.started
        return [p.returncode for p in self.procs]


def run_local(argv: list[str], n: int, env: dict | None = None, grace_s: float = 30.0,
              timeout_s: float | None = None) -> int:
    """Run `argv` as ranks 0..n-1 on loopback; the first failing rank's exit status, else 0."""
    with LocalRing(argv, n, env) as ring:
        forward = lambda signum, _frame: ring.procs[0].poll() is None and ring.procs[0].send_signal(signum)  # noqa: E731
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if _main_thread() else {}
        try:
            codes = ring.wait(grace_s, timeout_s)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    order = sorted(range(n), key=lambda r: ring.ended[r])
    return next((codes[r] for r in order if codes[r]), 0)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run_hostfile(argv: list[str], hostfile: Path) -> int:
    """Several machines: hand the ranks to mlx.launch (ssh to each host in the hostfile, ring backend)."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    cmd = [str(launcher), "--backend", "ring", "--hostfile", str(hostfile), "--python", sys.executable, "--", *argv]
    return subprocess.call(cmd)
