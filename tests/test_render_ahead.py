"""Render-ahead is progressive: a request that arrives before a render-ahead ends restores what it
had computed (stored at the chunk boundary where it was preempted) and prefills only the rest; the
render-ahead then continues from there. Restored == cold still holds."""

from __future__ import annotations

import time

import pytest

from mtplx.bank.bank import BankConfig
from mtplx.catalog import resolve
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.events import BankDecision, Restored
from mtplx.receipts.store import ReceiptStore
from mtplx.receipts.writer import ReceiptWriter
from mtplx.replay.live_agent import AgentSession
from mtplx.synth.agent import Sizes, conversation
from mtplx.synth.corpus import Corpus
from mtplx.synth.heads import HEADS

CHUNK = 16  # small chunks: a render-ahead of a few dozen tokens takes several idle steps


class IdleGate:
    """Lets the engine run exactly `budget` idle steps (render-ahead chunks), then holds the rest,
    so a test can send the next request at a known point of a render-ahead."""

    def __init__(self, engine: Engine):
        self.executor, self.budget = engine.bank_executor, None
        self.original = self.executor.idle_step
        self.executor.idle_step = self.step

    def step(self) -> bool:
        if self.budget is None or self.budget > 0:
            more = self.original()
            if self.budget is not None:  # counted once the step is done: a request sent as the
                self.budget -= 1  # budget runs out must not find the last step still running
            return more
        time.sleep(0.002)  # held: the engine loops back and serves any request first
        return True


def _strip_turn(name: str, budget: int | None, receipts: ReceiptStore | None = None):
    """Drive the conversation to its second user message (a tool chain before it), letting the
    render-ahead run `budget` idle steps after the last reply; returns that turn's result."""
    engine = Engine(resolve(name), EngineConfig(chunk_size=CHUNK), name=name, bank=BankConfig()).start()
    decisions = []
    engine.listeners.append(lambda e: decisions.append(e) if isinstance(e, (BankDecision, Restored)) else None)
    if receipts is not None:
        engine.listeners.append(ReceiptWriter(receipts, name, engine.checkpoint.identity))
    try:
        gate = IdleGate(engine)
        session = AgentSession("agent", conversation(305, Corpus(), Sizes(20, 60), 3, HEADS[0]))
        tok = engine.checkpoint.tokenizer
        while True:
            prompt, chat = session.next_request(tok)
            strip = sum(m["role"] == "user" for m in chat["messages"]) == 2
            msgs = session.conversation["messages"]
            before_strip = session.cursor + 1 < len(msgs) and msgs[session.cursor + 1]["role"] == "user"
            if before_strip:  # set before the reply ends: the engine starts idle work at once
                gate.budget = budget
            req = GenerationRequest(tuple(prompt), SamplingParams(max_tokens=64), chat=chat, session="agent")
            fin = engine.submit(req).result()
            if strip:
                outcome = engine.bank.outcomes.get(req.request_id)
                gate.budget = None
                engine.settle()  # the re-queued render-ahead finishes from where it stopped
                assert engine.health()["idle_work"] is False  # what /health tells a benchmark
                return fin, outcome, decisions, engine.call(lambda: len(engine.bank_executor.jobs))
            session.send_back(fin.reply)
            if before_strip and budget is None:
                engine.settle()  # the user took their time: the render-ahead ran to its end
            elif before_strip:
                deadline = time.monotonic() + 60
                while budget and gate.budget > 0 and time.monotonic() < deadline:
                    time.sleep(0.01)  # the render-ahead runs its `budget` steps, then is held
            else:
                engine.settle()  # a tool turn: the client ran the tool, render-ahead finished
    finally:
        engine.stop()


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_a_request_arriving_mid_render_ahead_restores_its_computed_prefix(name, tmp_path):
    none, o_none, _, _ = _strip_turn(name, budget=0)
    receipts = ReceiptStore(tmp_path / "receipts.db")
    part, o_part, decisions, left = _strip_turn(name, budget=3, receipts=receipts)
    full, o_full, _, _ = _strip_turn(name, budget=None)
    restored = [e for e in decisions if isinstance(e, Restored)]
    decisions = [d for d in decisions if isinstance(d, BankDecision)]
    kept = [d for d in decisions if d.action == "kept_partial" and "render-ahead" in d.detail]
    assert kept, "the preempted render-ahead kept nothing"
    # Nothing prepared < a part prepared < all of it prepared; the outputs never change.
    assert o_none.achieved < o_part.achieved < o_full.achieved
    assert o_part.achieved >= o_none.achieved + CHUNK
    assert o_full.achieved >= o_full.ceiling
    assert none.token_ids == part.token_ids == full.token_ids
    # The receipt's shortfall says the miss was idle time, and how far the render-ahead had come.
    assert o_none.cause.startswith("render-ahead queued: not started")
    assert o_part.cause.startswith(f"render-ahead partial: {o_part.achieved} of ")
    assert o_full.cause is None
    strip_event = next(e for e in restored if e.request_id == o_part.request_id)
    assert strip_event.render_ahead == f"partial: {o_part.achieved} of {o_full.ceiling} tokens"
    (row,) = [r for r in receipts.rows() if r["request_id"] == o_part.request_id]
    assert row["render_ahead"] == strip_event.render_ahead and row["shortfall"] == o_part.cause
    assert left == 0  # the re-queued render-ahead ran to its end afterwards
    assert not [d for d in decisions if d.action == "render_ahead_failed"]


