"""Where models are found: the embedded tiny models by short name, a local directory, or a hub id
(`org/name`) already in the local Hugging Face cache.

Everything here reads files only (config.json, the safetensors header, tokenizer_config.json),
so `mtplx models` answers without importing MLX.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from mtplx import hub_cache
from mtplx.errors import ModelLoadError

ASSETS = Path(__file__).parent / "assets" / "models"
EMBEDDED = ("tiny-dense", "tiny-hybrid")


# The MTP layouts mtplx can load and speculate with (mtplx/engine/mtp_head.py builds them).
MTP_FAMILIES = ("qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "deepseek_v32", "glm4_moe",
                "glm4_moe_lite", "glm_moe_dsa")


def resolve(name_or_path: str | Path) -> Path:
    """A short embedded name, a directory path, or a cached hub id -> the model directory."""
    text = str(name_or_path)
    if text in EMBEDDED:
        path = ASSETS / text
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"embedded model {text!r} is missing from {path} (a broken install?)")
        return path
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if hub_cache.looks_like_repo_id(text):
        found, looked = hub_cache.snapshot(text)
        if found is not None:
            return found
        raise ModelLoadError(f"{text!r} is not in the local Hugging Face cache ({looked}; set HF_HUB_CACHE or "
                             f"HF_HOME to look elsewhere — mtplx never downloads)")
    raise ModelLoadError(f"{text!r} is neither an embedded model ({', '.join(EMBEDDED)}), a directory, "
                         f"nor a hub id (org/name) in the local Hugging Face cache {hub_cache.cache_dir()}")


def supported_architecture(config: dict) -> str | None:
    """The mlx-lm module that runs this config's model_type, or None (found without importing MLX)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    model_type = config.get("model_type")
    try:  # mlx-lm's own remapping table (mistral -> llama, ...), read as a literal from its source
        tree = ast.parse((root / "utils.py").read_text())
        remap = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                     and getattr(n.targets[0], "id", "") == "MODEL_REMAPPING")
    except (OSError, SyntaxError, StopIteration, ValueError):
        remap = {}
    module = remap.get(model_type, model_type)
    return module if isinstance(module, str) and (root / "models" / f"{module}.py").is_file() else None


def mtp_keys(tensors, config: dict) -> list[str]:
    """Weight names of the checkpoint's MTP module: `mtp.*` (Qwen3-Next / Qwen3.5) or the extra
    `model.layers.N.*` past the trunk (DeepSeek-V3 style, N = num_hidden_layers)."""
    text = config.get("text_config", config)
    n = text.get("num_hidden_layers")
    extra = {f"model.layers.{i}." for i in range(n, n + int(text.get("num_nextn_predict_layers") or 1))} if n else set()
    return [k for k in tensors if k.startswith("mtp.") or ".mtp." in k
            or any(k.startswith(p) or k.startswith("model.language_model." + p[len("model."):]) for p in extra)]


def cached() -> list[dict]:
    """Every model in the local Hugging Face cache that mtplx can run (an architecture mlx-lm knows,
    with safetensors weights), described from its files."""
    rows = []
    for repo_id, path in hub_cache.cached_models():
        try:
            row = describe(path, repo_id)
        except ModelLoadError:
            continue  # a broken or partial download is not a model one can run
        if row["runs"] and any(path.glob("model*.safetensors")):
            rows.append(row)
    return rows


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
    count = lambda keys: sum(_parameters(k, tensors, config.get("quantization")) for k in keys)
    head = set(mtp_keys(tensors, config))
    runs_on = supported_architecture(config)
    template, renderer = "", None
    tok_config = path / "tokenizer_config.json"
    if tok_config.is_file():
        settings = json.loads(tok_config.read_text())
        template, renderer = settings.get("chat_template") or "", settings.get("chat_template_type")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    template = re.sub(r"\{#.*?#\}", "", template, flags=re.S)  # what it does, not what its comments say
    layer_types = text.get("layer_types") or []
    return {
        "name": name or hub_cache.repo_id_of(path) or path.name,
        "path": str(path.resolve()),
        "architecture": config.get("model_type"),
        "layers": text.get("num_hidden_layers"),
        "recurrent_layers": sum(1 for t in layer_types if t in ("linear_attention", "conv", "mamba"))
        or str(text.get("hybrid_override_pattern") or "").count("M")  # Nemotron-H's block pattern
        or (text.get("num_hidden_layers", 0) - text.get("num_hidden_layers", 0) // text["full_attention_interval"]
            if "full_attention_interval" in text else 0),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "context_window": text.get("max_position_embeddings"),
        "parameters": count(k for k in tensors if k not in head),
        "runs": runs_on is not None,
        "quantization": config.get("quantization"),
        "mtp": bool(head) and config.get("model_type") in MTP_FAMILIES,
        "mtp_parameters": count(head),
        "mtp_notice": mtp_notice(config, bool(head), runs_on),
        "template": _RENDERERS.get(renderer) or {
            "chat": bool(template),
            "tools": "tools" in template,
            "thinking": "<think>" in template,
            "enable_thinking": "enable_thinking" in template,
            "calls": call_format_named(template),
        },
    }


# mlx-lm's Python chat encoders (a tokenizer config's chat_template_type; mtplx/chat_template.py):
# no text to read, so what each one renders is stated here
_RENDERERS = {"deepseek_v32": {"chat": True, "tools": True, "thinking": True, "enable_thinking": True, "calls": "dsml"}}


def call_format_named(template: str) -> str | None:
    """The tool-call format a template writes calls in, read from its text (no tokenizer, no MLX):
    what `mtplx models` shows; the engine decides from the loaded tokenizer (tool_formats.detect)."""
    if "<|channel|>" in template:
        return "harmony"
    if "｜DSML｜" in template:
        return "dsml"
    if "<｜tool▁calls▁begin｜>" in template:
        return "deepseek"
    if "<tool_call>" in template:
        return "<tool_call> xml" if "<function=" in template else "<tool_call>"
    return None


def mtp_notice(config: dict, has_head: bool, runs_on: str | None = "") -> str | None:
    """Why this checkpoint will decode autoregressively, in one sentence, or None when it speculates."""
    model_type = config.get("model_type")
    if runs_on is None:
        return None  # it does not load at all; that error says why
    if has_head and model_type in MTP_FAMILIES:
        return None
    if has_head:
        return (f"MTP weights for model_type {model_type!r} are not supported (mtplx speculates with "
                f"{', '.join(MTP_FAMILIES)}): decoding autoregressively")
    hint = " (mlx_lm.convert drops mtp.*; `mtplx convert` keeps it)" if model_type in MTP_FAMILIES[1:] else ""
    return f"no MTP head in this checkpoint{hint}: decoding autoregressively"


def _parameters(key: str, tensors: dict, quantization: dict | None) -> int:
    """Parameters a tensor stands for: a packed weight's unpacked size (its input width is its
    scales' groups times the group size, per layer where the config says so); scales and biases
    of quantized layers count as none."""
    shape = tensors[key]["shape"]
    base = key.rsplit(".", 1)[0]
    if quantization and (key.endswith((".scales", ".biases")) and f"{base}.weight" in tensors):
        return 0
    if quantization and tensors[key]["dtype"] == "U32" and f"{base}.scales" in tensors:
        group = (quantization.get(base) if isinstance(quantization.get(base), dict) else quantization).get("group_size", 64)
        return _numel(shape[:-1]) * tensors[f"{base}.scales"]["shape"][-1] * group
    return _numel(shape)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
