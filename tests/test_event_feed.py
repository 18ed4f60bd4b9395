"""The TUI's EventFeed (tui/event_feed.py): engine events reach the UI thread in order, with one
wake-up per batch, and a terminal event is never kept waiting for the interval."""

from __future__ import annotations

import threading

from mtplx.events import DraftVerified, Failed, Finished, Tokens
from tui.event_feed import EventFeed


def _tokens(i):
    return Tokens("r", (i,), str(i), "content")


def test_one_wake_up_per_batch_and_every_event_in_order():
    wakes = []
    feed = EventFeed(lambda: wakes.append(1))
    for i in range(5):
        feed.put(_tokens(i))
    assert len(wakes) == 1  # the first put wakes the UI; the rest ride on that wake-up
    assert [e.token_ids[0] for e in feed.take()] == list(range(5))
    assert feed.take() == [] and not feed.armed  # ran dry: disarmed, so the next event wakes again
    feed.put(_tokens(5))
    assert len(wakes) == 2


def test_while_gathering_only_a_terminal_event_wakes_the_ui():
    wakes = []
    feed = EventFeed(lambda: wakes.append(1))
    feed.put(_tokens(0))
    feed.take()
    feed.gathering = True  # the UI waits out the interval, still armed
    feed.put(DraftVerified("r", 3, 2, "content"))
    feed.put(_tokens(1))
    assert len(wakes) == 1
    feed.put(Finished("r", "stop", 3, 2, 0, "", ()))
    assert len(wakes) == 2
    assert [type(e).__name__ for e in feed.take()] == ["DraftVerified", "Tokens", "Finished"]
    assert not feed.gathering


def test_events_from_another_thread_all_arrive_in_order():
    """The engine thread puts while the UI thread takes whenever woken: nothing is lost or
    reordered, and far fewer wake-ups than events are sent."""
    woken = threading.Event()
    wakes = []
    feed = EventFeed(lambda: (wakes.append(1), woken.set()))
    got = []

    def engine():
        for i in range(2000):
            feed.put(_tokens(i))
        feed.put(Failed("r", "done", "internal"))

    thread = threading.Thread(target=engine)
    thread.start()
    while not (got and isinstance(got[-1], Failed)):
        assert woken.wait(10)
        woken.clear()
        while batch := feed.take():  # as the app: show the batch, look again until it runs dry
            got.extend(batch)
    thread.join()
    assert [e.token_ids[0] for e in got[:-1]] == list(range(2000))
    assert len(wakes) < 2001
