"""The bank's latest summary for views on other threads (the TUI, the attach route).

An engine listener: it runs on the engine thread, the only one that may read the bank, right after
each bank decision and restore, so a view shows a restore while its request is still prefilling
instead of waiting for the engine to be free. It knows the summary's plain data, never arrays.
"""

from __future__ import annotations

import threading
from typing import Callable

from mtplx.events import BankDecision, EngineEvent, Restored


class BankWatch:
    def __init__(self, engine, on_change: Callable[[list[dict]], None] | None = None):
        self.engine, self.on_change = engine, on_change
        self._entries: list[dict] | None = None
        self._lock = threading.Lock()

    def __call__(self, event: EngineEvent) -> None:
        if isinstance(event, (BankDecision, Restored)) and getattr(self.engine, "bank", None) is not None:
            entries = self.engine.bank.summary()
            with self._lock:
                self._entries = entries
            if self.on_change is not None:
                self.on_change(entries)

    def latest(self) -> list[dict]:
        """The summary as of the last bank event; before any, read once on the engine thread."""
        with self._lock:
            entries = self._entries
        if entries is None and getattr(self.engine, "bank", None) is not None:
            entries = self.engine.call(self.engine.bank.summary)
            with self._lock:
                self._entries = self._entries if self._entries is not None else entries
        return entries or []
