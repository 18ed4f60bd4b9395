"""Loading: both embedded models through the real path (with MTP), and clear errors for bad dirs."""

from __future__ import annotations

import json
import shutil

import pytest

from mtplx.catalog import describe, resolve
from mtplx.engine.checkpoint import load_checkpoint
from mtplx.errors import ModelLoadError


@pytest.mark.parametrize("name,arch", [("tiny-dense", "qwen3"), ("tiny-hybrid", "qwen3_5")])
def test_embedded_models_load_with_mtp(name, arch):
    ck = load_checkpoint(resolve(name), name)
    assert ck.model_type == arch and ck.has_mtp and len(ck.identity) == 16
    info = describe(resolve(name), name)
    assert info["mtp"] and info["template"]["tools"] and info["template"]["thinking"]
    assert (info["recurrent_layers"] > 0) == (arch == "qwen3_5")


@pytest.fixture
def model_copy(tmp_path):
    dest = tmp_path / "model"
    shutil.copytree(resolve("tiny-dense"), dest)
    return dest


def test_model_without_mtp_weights_loads_without_speculation(model_copy):
    import mlx.core as mx

    path = str(model_copy / "model.safetensors")
    mx.save_safetensors(path, {k: v for k, v in mx.load(path).items() if not k.startswith("mtp.")})
    assert not load_checkpoint(model_copy).has_mtp


def _expect(path, *fragments):
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_missing_directory(tmp_path):
    _expect(tmp_path / "nope", "nope", "not a model directory")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    _expect(model_copy, "config.json", "missing")


def test_malformed_config(model_copy):
    (model_copy / "config.json").write_text("{not json")
    _expect(model_copy, "config.json", "not valid JSON")


def test_unknown_architecture(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps(config | {"model_type": "warp_drive"}))
    _expect(model_copy, "config.json", "warp_drive")


def test_wrong_shapes(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    _expect(model_copy, "model.safetensors", "do not fit")


def test_missing_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    _expect(model_copy, "safetensors")


def test_truncated_weights(model_copy):
    data = (model_copy / "model.safetensors").read_bytes()
    (model_copy / "model.safetensors").write_bytes(data[: len(data) // 3])
    _expect(model_copy, "model.safetensors")


def test_broken_tokenizer(model_copy):
    (model_copy / "tokenizer.json").write_text("{broken")
    _expect(model_copy, "tokenizer")


def test_missing_tokenizer_files(model_copy):
    # transformers would build a 9-token tokenizer from tokenizer_config.json alone
    (model_copy / "tokenizer.json").unlink()
    _expect(model_copy, "tokenizer has", "missing or incomplete")
