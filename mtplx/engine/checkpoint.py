"""Loading a local Hugging Face or MLX model directory, keeping its MTP weights.

mlx-lm builds the trunk (so quantised MLX checkpoints and every architecture it knows load as
usual); its `sanitize` would drop or choke on the MTP module's weights (`mtp.*`, or DeepSeek-V3's
extra `model.layers.N.*`), so they are split off first and loaded into an `MTPHead` in the layout
the head's own tensors say. A directory without MTP weights, or of an architecture mtplx cannot
speculate with, or whose MTP weights do not fit, loads and runs autoregressively with one notice
saying why.
""" 

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtplx.engine.generation_config import GenerationConfig
from mtplx.errors import ModelLoadError

_HASH_EDGE = 4 << 20  # bytes hashed at each end of a weight file (see model_identity)


@dataclass
class Checkpoint:
    name: str
    path: Path
    config: dict
    model: Any  # mlx_lm nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    mtp: Any | None  # MTPHead or None
    identity: str
    model_type: str
    extras: dict = field(default_factory=dict)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    mtp_notice: str | None = None  # why this checkpoint decodes autoregressively, when it does
    tool_format: Any = None  # mtplx.tool_formats.ToolFormat chosen from the template, or None

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a model directory (it does not exist or is not a folder)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{config_file}: missing (every model directory needs a config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{config_file}: no 'model_type' string, so the architecture is unknown")
    return config


def weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no model*.safetensors weight files")
    return files


def model_identity(path: Path, compute: str = "") -> str:
    """A short stable hash of config, template and weights (and `compute`, the dtype the weights
    were cast to at load, if any: a bank entry computed in bf16 must not restore into fp32).

    Whole multi-GB weight files are not read at start-up: each contributes its size and a hash
    of its first and last 4 MiB, which changes whenever the tensors (or their header) change.
    """
    digest = hashlib.sha256(f"compute:{compute}".encode() if compute else b"")
    for name in ("config.json", "tokenizer_config.json", "chat_template.jinja", "tokenizer.json"):
        if (path / name).is_file():
            digest.update(name.encode() + (path / name).read_bytes())
    for wf in weight_files(path):
        size = wf.stat().st_size
        with wf.open("rb") as fh:
            head = fh.read(_HASH_EDGE)
            fh.seek(max(0, size - _HASH_EDGE))
            tail = fh.read(_HASH_EDGE)
        digest.update(f"{wf.name}:{size}".encode() + head + tail)
    return digest.hexdigest()[:16]


def _architecture(config: dict, config_file: Path):
    from mlx_lm.utils import _get_classes  # mlx-lm's own architecture lookup (remappings included)

    try:
        return _get_classes(config)
    except ValueError as exc:
        raise ModelLoadError(f"{config_file}: model_type {config['model_type']!r} is not an architecture mlx-lm supports") from exc


@dataclass
class Trunk:
    """A loaded trunk, and the MTP module's weights split off before the trunk saw them."""

    model: Any
    config: dict
    head_weights: dict
    sanitize: Any  # the architecture's own sanitize (the head's layer may need it), or None


def load_trunk(path: Path, lazy: bool = False) -> Trunk:
    from mlx_lm.utils import load_model

    from mtplx.engine import mtp_head as heads

    config = read_config(path)
    files = weight_files(path)
    model_cls, args_cls = _architecture(config, path / "config.json")
    model_type = config["model_type"]
    layers = int(config.get("text_config", config).get("num_hidden_layers") or 0)
    head_weights: dict[str, Any] = {}
    own = {}

    class KeepingMTP(model_cls):  # split the MTP module off before the architecture's own sanitize
        def sanitize(self, weights):
            rest, head = heads.split_mtp_weights(weights, model_type, layers)
            head_weights.update(head)
            own["sanitize"] = super().sanitize if hasattr(model_cls, "sanitize") else None
            return own["sanitize"](rest) if own["sanitize"] else rest

    try:
        model, config = load_model(path, lazy=lazy, get_model_classes=lambda config: (KeepingMTP, args_cls))
    except (ValueError, KeyError, TypeError, RuntimeError, AttributeError, IndexError) as exc:
        raise ModelLoadError(f"{files[0] if len(files) == 1 else path}: weights do not fit the architecture in config.json ({exc})") from exc
    return Trunk(model, config, head_weights, own.get("sanitize"))


def _check_vocabulary(path: Path, tokenizer, config: dict) -> None:
    """A tokenizer far smaller than the model's vocabulary is a directory without its tokenizer
    files: transformers then builds a near-empty tokenizer from tokenizer_config.json alone, and
    the model would answer every prompt from a handful of ids. (A model's vocab_size is often
    padded a little past its tokenizer's; never by half.)"""
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) < vocab // 2:
        raise ModelLoadError(f"{path}: the tokenizer has {len(tokenizer)} tokens for a model of {vocab}; its files "
                             f"are missing or incomplete (tokenizer.json, or vocab.json + merges.txt)")


