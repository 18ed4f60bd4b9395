"""Loading a checkpoint onto one rank: lazily, then shard with mlx-lm's own per-class `shard()`
(tensor parallel) or `pipeline()` (pipeline parallel), then evaluate — so a rank reads and keeps
only its own part of the weights. The MTP head is loaded whole on every rank (replicated): it is
one decoder layer, and every rank drafts the same tokens from the same hidden states.

What mlx-lm supports decides what runs: an architecture without `shard()` refuses tp, one whose
text model has no `pipeline()` refuses pp (in mlx-lm 0.32: qwen3 tp only, qwen3_next pp only,
qwen3_5 both). mtplx's capturing GatedDeltaNet (engine/gdn_capture.py) sums its output across
ranks as mlx-lm's layer does.
"""

from __future__ import annotations

from pathlib import Path

from mtplx.distributed.group import Group
from mtplx.distributed.layout import LayoutError, check


def shard_model(model, group: Group) -> str:
    """Shard a lazily loaded trunk in place for `group`'s layout; returns the layout tag."""
    layout = group.layout
    kind = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
    if layout.mode == "tp":
        if not hasattr(model, "shard"):
            raise LayoutError(f"mlx-lm's {kind} has no shard(): it cannot run tensor parallel (try --shard pp)")
        model.shard(group.group)
    else:
        from mtplx.engine.checkpoint import text_inner

        inner = text_inner(model)
        if inner is None or not hasattr(inner, "pipeline"):
            raise LayoutError(f"mlx-lm's {kind} has no pipeline(): it cannot run pipeline parallel (try --shard tp)")
        try:
            inner.pipeline(group.group, split=list(layout.split) or None)
        except ValueError as exc:
            raise LayoutError(f"pipeline split refused: {exc}") from exc
    return layout.tag


def load_sharded(path: Path, group: Group, name: str | None = None):
    """This rank's Checkpoint: refused at start for an unsupported combination, else sharded.
    Its identity names the layout, so a bank entry from another layout is a clean miss."""
    from mtplx.engine.checkpoint import load_checkpoint, read_config

    check(read_config(Path(path)), group.layout)
    return load_checkpoint(path, name, shard=lambda model: shard_model(model, group))
