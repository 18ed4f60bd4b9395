"""The engine thread's contract: event order, stops, cancellation, fairness, errors."""

from __future__ import annotations

import pytest

from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.errors import RequestError
from mtplx.events import DraftVerified, Finished, FirstToken, PrefillProgress, Queued, Restored, Tokens


def _prompt(engine, text="Explain src/ledger/events.py"):
    tok = engine.checkpoint.tokenizer
    return tuple(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def test_event_order(dense_engine):
    events = list(dense_engine.submit(GenerationRequest(_prompt(dense_engine), SamplingParams(max_tokens=12), depth=2)))
    kinds = [type(e) for e in events]
    assert kinds[:2] == [Queued, Restored] and kinds[-1] is Finished
    assert kinds.index(PrefillProgress) < kinds.index(FirstToken) < kinds.index(Tokens)
    assert DraftVerified in kinds
    finished = events[-1]
    assert "".join(e.text for e in events if isinstance(e, Tokens)) == finished.text
    assert sum(len(e.token_ids) for e in events if isinstance(e, Tokens)) == finished.completion_tokens
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert progress[-1].done == progress[-1].total == len(_prompt(dense_engine))


def test_queued_comes_first_even_when_a_listener_is_slow(dense_engine):
    """Queued is published before the engine thread can pick the request up: a slow listener on it
    once let the engine's Restored event overtake it, and the receipt writer dropped the restore."""
    import time

    seen = []

    def listener(event):
        if isinstance(event, Queued):
            time.sleep(0.3)  # the engine thread would admit and restore meanwhile
        seen.append(event)

    dense_engine.listeners.append(listener)
    try:
        request = GenerationRequest(_prompt(dense_engine), SamplingParams(max_tokens=3))
        events = list(dense_engine.submit(request))
    finally:
        dense_engine.listeners.remove(listener)
    assert [type(e) for e in events][:2] == [Queued, Restored]
    assert [type(e) for e in seen if e.request_id == request.request_id][:2] == [Queued, Restored]


def test_max_tokens_gives_length(engine):
    fin = engine.submit(GenerationRequest(_prompt(engine), SamplingParams(max_tokens=5))).result()
    assert fin.finish_reason == "length" and fin.completion_tokens == 5


def test_stop_string_is_not_in_the_text(dense_engine):
    from mtplx.engine.text_stream import HIDDEN, visible_mask

    # A raw prompt continues as plain content (chat turns of the tiny model are mostly tool calls).
    prompt = tuple(dense_engine.checkpoint.tokenizer.encode("import os\nimport sys\n\n\ndef main():"))
    full = dense_engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=60))).result().text
    visible = visible_mask(full, in_reasoning=False)
    start = next(i for i in range(10, len(visible) - 4) if HIDDEN not in visible[i:i + 4])  # stops match content only
    stop = full[start:start + 4]
    fin = dense_engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=60, stop=(stop,)))).result()
    assert fin.finish_reason == "stop" and fin.text == full[: visible.index(stop)]


def test_cancel_stops_generation(dense_engine):
    sub = dense_engine.submit(GenerationRequest(_prompt(dense_engine), SamplingParams(max_tokens=400)))
    for event in sub:
        if isinstance(event, Tokens):
            sub.cancel()
        if isinstance(event, Finished):
            assert event.finish_reason == "cancelled" and event.completion_tokens < 400


def test_prompt_over_context_window_is_refused_at_submit(dense_engine):
    with pytest.raises(RequestError, match="context window"):
        dense_engine.submit(GenerationRequest(tuple([5] * (dense_engine.context_window + 1))))


def test_sessions_are_served_round_robin(dense_engine):
    idle = Engine(dense_engine.model_path, EngineConfig())
    idle._ready.set()  # queue without a thread: only the ordering is under test
    idle.checkpoint = dense_engine.checkpoint
    subs = [idle.submit(GenerationRequest((1, 2), session=s)) for s in ["a", "a", "a", "b"]]
    order = [idle._next().request.session for _ in subs]
    assert order == ["a", "b", "a", "a"]


def test_seeded_sampling_repeats(engine):
    req = lambda: GenerationRequest(_prompt(engine), SamplingParams(max_tokens=20, temperature=0.9, seed=5))
    assert engine.submit(req()).result().token_ids == engine.submit(req()).result().token_ids


def test_presence_and_frequency_penalties_decode_autoregressively_and_change_the_reply(dense_engine):
    """OpenAI's penalties are honoured (Qwen3's cards recommend presence_penalty 1.5): with them
    each position depends on the reply before it, so the request decodes AR, not MTP."""
    prompt = _prompt(dense_engine)
    # past its end of turn the tiny model repeats itself: room for the penalties to show
    plain = dense_engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=160, ignore_eos=True))).result()
    penalised = dense_engine.submit(GenerationRequest(prompt, SamplingParams(
        max_tokens=160, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0))).result()
    assert penalised.stats.mode == "ar" and penalised.token_ids != plain.token_ids
    repeats = lambda ids: len(ids) - len(set(ids))
    assert repeats(penalised.token_ids) < repeats(plain.token_ids)


def test_a_launched_engine_shortens_the_gil_switch_interval(monkeypatch):
    """`mtplx serve` / `tui` / `generate` (launch.open_engine) let the thread that streams the
    engine's output in after 0.5 ms, not Python's 5 ms; MTPLX_SWITCH_INTERVAL_US sets it, a bad
    value is ignored. An Engine started on its own leaves the interpreter's setting alone."""
    import sys

    from mtplx import launch

    set_to = []
    monkeypatch.setattr(sys, "setswitchinterval", set_to.append)

    class Started:
        listeners: list = []

        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            return self

    monkeypatch.setattr(launch, "Engine", Started)
    fitted = []
    monkeypatch.setattr(launch, "fit_helper", fitted.append)
    monkeypatch.delenv(launch.SWITCH_INTERVAL_ENV, raising=False)
    launch.open_engine("tiny-dense", bank=False, receipts=False)
    assert set_to == [pytest.approx(launch.SWITCH_INTERVAL_S)]
    assert len(fitted) == 1  # and the small-row kernel's helper fitted to the model (test_small_gemm)
    monkeypatch.setenv(launch.SWITCH_INTERVAL_ENV, "5000")
    assert launch.switch_interval() == pytest.approx(0.005)
    for bad, want in (("soon", 0.0005), ("nan", 0.0005), ("-3", 1e-6), ("1e12", 1.0)):
        monkeypatch.setenv(launch.SWITCH_INTERVAL_ENV, bad)
        assert launch.switch_interval() == pytest.approx(want)
    import inspect

    from mtplx.engine import engine as engine_module

    assert "setswitchinterval" not in inspect.getsource(engine_module)


def test_step_macs_count_the_trunk_and_the_lm_head_once(dense_engine):
    """What a serving process sizes the small-row kernel's helper by (launch.fit_helper): the
    tiny model's matmul weights per token, its tied embedding counted once, as the LM head."""
    config = dense_engine.checkpoint.config
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    assert dense_engine.runner.step_macs() == layers * per_layer + config["vocab_size"] * h
