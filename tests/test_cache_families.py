"""Families whose caches are not one attention KV per layer restore their sessions too.

- LFM2 (Liquid): short-convolution layers keep a recurrent state (an mlx-lm ArraysCache) that is
  not a GatedDeltaNet. mtplx read "recurrent" from GatedDeltaNet layers alone, so no checkpoint was
  ever taken there and every turn was cold (the planner refused to cut an end state back).
- DeepSeek-V3.2 (and GLM-5, which runs on its class): each layer's cache is a CacheList of the
  latent KV and the sparse-attention indexer's keys. The bank could not snapshot it: every commit
  failed ("cannot snapshot cache layer of type CacheList") and nothing was ever reused.
- Falcon-H1: a CacheList of a Mamba-2 state and attention KV in every layer (both kinds at once:
  recurrent checkpoints and snapshots must line up cache by cache).
- Nemotron-H (NVIDIA's Mamba-2 hybrids): its mlx-lm class keeps the text model under `.backbone`
  with `.embeddings`, so mtplx refused to load it at all.

On stand-ins in each layout, the next turn restores most of its history, the greedy reply equals
the cold engine's token for token, and the state comes back from the SSD tier after a restart.

A background prefill that steps aside mid-chunk (preemption.py) put back attention KV and
GatedDeltaNet state only: a CacheList's caches and a sliding-window ring (gpt-oss, Gemma) kept the
undone part of the chunk, and its retry wrote those tokens twice.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import standins
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.generation import Generation, StartPoint
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.state import snapshot
from test_window_restore import two_turns_then_restart  # the same two-turn conversation


def _standin(kind, root):
    if kind == "gpt_oss":
        tok = standins.family_tokenizer("gptoss", root / "tok")
        specials = {t["content"]: t["id"] for t in json.loads((tok / "tokenizer.json").read_text())["added_tokens"]}
        return standins.build("gpt_oss", root / "model", tok, generation_config={"eos_token_id": [specials["<|return|>"]]})
    tok = standins.family_tokenizer("deepseek_v3_1", root / "tok") if kind == "deepseek_v32" else standins.SHARED
    return standins.build(kind, root / "model", tok)


@pytest.fixture(scope="module", params=["lfm2", "deepseek_v32", "falcon_h1", "nemotron_h"])
def model(request, tmp_path_factory):
    return _standin(request.param, tmp_path_factory.mktemp(request.param))


def test_the_next_turn_restores_and_equals_cold(model, tmp_path):
    run = two_turns_then_restart(model, tmp_path)
    first, second, restored = run["first"], run["second"], run["restored"]
    assert [first.token_ids, second.token_ids] == run["cold"]  # restored == cold
    assert restored.source == "ram" and restored.cached_tokens > 0.8 * first.prompt_tokens, restored
    # a restart: the state comes back from the SSD tier
    again = run["again_restored"]
    assert run["again"] == run["cold"][1]
    assert again.source == "ssd" and again.cached_tokens == second.prompt_tokens - 1, again


@pytest.mark.parametrize("kind", ["lfm2", "deepseek_v32", "falcon_h1", "gpt_oss"])
def test_stepping_aside_mid_chunk_leaves_the_state_of_an_uninterrupted_prefill(kind, tmp_path):
    engine = Engine(_standin(kind, tmp_path), EngineConfig()).start()
    prompt = tuple(engine.checkpoint.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain the bank's anchors in detail. " * 12}], add_generation_prompt=True))

    def prefill(yield_to=None):
        request = GenerationRequest(prompt, SamplingParams(max_tokens=1), source="render_ahead")
        gen = Generation(engine.runner, request, use_mtp=False, depth=1, chunk_size=32, eos_ids=set(), submitted_at=0.0)
        stepped = sum(event is None for event in gen.prefill(StartPoint(), (), None, yield_to=yield_to))
        state = [np.array(a) for s in snapshot.snapshot(gen.state.trunk) for a in s.arrays if a is not None]
        return stepped, state + [np.array(gen.last_hidden.astype(mx.float32))]

    asked = []

    def waiting() -> bool:  # a request "arrives" before the second layer, then at other layers
        asked.append(1)
        return len(asked) % 5 == 2

    try:
        assert len(prompt) > 3 * 32
        _, whole = engine.call(prefill)
        stepped, interrupted = engine.call(lambda: prefill(waiting))
    finally:
        engine.stop()
    assert stepped >= 2
    assert len(interrupted) == len(whole)
    for a, b in zip(interrupted, whole):
        assert np.array_equal(a, b)
