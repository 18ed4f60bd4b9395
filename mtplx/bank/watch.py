"""The bank's latest summary for views on other threads (the TUI, the attach route).

An engine listener: it runs on the engine thread, the only one that may read the bank, right after
each bank decision and restore, so a view shows a restore while its request is still prefilling
instead of waiting for the engine to be free. A server nobody watches pays nothing: without a
callback, summaries are taken only while someone has asked for one recently. It knows the
summary's plain data, never arrays.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from mtplx.events import BankDecision, EngineEvent, Restored

WATCHED_S = 60.0  # an attached view asks after every bank event; a minute without asking = nobody watches


class BankWatch:
    def __init__(self, engine, on_change: Callable[[list[dict]], None] | None = None):
        self.engine, self.on_change = engine, on_change
        self._entries: list[dict] | None = None
        self._stale = True
        self._asked = float("-inf")
        self._lock = threading.Lock()

    def __call__(self, event: EngineEvent) -> None:
        if not isinstance(event, (BankDecision, Restored)) or getattr(self.engine, "bank", None) is None:
            return
        if self.on_change is None and time.monotonic() - self._asked > WATCHED_S:
            self._stale = True  # read on demand by the next latest()
            return
        entries = self.engine.bank.summary()
        with self._lock:
            self._entries, self._stale = entries, False
        if self.on_change is not None:
            self.on_change(entries)

    def latest(self) -> list[dict]:
        """The summary as of the last bank event; when none was taken since, read on the engine
        thread (between requests)."""
        self._asked = time.monotonic()
        with self._lock:
            entries, stale = self._entries, self._stale
        if stale and getattr(self.engine, "bank", None) is not None:
            entries = self.engine.call(self.engine.bank.summary)
            with self._lock:
                self._entries, self._stale = entries, False
        return entries or []
