"""Quantized checkpoints on the CPU fast path: their layers are unpacked to fp32 at load (when the
fp32 copy fits), so their matmuls reach BLAS; the packed path stays one switch away."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
import numpy as np
import pytest

from mtplx import fast_path
from mtplx.catalog import resolve
from mtplx.engine import compute
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams

ON_FAST_PATH = fast_path.use_fp32(mx.default_device() == mx.cpu, 1)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 128)
        self.proj = nn.Linear(128, 192, bias=True)
        self.head = nn.Linear(192, 64, bias=False)

    def __call__(self, ids):
        return self.head(self.proj(self.embed(ids)))


class _OwnKernel(nn.QuantizedLinear):
    """A subclass with its own matmul (as sharded layers are): never unpacked."""


def _quantized(bits: int) -> _Tiny:
    mx.random.seed(3)
    model = _Tiny()
    nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("bits", [4, 8])
def test_unpacked_layers_compute_what_the_packed_ones_do(bits):
    model = _quantized(bits)
    ids = mx.array([[1, 7, 300, 511]])
    packed = model(ids)
    embed_packed = model.embed.as_linear(mx.ones((1, 128)))
    assert compute.dequantize(model) == 3
    assert [type(m) for m in (model.embed, model.proj, model.head)] == [nn.Embedding, nn.Linear, nn.Linear]
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    assert "bias" in model.proj and "bias" not in model.head
    # The same weight values; only the summation runs elsewhere (BLAS instead of the quantized kernel).
    np.testing.assert_allclose(np.array(model(ids)), np.array(packed), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(model.embed.as_linear(mx.ones((1, 128)))), np.array(embed_packed), rtol=1e-4, atol=1e-4)
    assert compute.dequantize(model) == 0  # nothing left to unpack


def test_layers_with_their_own_kernels_stay_packed():
    model = _quantized(4)
    own = _OwnKernel(192, 64, bias=False)
    model.head = own
    assert compute.dequantize(model) == 2 and model.head is own


@pytest.fixture(scope="module")
def four_bit(tmp_path_factory):
    """tiny-dense converted as users convert: trunk 4-bit, embedding/LM head 8-bit, head kept."""
    from mtplx.convert import convert

    dst = tmp_path_factory.mktemp("q") / "tiny-dense-4bit"
    convert(resolve("tiny-dense"), dst, bits=4, group_size=64)
    return dst


def _packed_layers(ck) -> int:
    modules = [m for m in (ck.model, ck.mtp) if m is not None]
    return sum(isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in modules for _, layer in m.named_modules())


@pytest.mark.skipif(not ON_FAST_PATH, reason="weights stay as stored off the CPU fast path")
def test_a_quantized_checkpoint_loads_unpacked_and_says_so(four_bit, monkeypatch):
    from mtplx.engine.checkpoint import load_checkpoint

    unpacked = load_checkpoint(four_bit)
    assert _packed_layers(unpacked) == 0 and "quantized layers unpacked" in unpacked.extras["compute"]
    monkeypatch.setenv(compute.DEQUANTIZE_ENV, "off")
    packed = load_checkpoint(four_bit)
    assert _packed_layers(packed) > 0 and "quantized layers packed" in packed.extras["compute"]
    # KV computed through one path never restores into the other (the bank keys entries by identity).
    assert packed.identity != unpacked.identity


@pytest.mark.skipif(not ON_FAST_PATH, reason="weights stay as stored off the CPU fast path")
def test_a_checkpoint_too_big_to_unpack_stays_packed(four_bit, monkeypatch):
    from mtplx.engine.checkpoint import load_checkpoint

    asked = []

    def fits(on_cpu, fp32_bytes):  # no room for the unpacked weights, room for the float tensors
        asked.append(fp32_bytes)
        return len(asked) > 1

    monkeypatch.setattr(fast_path, "use_fp32", fits)
    ck = load_checkpoint(four_bit)
    assert _packed_layers(ck) > 0 and "quantized layers packed" in ck.extras["compute"]
    assert ck.model.model.norm.weight.dtype == mx.float32  # the small float tensors are still cast
    assert asked[0] > asked[1]  # the unpacked copy was asked for first, and is the bigger one


@pytest.mark.skipif(not ON_FAST_PATH, reason="weights stay as stored off the CPU fast path")
def test_mtp_greedy_equals_ar_greedy_on_an_unpacked_checkpoint(four_bit):
    engine = Engine(four_bit, EngineConfig(chunk_size=64, depth=3), name="tiny-dense-4bit").start()
    try:
        prompt = tuple(engine.checkpoint.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Explain what the session bank keeps between turns."}], add_generation_prompt=True))
        params = SamplingParams(max_tokens=48, ignore_eos=True)
        ar = engine.submit(GenerationRequest(prompt, params, use_mtp=False)).result()
        mtp = engine.submit(GenerationRequest(prompt, params, use_mtp=True, depth=3)).result()
        assert mtp.token_ids == ar.token_ids and mtp.stats.verify_calls > 0
        assert mtp.stats.acceptance_by_depth[0] > 0.5  # the head drafts from the unpacked trunk's hiddens
    finally:
        engine.stop()


def test_models_says_how_a_quantized_checkpoint_runs_here(four_bit, monkeypatch):
    import json

    from typer.testing import CliRunner

    from mtplx.cli import app

    def row(out):
        return next(r for r in json.loads(out) if r["path"] == str(four_bit.resolve()))

    first = row(CliRunner().invoke(app, ["models", str(four_bit), "--json"]).stdout)
    plain = next(r for r in json.loads(CliRunner().invoke(app, ["models", "--json"]).stdout) if r["name"] == "tiny-dense")
    assert plain["weights_here"] is None  # not quantized: nothing to say
    if ON_FAST_PATH:
        assert first["weights_here"].startswith("stored 4-bit (group 64): unpacked to fp32 at load here")
    monkeypatch.setenv(compute.DEQUANTIZE_ENV, "off")
    text = CliRunner().invoke(app, ["models", str(four_bit)]).stdout
    if ON_FAST_PATH:
        assert f"stored 4-bit (group 64): kept packed ({compute.DEQUANTIZE_ENV}=off" in text
    monkeypatch.delenv(compute.DEQUANTIZE_ENV)
    monkeypatch.setattr(fast_path, "use_fp32", lambda on_cpu, fp32_bytes: False)
    if ON_FAST_PATH:
        assert "kept packed here (its fp32 copy" in row(CliRunner().invoke(app, ["models", str(four_bit), "--json"]).stdout)["weights_here"]
