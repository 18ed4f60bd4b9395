"""Requests that wait to share a prompt being computed (mtplx/engine/shared_prompt.py): the pure
rule, then on both tiny models a burst of turns over one new prompt head, each follower restoring
the leader's prompt and answering exactly as a cold engine does."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from mtplx.bank.bank import BankConfig
from mtplx.catalog import resolve
from mtplx.chat import chat_request
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.shared_prompt import SHARE_FROM, common_prefix, wait_for
from mtplx.receipts.store import ReceiptStore
from mtplx.receipts.writer import ReceiptWriter


SYSTEM = "You are a subagent. " + " ".join(f"Rule {i}: never skip the tests of module {i}." for i in range(60))
LOG = "Review this log. " + " ".join(f"line {i}: request {i} took {i % 7} ms." for i in range(120))


@pytest.fixture
def fresh():
    """An engine whose bank starts empty (what was shared must come from this test's turns)."""
    engine = Engine(resolve("tiny-dense"), EngineConfig(chunk_size=64), name="tiny-dense", bank=BankConfig()).start()
    yield engine
    engine.stop()


def turn(engine, messages: list, session: str, max_tokens: int = 8, system: str = SYSTEM):
    """A greedy chat turn: the shared system prompt, then `messages` (a str: one user message)."""
    messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    return chat_request(engine.checkpoint.tokenizer, [{"role": "system", "content": system}, *messages], None,
                        sampling=SamplingParams(max_tokens=max_tokens, temperature=0), session=session)


def wait_for_event(seen: list, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while not seen and time.monotonic() < deadline:
        time.sleep(0.001)


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
        requests = [turn(engine, f"Task {i}: read file_{i}.py.", f"sub-{i}", 12) for i in range(3)]
        shared = common_prefix(requests[0].prompt, requests[1].prompt)
        assert shared >= SHARE_FROM + 64
        warm = [s.result() for s in [engine.submit(r) for r in requests]]  # at once: they queue together
        cold = [cold_engine.submit(turn(cold_engine, f"Task {i}: read file_{i}.py.", f"cold-{name}-{i}", 12)).result()
                for i in range(3)]
        assert [w.token_ids for w in warm] == [c.token_ids for c in cold]
        assert warm[0].cached_tokens == 0
        # each follower restored the leader's prompt up to its last anchor inside the shared part
        assert all(w.cached_tokens >= shared - 16 for w in warm[1:]), [w.cached_tokens for w in warm]
    finally:
        engine.stop()


def test_a_follower_waits_only_until_the_shared_part_is_in(fresh, dense_engine):
    """A short turn sharing a head with a long prompt being prefilled restores the head as soon as
    the long prefill has passed it, and gets its first token long before the long one does (it
    does not wait for the whole other prompt); both answer as a cold engine."""
    leader, follower = turn(fresh, LOG, "long"), turn(fresh, "Task: read file_1.py.", "short")
    assert len(leader.prompt) > 2 * len(follower.prompt)
    order = []
    listen = lambda e: order.append(e.request_id) if type(e).__name__ == "FirstToken" else None  # noqa: E731
    fresh.listeners.append(listen)
    fins = [s.result() for s in [fresh.submit(leader), fresh.submit(follower)]]
    assert order == [follower.request_id, leader.request_id]
    assert fins[1].cached_tokens >= common_prefix(leader.prompt, follower.prompt) - 16
    cold = [dense_engine.submit(turn(dense_engine, text, f"cold-{name}")).result()
            for name, text in (("long", LOG), ("short", "Task: read file_1.py."))]
    assert [f.token_ids for f in fins] == [c.token_ids for c in cold]


def test_a_follower_whose_leader_is_abandoned_still_answers_as_cold(fresh, dense_engine):
    """The turn computing a shared head is cancelled (its client went away) while another waits
    for it: the waiting turn is admitted (restoring what the cancelled prefill kept, if anything)
    and answers as a cold engine; nothing hangs."""
    leader, follower = turn(fresh, "Task: read file_0.py.", "gone"), turn(fresh, "Task: read file_1.py.", "stays")
    started = []
    fresh.listeners.append(lambda e: started.append(e) if type(e).__name__ == "PrefillProgress"
                           and e.request_id == leader.request_id else None)
    first, second = fresh.submit(leader), fresh.submit(follower)
    wait_for_event(started)
    first.cancel()
    assert first.result().finish_reason == "cancelled"
    fin = second.result()
    cold = dense_engine.submit(turn(dense_engine, "Task: read file_1.py.", "cold-stays")).result()
    assert fin.finish_reason != "cancelled" and fin.token_ids == cold.token_ids


def test_a_waiting_turn_whose_client_leaves_ends_at_once(fresh):
    """A turn waiting for another's shared prompt is cancelled (its client went away): it ends as
    cancelled without waiting for that prefill, and the other turn goes on."""
    # The follower shares the leader's whole prompt but its last tokens: it would wait until the
    # leader's last chunk, just before that one's first token.
    asked = [{"role": "user", "content": LOG}]
    leader = turn(fresh, asked, "long", max_tokens=4)
    follower = turn(fresh, asked + [{"role": "assistant", "content": "Read."}, {"role": "user", "content": "And file_1.py?"}],
                    "gone", max_tokens=4)
    order = []
    fresh.listeners.append(lambda e: order.append((type(e).__name__, e.request_id))
                           if type(e).__name__ in ("FirstToken", "Finished", "PrefillProgress") else None)
    first, second = fresh.submit(leader), fresh.submit(follower)
    wait_for_event(order)
    second.cancel()
    assert second.result().finish_reason == "cancelled"
    assert first.result().finish_reason in ("stop", "length")
    ended = order.index(("Finished", follower.request_id))
    assert ended < order.index(("FirstToken", leader.request_id))  # it did not wait for the other's prefill
    assert ("PrefillProgress", follower.request_id) not in order  # it computed nothing


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_a_turn_arriving_while_another_decodes_restores_its_head(name, dense_engine, hybrid_engine, tmp_path):
    """A second agent starts while the first one's turn decodes, in a batch with a third over
    another prompt: the new turn restores the shared head from the running turn (the bank holds
    nothing yet: that turn has not ended) and every turn answers as a cold engine."""
    cold_engine = dense_engine if name == "tiny-dense" else hybrid_engine
    engine = Engine(resolve(name), EngineConfig(chunk_size=64), name=name, bank=BankConfig()).start()
    try:
        def long(e, session, system=SYSTEM):
            r = turn(e, "Task 0: explain file_0.py in detail.", session, 160, system)
            return dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, ignore_eos=True))

        other = "You are a reviewer. " + "Say what changed and why. " * 40
        order, restored = [], {}
        engine.listeners.append(lambda e: order.append((type(e).__name__, e.request_id))
                                if type(e).__name__ in ("FirstToken", "Restored", "Finished") else None)
        engine.listeners.append(lambda e: restored.setdefault(e.request_id, e) if type(e).__name__ == "Restored" else None)
        receipts = ReceiptStore(tmp_path / "receipts.db")
        engine.listeners.append(ReceiptWriter(receipts, name, engine.checkpoint.identity))
        leaders = [long(engine, "first"), long(engine, "other", other)]
        running = [engine.submit(r) for r in leaders]
        deadline = time.monotonic() + 60
        while sum(kind == "FirstToken" for kind, _ in order) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        late = turn(engine, "Task 9: read file_9.py.", "late", 12)
        fin = engine.submit(late).result()
        firsts = [s.result() for s in running]
        shared = common_prefix(late.prompt, leaders[0].prompt)
        assert shared >= SHARE_FROM + 64
        assert fin.cached_tokens >= shared - 16, fin.cached_tokens
        assert order.index(("Restored", late.request_id)) < order.index(("Finished", leaders[0].request_id))
        # the turn and its receipt say where its head came from, though that entry is gone by now
        assert restored[late.request_id].entry_origin == "shared_prompt"
        assert not any(e.origin == "shared_prompt" for e in engine.call(lambda: list(engine.bank.entries.values())))
        (row,) = receipts.rows("request_id = ?", (late.request_id,))
        assert row["entry_origin"] == "shared_prompt"
        assert fin.token_ids == cold_engine.submit(turn(cold_engine, "Task 9: read file_9.py.", f"cold-late-{name}", 12)).result().token_ids
        assert firsts[0].token_ids == cold_engine.submit(long(cold_engine, f"cold-first-{name}")).result().token_ids
    finally:
        engine.stop()


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_a_turn_arriving_while_another_prefills_past_the_head_does_not_wait(name, dense_engine, hybrid_engine):
    """A turn arriving once a long prefill over the same head has passed that head is admitted at
    once: it restores the head from the prefill so far (kept when it is admitted, not at the next
    chunk's end), and its first token comes before the long one's; both answer as cold."""
    cold_engine = dense_engine if name == "tiny-dense" else hybrid_engine
    fresh = Engine(resolve(name), EngineConfig(chunk_size=64), name=name, bank=BankConfig()).start()
    try:
        _prefilling_leader_then_follower(fresh, cold_engine)
    finally:
        fresh.stop()


