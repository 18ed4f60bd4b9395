"""Loading a local Hugging Face or MLX model directory, keeping its MTP weights.

mlx-lm builds the trunk (so quantised MLX checkpoints and every architecture it knows load as
usual); its `sanitize` would drop or choke on `mtp.*` keys, so they are split off first and
loaded into an `MTPHead`. A directory without MTP weights loads and runs without speculation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def model_identity(path: Path) -> str:
    """A short stable hash of config, template and weights.

    Whole multi-GB weight files are not read at start-up: each contributes its size and a hash
    of its first and last 4 MiB, which changes whenever the tensors (or their header) change.
    """
    digest = hashlib.sha256()
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


def load_checkpoint(path: Path, name: str | None = None) -> Checkpoint:
    import mlx.core as mx
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import load_model

    from mtplx.engine.mtp_head import build_mtp_head, sanitize_mtp_weights

    path = Path(path).expanduser().resolve()
    config = read_config(path)
    files = weight_files(path)
    model_cls, args_cls = _architecture(config, path / "config.json")
    mtp_weights: dict[str, Any] = {}
    layout = {"hf": False}

    class KeepingMTP(model_cls):  # split mtp.* off before the architecture's own sanitize
        def sanitize(self, weights):
            # HF-layout conv1d (C,1,K) means this file also stores norms zero-centred.
            layout["hf"] = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())
            mtp_weights.update({k: v for k, v in weights.items() if k.startswith("mtp.")})
            rest = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
            return super().sanitize(rest) if hasattr(model_cls, "sanitize") else rest

    try:
        model, config = load_model(path, get_model_classes=lambda config: (KeepingMTP, args_cls))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ModelLoadError(f"{files[0] if len(files) == 1 else path}: weights do not fit the architecture in config.json ({exc})") from exc
    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:  # tokenizers raise many unrelated types for a bad file
        raise ModelLoadError(f"{path / 'tokenizer.json'}: tokenizer could not be loaded ({type(exc).__name__}: {exc})") from exc

    mtp = None
    if mtp_weights:
        model_type = config["model_type"]
        text_args = getattr(getattr(model, "language_model", None), "args", None) or model.args
        mtp = build_mtp_head(model_type, model.args, text_args)
        try:
            mtp.load_weights(list(sanitize_mtp_weights(mtp_weights, zero_centred=layout["hf"]).items()), strict=True)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: mtp.* weights do not fit one {model_type} decoder layer ({exc})") from exc
        mtp.set_dtype(model.model.embed_tokens.weight.dtype)
        mx.eval(mtp.parameters())
    return Checkpoint(name=name or path.name, path=path, config=config, model=model, tokenizer=tokenizer,
                      mtp=mtp, identity=model_identity(path), model_type=config["model_type"])