def test_the_newest_turns_renderings_run_first_and_replace_what_they_extend():
    """Idle work order without a model: a turn's renderings go ahead of older jobs; a queued job of
    the same session that a new one extends is dropped (the new job covers it); a request drops
    the jobs its own prompt covers and keeps the rest."""
    from mtplx.engine.bank_executor import BankExecutor, RenderJob

    executor = BankExecutor(runner=None, bank=None, chunk_size=256)  # generators never started here
    older_chain = RenderJob(list(range(10)), True, "agent")
    other = RenderJob([7, 7, 7], True, "other")
    executor._queue_first([older_chain])
    executor._queue_first([other])
    assert [j for j, _ in executor.jobs] == [other, older_chain]
    tool, stripped = RenderJob(list(range(12)), True, "agent"), RenderJob(list(range(20)), True, "agent")
    executor._queue_first([tool, stripped])  # both extend the older job: it is dropped
    assert [j for j, _ in executor.jobs] == [tool, stripped, other]
    not_mine = RenderJob(list(range(20)), True, "someone else")  # same tokens, other session: kept
    executor._queue_first([not_mine])
    assert [j for j, _ in executor.jobs] == [not_mine, tool, stripped, other]
    note = executor._preempt_render_ahead(list(range(15)))  # the tool turn came: covers `tool` only
    assert note == "queued: not started (12 tokens)"
    assert [j for j, _ in executor.jobs] == [not_mine, stripped, other]


def test_the_idle_queue_is_bounded_when_clients_never_leave_idle_time():
    """Many sessions back to back (no idle time between requests): only the newest renderings stay
    queued. Unbounded, the queue held every conversation's job, the ones under way with their
    partial state: `mtplx serve` grew by ~7 MB a request (246 -> 2991 MiB over 400 requests)."""
    from mtplx.engine.bank_executor import MAX_JOBS, BankExecutor, RenderJob

    executor = BankExecutor(runner=None, bank=None, chunk_size=256)  # generators never started here
    jobs = [RenderJob([s, s, s], True, f"session {s}") for s in range(3 * MAX_JOBS)]
    for job in jobs:
        executor._queue_first([job])
    assert [j for j, _ in executor.jobs] == jobs[::-1][:MAX_JOBS]  # the newest, newest first


def test_a_finished_render_ahead_makes_and_stores_its_entry_in_separate_idle_steps(monkeypatch):
    """Making a finished render-ahead's entry, storing it, and starting the next job each take an
    idle step of their own, so a request that arrives meanwhile waits for one of them, not for all
    (together with a write's poll they took 17-20 ms on tiny-dense, in one step no request could cut)."""
    from mtplx.bank.bank import SessionBank
    from mtplx.engine import bank_executor
    from mtplx.engine.bank_executor import BankExecutor

    step, inside, marks = [0], [False], []

    def counted(original):
        def idle_step(self):
            inside[0] = True
            try:
                return original(self)
            finally:
                inside[0] = False
                step[0] += 1
        return idle_step

    def mark(what, original):
        def call(*args, **kwargs):
            if inside[0]:
                marks.append((what, step[0]))
            return original(*args, **kwargs)
        return call

    monkeypatch.setattr(BankExecutor, "idle_step", counted(BankExecutor.idle_step))
    monkeypatch.setattr(bank_executor, "entry_from_state", mark("made", bank_executor.entry_from_state))
    monkeypatch.setattr(SessionBank, "put", mark("stored", SessionBank.put))
    monkeypatch.setattr(SessionBank, "plan", mark("planned", SessionBank.plan))
    _strip_turn("tiny-dense", budget=None)
    made = [s for what, s in marks if what == "made"]
    assert made, "no render-ahead finished"
    by_step: dict[int, set] = {}
    for what, s in marks:
        by_step.setdefault(s, set()).add(what)
    assert all(len(kinds) == 1 for kinds in by_step.values()), by_step