def _prefilling_leader_then_follower(fresh, cold_engine):
    leader, follower = turn(fresh, LOG, "long"), turn(fresh, "Task: read file_1.py.", "short")
    shared = common_prefix(leader.prompt, follower.prompt)
    progress, order, kept = [], [], []
    fresh.listeners.append(lambda e: kept.append(e.detail) if type(e).__name__ == "BankDecision"
                           and e.action == "kept_partial" else None)
    fresh.listeners.append(lambda e: progress.append(e.done) if type(e).__name__ == "PrefillProgress"
                           and e.request_id == leader.request_id else None)
    fresh.listeners.append(lambda e: order.append((type(e).__name__, e.request_id))
                           if type(e).__name__ in ("Restored", "PrefillProgress", "FirstToken") else None)
    first = fresh.submit(leader)
    deadline = time.monotonic() + 60
    while not (progress and progress[-1] >= shared) and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert progress[-1] < len(leader.prompt) - 64, "the leader's prefill ended before the test could send"
    second = fresh.submit(follower)
    fins = [first.result(), second.result()]
    assert fins[1].cached_tokens >= shared - 16
    # kept from the prefill so far when it was admitted, not by the leader's next chunk for it
    assert any("running turn" in detail for detail in kept)
    assert order.index(("FirstToken", follower.request_id)) < order.index(("FirstToken", leader.request_id))
    cold = [cold_engine.submit(turn(cold_engine, text, f"cold-prefilling-{name}")).result()
            for name, text in (("long", LOG), ("short", "Task: read file_1.py."))]
    assert [f.token_ids for f in fins] == [c.token_ids for c in cold]
