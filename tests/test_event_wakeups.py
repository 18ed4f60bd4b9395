"""The server's event stream (mtplx/server/turns.events): every event arrives, in order, and the
events the engine thread publishes while a wake-up is pending share it."""

from __future__ import annotations

import asyncio
import threading
import time

from mtplx.engine.engine import Submission
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.events import DraftVerified, Failed, Tokens
from mtplx.server.turns import events


def test_events_arrive_in_order_and_a_round_shares_one_wake_up():
    sub = Submission(GenerationRequest((1, 2, 3), SamplingParams(max_tokens=4)))
    rounds, scheduled = 300, []

    async def consume():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (scheduled.append(1), real(*a))[1]
        got = []

        def engine():  # as the scheduler publishes an MTP round: DraftVerified, then its Tokens
            while sub.waker is None:
                time.sleep(0.001)
            for i in range(rounds):
                sub.put(DraftVerified("r", 3, 2, "content"))
                sub.put(Tokens("r", (i,), str(i), "content"))
                if i % 7 == 0:
                    time.sleep(0.0005)  # the loop drains and sleeps in between, now and then
            sub.put(Failed("r", "done", "internal"))

        thread = threading.Thread(target=engine)
        thread.start()
        async for event in events(sub):
            got.append(event)
        thread.join()
        return got

    got = asyncio.run(consume())
    tokens = [e.token_ids[0] for e in got if isinstance(e, Tokens)]
    assert tokens == list(range(rounds))
    assert sum(isinstance(e, DraftVerified) for e in got) == rounds and isinstance(got[-1], Failed)
    # without sharing: one wake-up per event (601); with it about one a round (the loop rarely runs
    # between a round's two events)
    assert len(scheduled) <= rounds * 5 // 4
    assert sub.cancelled.is_set()  # the consumer left: the generation is cancelled (as before)
