"""Sliding-window models (gpt-oss, Gemma 2/3) restore past their window. A sliding-window layer's
ring buffer drops tokens once the window fills, so an entry's end state cannot be cut back to an
earlier anchor; the prefill now takes a checkpoint of those layers at the anchors it passes, as it
does of recurrent state. On stand-ins with a 64-token window and prompts of ~350 tokens, the next
turn restores its history (it restored nothing before: "cold", ceiling 0), the greedy reply is the
cold engine's token for token, and the checkpoints survive a restart through the SSD tier.""" 

from __future__ import annotations

import json

import pytest

import standins
from mtplx.bank.bank import BankConfig
from mtplx.bank.ssd import SsdConfig
from mtplx.chat import chat_request
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.sampling import SamplingParams
from mtplx.events import Restored

FIRST = [{"role": "system", "content": "You are a careful agent in a repository. " * 25},
         {"role": "user", "content": "Explain the layout of this repository, please. " * 8}]
SECOND = FIRST + [{"role": "assistant", "content": "It has src, tests and docs."},
                  {"role": "user", "content": "What is in docs?"}]


@pytest.fixture(scope="module", params=["gpt_oss", "gemma3"])
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt_oss":
        tok = standins.family_tokenizer("gptoss", root / "tok")
        specials = {t["content"]: t["id"] for t in json.loads((tok / "tokenizer.json").read_text())["added_tokens"]}
        return standins.build("gpt_oss", root / "model", tok, generation_config={
            "eos_token_id": [specials["<|return|>"], specials["<|call|>"]]})
    return standins.build("gemma3", root / "model", standins.family_tokenizer("gemma3", root / "tok"))


def _run(engine, messages):
    request = chat_request(engine.checkpoint.tokenizer, messages, session="s",
                           sampling=SamplingParams(max_tokens=12, temperature=0))
    return engine.submit(request).result()


def two_turns_then_restart(model, tmp_path):
    """The conversation on a cold engine, on a banked one (RAM and an SSD tier), and its second
    turn again on a new engine over the same SSD directory: {"cold": both turns' ids, "first",
    "second": the banked turns' results, "restored": the second turn's Restored, "again": the
    restarted turn's ids, "again_restored": its Restored, "window": the smallest sliding window}."""
    cold = Engine(model, EngineConfig(chunk_size=64)).start()
    try:
        out = {"cold": [_run(cold, FIRST).token_ids, _run(cold, SECOND).token_ids]}
    finally:
        cold.stop()
    for key in ("first", "again"):
        engine, seen = Engine(model, EngineConfig(chunk_size=64), bank=BankConfig(),
                              ssd=SsdConfig(tmp_path, budget_bytes=64 << 20, free_floor_bytes=0)).start(), []
        engine.listeners.append(lambda e: seen.append(e) if isinstance(e, Restored) else None)
        try:
            if key == "first":
                out["window"] = min((c.max_size for c in engine.runner.new_trunk_cache() if hasattr(c, "max_size")),
                                    default=None)
                out["first"], out["second"] = _run(engine, FIRST), _run(engine, SECOND)
                out["restored"] = seen[-1]
            else:
                out["again"], out["again_restored"] = _run(engine, SECOND).token_ids, seen[-1]
        finally:
            engine.stop()
    return out


def test_the_next_turn_restores_past_the_window_and_equals_cold(model, tmp_path):
    run = two_turns_then_restart(model, tmp_path)
    first, second, restored, window = run["first"], run["second"], run["restored"], run["window"]
    assert window is not None
    assert [first.token_ids, second.token_ids] == run["cold"]  # restored == cold
    assert restored.cached_tokens > 4 * window, restored  # well past the window
    # at an anchor inside the first turn's prompt: its end state could not be cut back to it
    assert restored.cached_tokens < first.prompt_tokens, restored
    # after a restart, the second turn's entry (prompt + reply, past the window) cut back to the
    # checkpoint at its prompt's end, from the SSD tier: the one point a repeat can start from
    again = run["again_restored"]
    assert run["again"] == run["cold"][1]
    assert again.source == "ssd" and again.cached_tokens == second.prompt_tokens - 1, again


LONG_SYSTEM = {"role": "system", "content": "You are a careful agent in a repository. " * 40}  # ~6 windows


def _cold_ids(model, messages) -> tuple:
    """The greedy reply's ids on an engine without a bank."""
    cold = Engine(model, EngineConfig(chunk_size=64)).start()
    try:
        return _run(cold, messages).token_ids
    finally:
        cold.stop()


def test_a_turn_arriving_while_another_decodes_restores_past_the_window(model):
    """A turn over the same long system prompt, sent while another decodes: it restores that
    turn's prompt at the checkpoint the prefill took at the head (the sliding-window layers' live
    state is past it, and they cannot be cut back; on Gemma the head its template folds into the
    first user turn: bank/folded_head.py), and answers as a cold engine."""
    import dataclasses
    import time

    lead, late = ([LONG_SYSTEM, {"role": "user", "content": text}] for text in
                  ("Explain the layout of this repository, please. " * 4, "What is in docs?"))

    def request(engine, messages, session, tokens):
        r = chat_request(engine.checkpoint.tokenizer, messages, session=session,
                         sampling=SamplingParams(max_tokens=tokens, temperature=0))
        return dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, ignore_eos=True)) if tokens > 12 else r

    expected = _cold_ids(model, late)
    engine, first = Engine(model, EngineConfig(chunk_size=64), bank=BankConfig()).start(), []
    engine.listeners.append(lambda e: first.append(e) if type(e).__name__ == "FirstToken" else None)
    try:
        running = engine.submit(request(engine, lead, "lead", 200))
        deadline = time.monotonic() + 60
        while not first and time.monotonic() < deadline:
            time.sleep(0.001)
        fin = engine.submit(request(engine, late, "late", 12)).result()
        assert running.result().finish_reason == "length"
        window = min(c.max_size for c in engine.runner.new_trunk_cache() if hasattr(c, "max_size"))
        assert fin.cached_tokens > 4 * window, fin.cached_tokens
        assert fin.token_ids == expected
    finally:
        engine.stop()


def test_a_new_session_restores_the_head_though_the_template_has_no_system_turn(model):
    """A second session over the same system prompt restores it whole, at the head anchor: also
    on Gemma, whose template writes the system prompt into the first user turn (no turn marker
    ends it: bank/folded_head.py), where it restored nothing before. Equal to cold."""
    first, second = ([LONG_SYSTEM, {"role": "user", "content": text}] for text in ("Explain the layout, please.", "What is in docs?"))
    expected = _cold_ids(model, second)
    engine, seen = Engine(model, EngineConfig(chunk_size=64), bank=BankConfig()).start(), []
    engine.listeners.append(lambda e: seen.append(e) if isinstance(e, Restored) else None)
    try:
        _run(engine, first)
        request = chat_request(engine.checkpoint.tokenizer, second, session="another",
                               sampling=SamplingParams(max_tokens=12, temperature=0))
        fin = engine.submit(request).result()
        head = engine.call(lambda: next(a.position for a in engine.bank.plan(request.prompt, use_mtp=False,
                                                                               chat=request.chat).anchors if a.kind == "head"))
    finally:
        engine.stop()
    window = min(c.max_size for c in engine.runner.new_trunk_cache() if hasattr(c, "max_size"))
    assert seen[-1].anchor == "head" and fin.cached_tokens == head > 4 * window, (seen[-1], head)
    assert fin.token_ids == expected
