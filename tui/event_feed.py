"""Engine events crossing into the UI thread in batches, not one Textual message each.

The embedded engine publishes every event of every request (the TUI's chat and the agents on the
endpoint alike): an MTP round is a DraftVerified and a Tokens event, a few hundred a second while
a reply streams. Posted one by one, each was a wake-up of the UI's event loop and a pass through
the dashboard, and the UI thread's share of the GIL and the two cores halved the decode speed of
an agent served alongside (tiny-hybrid, depth 3: 569 tok/s through `mtplx tui`'s endpoint against
1,055 through `mtplx serve`). Now the engine thread queues events; one message wakes the UI, which
shows everything queued, then lets the next ones gather for INTERVAL before it looks again. A
terminal event (Finished, Failed) is never kept waiting for the interval.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from mtplx.events import TERMINAL

INTERVAL = 0.05  # seconds: the dashboard takes events at most ~20 times a second while they stream
LIVE_PANELS = 0.25  # seconds: the in-flight and acceptance panels redraw at most ~4 times a second then


class EventFeed:
    def __init__(self, wake: Callable[[], None]):
        """`wake()` (any thread) asks the UI thread to call `take` soon."""
        self.wake = wake
        self.pending: deque = deque()
        self.armed = False  # a wake-up is on its way, or the UI gathers for INTERVAL: no other needed
        self.gathering = False  # the UI waits out INTERVAL (only a terminal event wakes it early)

    def put(self, event) -> None:
        """Queue an event (any thread); wake the UI unless a wake-up is already due."""
        self.pending.append(event)
        if self.armed and not (self.gathering and isinstance(event, TERMINAL)):
            return
        self.armed = True
        self.wake()

    def take(self) -> list:
        """Everything queued, oldest first (UI thread). Empty: the feed is disarmed, so the next
        event wakes the UI again; whatever slipped in meanwhile is returned instead."""
        self.gathering = False
        events = self._drain()
        if not events:
            self.armed = False
            events = self._drain()  # queued between the drain and the disarm: its put saw armed
            self.armed = bool(events)
        return events

    def _drain(self) -> list:
        events = []
        while self.pending:
            events.append(self.pending.popleft())
        return events
