"""Where models are found: the embedded tiny models by short name, or any local directory.

Everything here reads files only (config.json, the safetensors header, tokenizer_config.json),
so `mtplx models` answers without importing MLX.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from mtplx.errors import ModelLoadError

ASSETS = Path(__file__).parent / "assets" / "models"
EMBEDDED = ("tiny-dense", "tiny-hybrid")


def resolve(name_or_path: str | Path) -> Path:
    """A short embedded name or a directory path -> the model directory."""
    if str(name_or_path) in EMBEDDED:
        path = ASSETS / str(name_or_path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"embedded model {name_or_path!r} is missing from {path} (a broken install?)")
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{name_or_path!r} is neither an embedded model ({', '.join(EMBEDDED)}) nor a directory")
    return path


def safetensors_header_metadata(path: Path) -> dict:
    """The `__metadata__` strings of a safetensors file (read from its header only)."""
    return _read_header(path).get("__metadata__") or {}


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor names, dtypes and shapes."""
    header = _read_header(path)
    header.pop("__metadata__", None)
    return header


def _read_header(path: Path) -> dict:
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ModelLoadError(f"{path}: too short to be a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ModelLoadError(f"{path}: header length {size} is implausible (corrupt file?)")
        try:
            header = json.loads(fh.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: header is not a JSON object")
    return header


def describe(path: Path, name: str | None = None) -> dict:
    """What a model directory holds, read from its files."""
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_file}: cannot be read as JSON ({exc})") from exc
    text = config.get("text_config", config)
    tensors: dict = {}
    for wf in sorted(path.glob("model*.safetensors")):
        tensors.update(safetensors_header(wf))
    count = lambda keys: sum(_numel(tensors[k]["shape"]) for k in keys)
    mtp_keys = [k for k in tensors if k.startswith("mtp.")]
    template = ""
    tok_config = path / "tokenizer_config.json"
    if tok_config.is_file():
        template = json.loads(tok_config.read_text()).get("chat_template") or ""
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    layer_types = text.get("layer_types") or []
    return {
        "name": name or path.name,
        "path": str(path.resolve()),
        "architecture": config.get("model_type"),
        "layers": text.get("num_hidden_layers"),
        "recurrent_layers": sum(1 for t in layer_types if t == "linear_attention")
        or (text.get("num_hidden_layers", 0) - text.get("num_hidden_layers", 0) // text["full_attention_interval"]
            if "full_attention_interval" in text else 0),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "context_window": text.get("max_position_embeddings"),
        "parameters": count(k for k in tensors if not k.startswith("mtp.")),
        "mtp": bool(mtp_keys),
        "mtp_parameters": count(mtp_keys),
        "template": {
            "chat": bool(template),
            "tools": "tools" in template,
            "thinking": "<think>" in template,
            "enable_thinking": "enable_thinking" in template,
        },
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
