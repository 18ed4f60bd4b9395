"""A deadline on every collective: a peer that hangs or is lost must end every rank, never leave
one waiting forever.

MLX evaluates a collective inside `mx.eval`, which releases the GIL, so a Python thread can
watch the clock while the engine thread waits on the ring (checked on the ring backend: a
watchdog thread ran while `all_sum` waited on a stalled peer). On expiry it writes one line to
stderr and ends the process with EXIT_CODE at once (`os._exit`: a thread stuck in a collective
cannot be unwound). A peer's own exit shows up on the others as the ring's "connection to a peer
was lost" error, which `fatal` turns into the same kind of line and exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

EXIT_CODE = 3


def fatal(rank: int, message: str) -> None:
    """End this rank now with one clear line (the other ranks' watchdogs or ring errors end them)."""
    sys.stderr.write(f"mtplx rank {rank}: {message}; exiting\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class Watchdog:
    def __init__(self, rank: int, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.rank, self.timeout_s = rank, timeout_s
        self._what: str | None = None
        self._deadline = 0.0
        self._cond = threading.Condition()
        threading.Thread(target=self._watch, name="mtplx-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watch(self, what: str):
        """Arm the deadline over the block (it may hold several collectives); re-entrant blocks
        keep the outer deadline."""
        with self._cond:
            outer = self._what
            if outer is None:
                self._what, self._deadline = what, time.monotonic() + self.timeout_s
                self._cond.notify()
        try:
            yield
        except RuntimeError as exc:
            if "[ring]" in str(exc) or "peer" in str(exc):
                fatal(self.rank, f"{what} failed: {exc} (a peer was lost)")
            raise
        finally:
            if outer is None:
                with self._cond:
                    self._what = None

    def state(self) -> dict:
        """For /health: "stalled" once one watched block has run past half the deadline (a peer
        may have hung: the rank exits when the deadline passes), with what it waits on."""
        with self._cond:
            what, left = self._what, self._deadline - time.monotonic()
        waited = self.timeout_s - left
        if what is None or waited < self.timeout_s / 2:
            return {"status": "ok", "watchdog_s": self.timeout_s}
        return {"status": "stalled", "watchdog_s": self.timeout_s,
                "stalled": f"{what}: {waited:.0f} s of the {self.timeout_s:g} s watchdog (exits at the deadline)"}

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._what is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    fatal(self.rank, f"{self._what} did not complete within {self.timeout_s:g} s "
                                     "(a peer hung or was lost)")
                self._cond.wait(left)
