"""Background prefill steps aside between layers: a chunk undone and retried leaves exactly the
state an uninterrupted prefill leaves (attention KV and GatedDeltaNet state alike)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtplx.engine import preemption
from mtplx.engine.generation import Generation, StartPoint
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams


def _prefill(engine, prompt, yield_to=None):
    request = GenerationRequest(prompt, SamplingParams(max_tokens=1), source="render_ahead")
    gen = Generation(engine.runner, request, use_mtp=True, depth=1, chunk_size=32, eos_ids=set(), submitted_at=0.0)

    def run():
        stepped = sum(event is None for event in gen.prefill(StartPoint(), (), None, yield_to=yield_to))
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


def test_a_request_forward_never_asks():
    """Outside a background block the layer hook does nothing (no evaluation, no question)."""
    preemption.between_layers(mx.ones(3) + 1)  # no check installed: returns at once

    asked = []
    with preemption.preemptible(lambda: asked.append(1) or False):
        preemption.between_layers(mx.ones(2))
    preemption.between_layers(mx.ones(2))
    assert asked == [1]
