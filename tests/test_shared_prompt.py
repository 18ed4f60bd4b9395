"""Requests that wait to share a prompt being computed (mtplx/engine/shared_prompt.py): the pure
rule, then on both tiny models a burst of turns over one new prompt head, each follower restoring
the leader's prompt and answering exactly as a cold engine does."""

from __future__ import annotations

import random
import time

import pytest

from mtplx.bank.bank import BankConfig
from mtplx.catalog import resolve
from mtplx.chat import chat_request
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.shared_prompt import SHARE_FROM, common_prefix, wait_for


def test_common_prefix_is_the_longest_shared_start():
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randrange(0, 60)
        a = [rng.randrange(4) for _ in range(n)]
        b = a[: rng.randrange(0, n + 1)] + [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == common_prefix(tuple(b), tuple(a)) == expected


def test_waiting_pays_only_past_what_the_bank_already_restored():
    head = list(range(1000))
    assert wait_for(head + [1, 2], head + [3], other_restored=0) == 1000  # up to where they part
    assert wait_for(head + [1, 2], head + [3], other_restored=1000 - SHARE_FROM + 1) == 0  # the bank has most
    assert wait_for(list(range(SHARE_FROM - 1)) + [7], list(range(SHARE_FROM - 1)) + [8], 0) == 0  # too short
    assert wait_for([5] + head, head, 0) == 0  # nothing shared


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_a_burst_over_one_new_head_computes_it_once_and_answers_as_cold(name, dense_engine, hybrid_engine):
    cold_engine = dense_engine if name == "tiny-dense" else hybrid_engine
    engine = Engine(resolve(name), EngineConfig(chunk_size=64), name=name, bank=BankConfig()).start()
    try:
        tok = engine.checkpoint.tokenizer
        system = "You are a subagent. " + " ".join(f"Rule {i}: keep edits small; test module {i} first." for i in range(40))
        params = SamplingParams(max_tokens=12, temperature=0)

        def turn(i: int, session: str):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Task {i}: read file_{i}.py."}]
            return chat_request(tok, messages, None, sampling=params, session=session)

        requests = [turn(i, f"sub-{i}") for i in range(3)]
        assert common_prefix(requests[0].prompt, requests[1].prompt) >= SHARE_FROM + 64
        subs = [engine.submit(r) for r in requests]  # at once: they queue together
        warm = [s.result() for s in subs]
        cold = [cold_engine.submit(turn(i, f"cold-{name}-{i}")).result() for i in range(3)]
        assert [w.token_ids for w in warm] == [c.token_ids for c in cold]
        shared = common_prefix(requests[0].prompt, requests[1].prompt)
        assert warm[0].cached_tokens == 0
        # each follower restored the leader's prompt up to its last anchor inside the shared part
        assert all(w.cached_tokens >= shared - 16 for w in warm[1:]), [w.cached_tokens for w in warm]
    finally:
        engine.stop()


def test_a_follower_waits_only_until_the_shared_part_is_in(dense_engine):
    """A short turn sharing a head with a long prompt being prefilled restores the head as soon as
    the long prefill has passed it, and gets its first token long before the long one does (it
    does not wait for the whole other prompt); both answer as a cold engine."""
    engine = Engine(resolve("tiny-dense"), EngineConfig(chunk_size=64), name="tiny-dense", bank=BankConfig()).start()
    try:
        tok = engine.checkpoint.tokenizer
        system = "You are a subagent. " + " ".join(f"Rule {i}: keep edits small; test module {i} first." for i in range(40))
        long_task = "Review this log. " + " ".join(f"line {i}: request {i} took {i % 7} ms." for i in range(300))
        params = SamplingParams(max_tokens=8, temperature=0)

        def turn(text: str, session: str):
            return chat_request(tok, [{"role": "system", "content": system}, {"role": "user", "content": text}], None,
                                sampling=params, session=session)

        leader, follower = turn(long_task, "long"), turn("Task: read file_1.py.", "short")
        assert len(leader.prompt) > 4 * len(follower.prompt)
        order = []
        listen = lambda e: order.append(e.request_id) if type(e).__name__ == "FirstToken" else None  # noqa: E731
        engine.listeners.append(listen)
        try:
            subs = [engine.submit(leader), engine.submit(follower)]
            fins = [s.result() for s in subs]
        finally:
            engine.listeners.remove(listen)
        assert order == [follower.request_id, leader.request_id]
        assert fins[1].cached_tokens >= common_prefix(leader.prompt, follower.prompt) - 16
        cold = [dense_engine.submit(turn(long_task, "cold-long")).result(),
                dense_engine.submit(turn("Task: read file_1.py.", "cold-short")).result()]
        assert [f.token_ids for f in fins] == [c.token_ids for c in cold]
    finally:
        engine.stop()


def test_a_follower_whose_leader_is_abandoned_still_answers_as_cold(dense_engine):
    """The turn computing a shared head is cancelled (its client went away) while another waits
    for it: the waiting turn is admitted (restoring what the cancelled prefill kept, if anything)
    and answers as a cold engine; nothing hangs."""
    engine = Engine(resolve("tiny-dense"), EngineConfig(chunk_size=64), name="tiny-dense", bank=BankConfig()).start()
    try:
        tok = engine.checkpoint.tokenizer
        system = "You are a subagent. " + " ".join(f"Rule {i}: never skip the tests of module {i}." for i in range(60))
        params = SamplingParams(max_tokens=8, temperature=0)

        def turn(text: str, session: str):
            return chat_request(tok, [{"role": "system", "content": system}, {"role": "user", "content": text}], None,
                                sampling=params, session=session)

        leader, follower = turn("Task: read file_0.py.", "gone"), turn("Task: read file_1.py.", "stays")
        started = []
        engine.listeners.append(lambda e: started.append(e) if type(e).__name__ == "PrefillProgress"
                                and e.request_id == leader.request_id else None)
        first = engine.submit(leader)
        second = engine.submit(follower)
        deadline = time.monotonic() + 60
        while not started and time.monotonic() < deadline:
            time.sleep(0.001)
        first.cancel()
        assert first.result().finish_reason == "cancelled"
        fin = second.result()
        cold = dense_engine.submit(turn("Task: read file_1.py.", "cold-stays")).result()
        assert fin.finish_reason != "cancelled" and fin.token_ids == cold.token_ids
    finally:
        engine.stop()


def test_a_waiting_turn_whose_client_leaves_ends_at_once():
    """A turn waiting for another's shared prompt is cancelled (its client went away): it ends as
    cancelled without waiting for that prefill, and the other turn goes on."""
    engine = Engine(resolve("tiny-dense"), EngineConfig(chunk_size=64), name="tiny-dense", bank=BankConfig()).start()
    try:
        tok = engine.checkpoint.tokenizer
        system = "You are a subagent. " + " ".join(f"Rule {i}: never skip the tests of module {i}." for i in range(60))
        log = "Review this log. " + " ".join(f"line {i}: request {i} took {i % 7} ms." for i in range(120))
        params = SamplingParams(max_tokens=4, temperature=0)

        def turn(messages: list, session: str):
            return chat_request(tok, [{"role": "system", "content": system}, *messages], None, sampling=params,
                                session=session)

        # The follower shares the leader's whole prompt but its last tokens: it would wait until
        # the leader's last chunk, just before that one's first token.
        asked = [{"role": "user", "content": log}]
        leader = turn(asked, "long")
        follower = turn(asked + [{"role": "assistant", "content": "Read."}, {"role": "user", "content": "And file_1.py?"}], "gone")
        order = []
        engine.listeners.append(lambda e: order.append((type(e).__name__, e.request_id))
                                if type(e).__name__ in ("FirstToken", "Finished", "PrefillProgress") else None)
        first, second = engine.submit(leader), engine.submit(follower)
        deadline = time.monotonic() + 60
        while not any(r == leader.request_id for _, r in order) and time.monotonic() < deadline:
            time.sleep(0.001)
        second.cancel()
        assert second.result().finish_reason == "cancelled"
        assert first.result().finish_reason in ("stop", "length")
        ended = order.index(("Finished", follower.request_id))
        assert ended < order.index(("FirstToken", leader.request_id))  # it did not wait for the other's prefill
        assert ("PrefillProgress", follower.request_id) not in order  # it computed nothing
    finally:
        engine.stop()
