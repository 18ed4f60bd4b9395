"""`mtplx convert`: a Hugging Face checkpoint -> an MLX directory whose MTP head survives.

mlx-lm's own convert drops `mtp.*` (its sanitize removes them), so the MLX checkpoints people
download have no head. Here the trunk is loaded, cast and quantized with mlx-lm's own functions
(the architecture's quant predicate included, group size as mlx-lm's), and the head is converted
to MLX layout (norms shifted, experts stacked), kept in bf16 unless `head_bits` asks for it to be
quantized too, and written as `mtp.*` tensors in `model-mtp.safetensors` next to the trunk's shards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mtplx.errors import MtplxError

_DTYPES = ("bfloat16", "float16", "float32")
# Everything but the weights travels unchanged: tokenizer, template, generation config.
_SKIP = ("config.json", "model.safetensors.index.json")


def convert(src: Path, dst: Path, bits: int | None = 4, group_size: int = 64, head_bits: int | None = None,
            dtype: str = "bfloat16", embed_bits: int | None = None) -> dict:
    """Write the converted checkpoint to `dst` (which must not exist); returns a summary.

    `embed_bits`: bits of the embedding and LM head. They are shared with the MTP head, which
    drafts through them, so when there is a head they default to 8 bits: on the Qwen3.5 stand-in
    a uniform 4-bit conversion lost 0.052 of depth-1 acceptance, 8-bit embeddings none
    (docs/models.md). Without a head they follow `bits`, as in mlx-lm."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.utils import quantize_model, save_config, save_model

    from mtplx.engine.checkpoint import load_head, load_trunk

    src, dst = Path(src).expanduser().resolve(), Path(dst).expanduser()
    if any(b not in (None, 2, 3, 4, 5, 6, 8) for b in (bits, head_bits, embed_bits)):
        raise MtplxError(f"bits must be one of 2, 3, 4, 5, 6, 8 (got trunk {bits}, head {head_bits}, embedding {embed_bits})")
    if dtype not in _DTYPES:
        raise MtplxError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if dst.exists():
        raise MtplxError(f"{dst} already exists (convert never writes over a directory)")
    trunk = load_trunk(src)
    model, config = trunk.model, dict(trunk.config)
    if "quantization" in config and bits is not None:
        raise MtplxError(f"{src} is already quantized ({config['quantization']}); convert a full-precision checkpoint")
    head = load_head(trunk, src) if trunk.head_weights else None

    target = getattr(mx, dtype)
    cast = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(target) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
    config["torch_dtype"] = dtype
    config.pop("quantization_config", None)
    embed_bits = embed_bits or (8 if head is not None and bits is not None and bits < 8 else bits)
    if bits is not None:
        own = getattr(model, "quant_predicate", None)

        def predicate(path, module):  # the architecture's own rules (MoE gates at 8 bits) first
            rule = own(path, module) if own is not None else True
            if rule is True and embed_bits != bits and path.endswith(("embed_tokens", "lm_head")):
                return {"group_size": group_size, "bits": embed_bits}
            return rule

        model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    summary = {"trunk": f"{bits}-bit (group {group_size}{'' if embed_bits == bits else f', embedding/LM head {embed_bits}-bit'})"
               if bits else dtype, "head": None}

    dst.mkdir(parents=True)
    try:
        save_model(dst, model, donate_model=True)
        save_config(config, dst / "config.json")
        if head is not None:
            head.update(tree_map_with_path(
                lambda k, v: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v, head.parameters()))
            if head_bits is not None:
                nn.quantize(head, group_size, head_bits, class_predicate=lambda p, m: hasattr(m, "to_quantized")
                            and m.weight.shape[-1] % group_size == 0)
            tensors = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
            mx.save_safetensors(str(dst / "model-mtp.safetensors"), tensors, metadata={"format": "mlx"})
            _add_to_index(dst / "model.safetensors.index.json", tensors, "model-mtp.safetensors")
            summary["head"] = f"{head_bits}-bit (group {group_size})" if head_bits else dtype
        for item in src.iterdir():
            if item.is_file() and not item.name.endswith(".safetensors") and item.name not in _SKIP:
                shutil.copy(item, dst / item.name)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)  # never leave a half-written model behind
        raise
    return summary


def _add_to_index(index_file: Path, tensors: dict, file_name: str) -> None:
    index = json.loads(index_file.read_text()) if index_file.is_file() else {"metadata": {}, "weight_map": {}}
    index["weight_map"].update({k: file_name for k in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_file.write_text(json.dumps(index, indent=4))