def load_checkpoint(path: Path, name: str | None = None, shard=None) -> Checkpoint:
    """`shard`: called with the lazily loaded trunk before any weight is evaluated (mtplx/distributed/
    shard.py); it returns the layout tag, which the identity then names."""
    import mlx.core as mx
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mtplx import catalog, hub_cache, tool_formats
    from mtplx.engine.compute import prepare as prepare_compute
    from mtplx.engine.sampling import SamplingParams

    path = Path(path).expanduser().resolve()
    generation = GenerationConfig.read(path, read_config(path))
    try:
        generation.defaults(SamplingParams())
    except ValueError as exc:
        raise ModelLoadError(f"{path / 'generation_config.json'}: {exc}") from exc
    trunk = load_trunk(path, lazy=shard is not None)
    model, config = trunk.model, trunk.config
    layout = shard(model) if shard is not None else None  # this rank's part only is read below
    model_type = config["model_type"]
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=list(generation.eos_token_ids) or None)
    except Exception as exc:  # tokenizers raise many unrelated types for a bad file
        raise ModelLoadError(f"{path / 'tokenizer.json'}: tokenizer could not be loaded ({type(exc).__name__}: {exc})") from exc
    _check_vocabulary(path, tokenizer, config)

    moe_on_cpu = _moe_to_float32(model) if mx.default_device() == mx.cpu else False
    mtp, notice = None, catalog.mtp_notice(config, bool(trunk.head_weights))
    if trunk.head_weights and notice is None:
        try:
            mtp = load_head(trunk, path)
        except ModelLoadError as exc:  # the trunk is fine: serve it, and say why there is no speculation
            notice = f"the MTP weights could not be used ({exc}): decoding autoregressively"
    if mtp is not None:
        mx.eval(mtp.parameters())
    compute = prepare_compute(model, mtp)  # the CPU fast path: fp32 weights (see engine/compute.py)
    if layout is not None:
        mx.eval(model.parameters())
    return Checkpoint(name=name or hub_cache.repo_id_of(path) or path.name, path=path, config=config, model=model,
                      tokenizer=tokenizer, mtp=mtp, identity=model_identity(path, compute.salt) + (f"@{layout}" if layout else ""),
                      model_type=model_type, extras={"moe_float32": moe_on_cpu, "compute": compute.label, "layout": layout},
                      generation=generation, mtp_notice=notice,
                      tool_format=tool_formats.detect(tokenizer))


# Names mlx-lm's text models give their token embedding.
_EMBEDDINGS = ("embed_tokens", "wte", "tok_embeddings", "embed_in", "word_embeddings", "embeddings")


def text_outer(model):
    """The causal LM: a multimodal wrapper (Gemma 3, Qwen3.5) holds it under `.language_model`."""
    return getattr(model, "language_model", model)


def text_inner(model):
    """The text model returning post-norm hidden states: mlx-lm's `.model`, or `.backbone` in its
    Mamba-family classes (Nemotron-H, Mamba)."""
    outer = text_outer(model)
    return getattr(outer, "model", None) or getattr(outer, "backbone", None)


def text_embedding(model):
    """The text model's token embedding, or None."""
    inner = text_inner(model)
    return next((getattr(inner, n) for n in _EMBEDDINGS if hasattr(inner, n)), None)


def _float_dtype(model):
    """The trunk's compute dtype: the embedding's, or its scales' when the embedding is quantized."""
    embed = text_embedding(model)
    return embed.scales.dtype if hasattr(embed, "scales") else embed.weight.dtype


def _moe_to_float32(model) -> bool:
    """MLX's CPU backend runs the mixture-of-experts matmul (`gather_mm`) in float32 only, so a
    bf16 MoE trunk is computed in float32 on CPU (quantized weights stay packed)."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchGLU

    has_moe = any(isinstance(m, SwitchGLU) for _, m in model.named_modules())
    if not has_moe or _float_dtype(model) == mx.float32:
        return False
    model.set_dtype(mx.float32)
    return True


def load_head(trunk: Trunk, path: Path):
    """The MTP head in MLX layout, its float tensors in the trunk's float dtype."""
    from mtplx.engine import mtp_head as heads

    model, model_type, weights = trunk.model, trunk.config["model_type"], trunk.head_weights
    text_args = getattr(text_outer(model), "args", None) or model.args
    try:
        if model_type in heads.LAYER_N and trunk.sanitize is not None:
            # The architecture's own sanitize converts the head (fp8 dequantisation, kv_b_proj
            # split, expert stacking), run on its tensors renamed as if they were trunk layer 0's.
            at, own = "model.layers.0.", "model.layers.0.mtp_head."
            renamed = {(at + k[len("layers.0."):] if k.startswith("layers.0.") else own + k): v for k, v in weights.items()}
            converted = trunk.sanitize(renamed)
            weights = {(k[len(own):] if k.startswith(own) else "layers.0." + k[len(at):]): v
                       for k, v in converted.items() if k.startswith(at)}
        experts = int(getattr(text_args, "num_experts", 0) or getattr(text_args, "n_routed_experts", 0) or 0)
        weights = heads.sanitize_mtp_weights(weights, model_type, experts)
        mtp = heads.build_mtp_head(model_type, model.args, text_args)
        if any(k.endswith(".scales") for k in weights):
            heads.quantize_like(mtp, weights)
        mtp.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: the MTP weights do not fit one {model_type} decoder layer ({exc})") from exc
    # Cast only the head's float tensors to the trunk's float dtype; packed weights keep theirs.
    mtp.update(_cast_floats(mtp.parameters(), _float_dtype(model)))
    return mtp


def _cast_floats(tree, dtype):
    import mlx.core as mx
    from mlx.utils import tree_map

    return tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, tree)
