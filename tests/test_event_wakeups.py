"""The server's event stream (mtplx/server/turns.events): every event arrives, in order, and the
events the engine thread publishes while a wake-up is pending share it."""

from __future__ import annotations

import asyncio
import threading
import time

from mtplx.engine.engine import Submission
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.events import DraftVerified, Failed, Finished, Tokens
from mtplx.server import turns
from mtplx.server.turns import events


def test_events_arrive_in_order_and_a_round_shares_one_wake_up(monkeypatch):
    monkeypatch.setattr(turns, "STREAM_INTERVAL", 0)  # every round as it comes (the interval: below)
    sub = Submission(GenerationRequest((1, 2, 3), SamplingParams(max_tokens=4)))
    rounds = 300

    def engine(sub):  # as the scheduler publishes an MTP round: DraftVerified, then its Tokens
        _wait_for_consumer(sub)
        for i in range(rounds):
            sub.put(DraftVerified("r", 3, 2, "content"))
            sub.put(Tokens("r", (i,), str(i), "content"))
            if i % 7 == 0:
                time.sleep(0.0005)  # the loop drains and sleeps in between, now and then
        sub.put(Failed("r", "done", "internal"))

    got, scheduled = _stream(sub, engine)
    tokens = [e.token_ids[0] for e in got if isinstance(e, Tokens)]
    assert tokens == list(range(rounds))
    assert sum(isinstance(e, DraftVerified) for e in got) == rounds and isinstance(got[-1], Failed)
    # without sharing: one wake-up per event (601); with it about one a round (the loop rarely runs
    # between a round's two events)
    assert len(scheduled) <= rounds * 5 // 4
    assert sub.cancelled.is_set()  # the consumer left: the generation is cancelled (as before)


def _stream(sub, engine) -> tuple[list, list]:
    """Run `engine(sub)` on a thread while the server's stream consumes; (events, wake-ups sent)."""
    scheduled = []

    async def consume():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (scheduled.append(1), real(*a))[1]
        thread = threading.Thread(target=engine, args=(sub,))
        thread.start()
        got = [event async for event in events(sub)]
        thread.join()
        return got

    return asyncio.run(consume()), scheduled


def _wait_for_consumer(sub):
    while sub.waker is None:
        time.sleep(0.001)


def test_a_streaming_reply_wakes_the_loop_once_per_interval_not_per_round(monkeypatch):
    """Past its first tokens a reply's rounds ride on the stream interval's timer: no wake-up of
    their own, every token still in order."""
    monkeypatch.setattr(turns, "STREAM_INTERVAL", 0.005)
    sub = Submission(GenerationRequest((1, 2, 3), SamplingParams(max_tokens=4)))

    def engine(sub):
        _wait_for_consumer(sub)
        for i in range(300):
            sub.put(DraftVerified("r", 3, 2, "content"))
            sub.put(Tokens("r", (i,), str(i), "content"))
            time.sleep(0.0002)  # a round takes a while: the loop would drain between them
        sub.put(Failed("r", "done", "internal"))

    got, scheduled = _stream(sub, engine)
    assert [e.token_ids[0] for e in got if isinstance(e, Tokens)] == list(range(300))
    assert isinstance(got[-1], Failed)
    # the lead tokens and the terminal event wake it; the rest wait for the timer (without the
    # interval: about one wake-up a round, 300)
    assert len(scheduled) <= turns.STREAM_LEAD * 2 + 2


def test_the_first_tokens_and_the_end_never_wait_for_the_interval(monkeypatch):
    """With an interval far longer than the test may take, the lead tokens still arrive one by one
    as they are published, and the terminal event ends the stream at once."""
    monkeypatch.setattr(turns, "STREAM_INTERVAL", 30.0)
    sub = Submission(GenerationRequest((1, 2, 3), SamplingParams(max_tokens=4)))
    seen = [threading.Event() for _ in range(turns.STREAM_LEAD)]
    late = []

    def engine(sub):
        _wait_for_consumer(sub)
        for i in range(turns.STREAM_LEAD):
            sub.put(Tokens("r", (i,), str(i), "content"))
            late.append(not seen[i].wait(10))  # each lead token reaches the consumer before the next is sent
        sub.put(Tokens("r", (99,), "x", "content"))  # past the lead: held for the interval ...
        sub.put(Finished("r", "length", 3, 5, 0, "", ()))  # ... until the end arrives

    async def consume():
        thread = threading.Thread(target=engine, args=(sub,))
        thread.start()
        got, t = [], time.monotonic()
        async for event in events(sub):
            got.append(event)
            if isinstance(event, Tokens) and event.token_ids[0] < turns.STREAM_LEAD:
                seen[event.token_ids[0]].set()
        await asyncio.to_thread(thread.join)
        return got, time.monotonic() - t

    got, took = asyncio.run(consume())
    assert late == [False] * turns.STREAM_LEAD
    assert [type(e).__name__ for e in got[-2:]] == ["Tokens", "Finished"]
    assert took < 20  # never the 30 s interval
