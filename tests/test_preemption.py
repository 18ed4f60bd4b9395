"""Background prefill steps aside between layers: a chunk undone and retried leaves exactly the
state an uninterrupted prefill leaves (attention KV and GatedDeltaNet state alike)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtplx.engine import preemption
from mtplx.engine.generation import Generation, StartPoint
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams


def _prefill(engine, prompt, yield_to=None, checkpoints=()):
    request = GenerationRequest(prompt, SamplingParams(max_tokens=1), source="render_ahead")
    gen = Generation(engine.runner, request, use_mtp=True, depth=1, chunk_size=32, eos_ids=set(), submitted_at=0.0)
    gen.captured = {}

    def keep(position, recurrent):  # the bank's checkpoint hook: recurrent arrays at `position`
        gen.captured[position] = [np.array(a) for layer in recurrent if layer is not None for a in layer]

    def run():
        events = gen.prefill(StartPoint(), checkpoints, keep if checkpoints else None, yield_to=yield_to)
        stepped = sum(event is None for event in events)
        mx.eval([c.state for c in gen.state.trunk] + [gen.state.mtp.state, gen.last_hidden])
        return stepped, gen

    return engine.call(run)


def _arrays(gen) -> list[np.ndarray]:
    out = []
    for c in gen.state.trunk:
        if hasattr(c, "keys"):
            out += [np.array(c.keys[..., : c.offset, :]), np.array(c.values[..., : c.offset, :])]
        else:
            out += [np.array(a) for a in c.cache]
    m = gen.state.mtp
    return out + [np.array(m.keys[..., : m.offset, :]), np.array(m.values[..., : m.offset, :]), np.array(gen.last_hidden)]


def test_stepping_aside_mid_chunk_leaves_the_state_of_an_uninterrupted_prefill(engine):
    tok = engine.checkpoint.tokenizer
    prompt = tuple(tok.apply_chat_template([{"role": "user", "content": "Explain the bank's anchors in detail. " * 8}],
                                           add_generation_prompt=True))
    assert len(prompt) > 3 * 32
    _, whole = _prefill(engine, prompt)
    asked = []

    def waiting() -> bool:  # a request "arrives" at a different layer of every other chunk
        asked.append(1)
        return len(asked) % 7 == 3

    stepped, interrupted = _prefill(engine, prompt, waiting)
    layers = len(engine.runner.inner.layers)
    assert stepped >= 2 and len(asked) > layers * 3  # asked at every layer, stepped aside several times
    assert interrupted.state.length == whole.state.length == len(prompt)
    for a, b in zip(_arrays(interrupted), _arrays(whole), strict=True):
        assert np.array_equal(a, b)


def test_checkpoints_inside_a_chunk_survive_stepping_aside(engine):
    """The bank's checkpoints inside a chunk (recurrent state kept mid-forward): a chunk undone
    and retried captures them exactly once, equal to an uninterrupted prefill's."""
    tok = engine.checkpoint.tokenizer
    prompt = tuple(tok.apply_chat_template([{"role": "user", "content": "Summarise the receipts table. " * 10}],
                                           add_generation_prompt=True))
    checkpoints = (20, 45, 77)
    _, whole = _prefill(engine, prompt, checkpoints=checkpoints)
    asked = []
    _, interrupted = _prefill(engine, prompt, lambda: asked.append(1) or len(asked) % 5 == 2, checkpoints)
    assert sorted(interrupted.captured) == sorted(whole.captured) == list(checkpoints)
    for p in checkpoints:
        for a, b in zip(interrupted.captured[p], whole.captured[p], strict=True):
            assert np.array_equal(a, b)
    for a, b in zip(_arrays(interrupted), _arrays(whole), strict=True):
        assert np.array_equal(a, b)


def test_a_request_forward_never_asks():
    """Outside a background block the layer hook does nothing (no evaluation, no question)."""
    preemption.between_layers(mx.ones(3) + 1)  # no check installed: returns at once

    asked = []
    with preemption.preemptible(lambda: asked.append(1) or False):
        preemption.between_layers(mx.ones(2))
    preemption.between_layers(mx.ones(2))
    assert asked == [1]


def test_a_request_arriving_mid_chunk_is_served_before_the_render_ahead_resumes(tmp_path):
    """The engine asks between layers only for requests: a request submitted while a render-ahead
    chunk computes makes it step aside, is served, and the render-ahead then resumes and completes;
    the request's output is what it is without any render-ahead."""
    from mtplx.bank.bank import BankConfig
    from mtplx.catalog import resolve
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.events import Finished, Restored
    from mtplx.replay.live_agent import AgentSession
    from mtplx.synth.agent import Sizes, conversation
    from mtplx.synth.corpus import Corpus

    engine = Engine(resolve("tiny-dense"), EngineConfig(chunk_size=16), name="tiny-dense", bank=BankConfig()).start()
    plain = Engine(resolve("tiny-dense"), EngineConfig(chunk_size=16), name="tiny-dense").start()
    order, stepped, extra = [], [], []
    engine.listeners.append(lambda e: order.append(type(e).__name__) if isinstance(e, (Restored, Finished)) else None)
    roll_back = preemption.roll_back

    def counted(cache, marked):
        stepped.append(1)
        order.append("stepped aside")
        roll_back(cache, marked)

    between = preemption.between_layers
    request = GenerationRequest(tuple(engine.checkpoint.tokenizer.encode("An unrelated question about sorting.")),
                                SamplingParams(max_tokens=8), session="other")

    def arrive(x):  # inside a render-ahead chunk: a client's request lands now, once
        if preemption.active() and not extra:
            extra.append(engine.submit(request))
        between(x)

    try:
        session = AgentSession("agent", conversation(305, Corpus(), Sizes(20, 60), 3))
        prompt, chat = session.next_request(engine.checkpoint.tokenizer)
        first = engine.submit(GenerationRequest(tuple(prompt), SamplingParams(max_tokens=64), chat=chat,
                                                session="agent")).result()
        engine.settle()  # the first turn's render-ahead (if any) is done: the next is the one interrupted
        session.send_back(first.reply)
        prompt, chat = session.next_request(engine.checkpoint.tokenizer)
        preemption.roll_back, preemption.between_layers = counted, arrive
        engine.submit(GenerationRequest(tuple(prompt), SamplingParams(max_tokens=64), chat=chat, session="agent")).result()
        engine.settle()
        preemption.roll_back, preemption.between_layers = roll_back, between
        assert extra, "no render-ahead chunk ran after the turn"
        served = extra[0].result()
        at = order.index("stepped aside")
        assert order[at + 1:at + 3] == ["Restored", "Finished"]  # stepped aside, then the request ran at once
        assert engine.health()["idle_work"] is False  # the render-ahead resumed and ran to its end
        assert served.token_ids == plain.submit(GenerationRequest(request.prompt, request.sampling)).result().token_ids
    finally:
        preemption.roll_back, preemption.between_layers = roll_back, between
        engine.stop()
        plain.stop()


def test_one_engines_background_prefill_never_reaches_another_thread():
    """Two engines in one process (the TUI's and a replay arm's, tests): one thread's background
    block must not make the other thread's request forwards evaluate, ask or step aside."""
    import threading

    seen = []
    with preemption.preemptible(lambda: True):
        other = threading.Thread(target=lambda: seen.append((preemption.active(), preemption.between_layers(None))))
        other.start()
        other.join()
        assert preemption.active()
    assert seen == [(False, None)] and not preemption.active()
