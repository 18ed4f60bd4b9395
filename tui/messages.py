"""Textual messages the workbench posts to itself: engine events waiting (tui/event_feed.py),
bank snapshots and the attach connection's state crossing into the UI thread."""

from __future__ import annotations

from textual.message import Message


class EngineEventsWaiting(Message):
    """Engine events are queued in the app's EventFeed (tui/event_feed.py): show them."""


class BankChanged(Message):
    """A fresh summary of the session bank's entries (taken on the engine thread, or fetched)."""

    def __init__(self, entries: list[dict]) -> None:
        super().__init__()
        self.entries = entries


class ConnectionChanged(Message):
    """Attach mode: the event stream connected, was refused, unauthorized, or waits to retry."""

    def __init__(self, state: str) -> None:
        super().__init__()
        self.state = state


class HealthChanged(Message):
    """Attach mode: the server's /health report (its model, a sharded run's layout and ranks)."""

    def __init__(self, report: dict) -> None:
        super().__init__()
        self.report = report
