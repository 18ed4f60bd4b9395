"""The layout of a sharded run: mode (tensor or pipeline parallel), world size, this rank, and the
pipeline split. Pure: it knows config dictionaries and numbers, never arrays.

`refusal` names, before any weight is read, the combinations mlx-lm's sharding cannot run:
head counts or widths a tensor-parallel split does not divide, more pipeline ranks than layers,
a split that does not add up. Whether the architecture has a `shard()` or `pipeline()` at all is
checked on the lazily built model (shard.py), where mlx-lm's own classes say it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplx.errors import MtplxError

MODES = ("tp", "pp")


class LayoutError(MtplxError):
    """A sharded run was asked for a combination it cannot run (refused at start)."""


@dataclass(frozen=True)
class Layout:
    mode: str  # "tp": every layer split across ranks; "pp": whole layers per rank
    world: int
    rank: int
    split: tuple[int, ...] = ()  # pp: layers per rank, rank 0 holding the LAST layers (mlx-lm's order)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not (isinstance(self.world, int) and self.world >= 2):
            raise ValueError(f"a sharded run needs a world size >= 2, got {self.world!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world):
            raise ValueError(f"rank must be in 0..{self.world - 1}, got {self.rank!r}")
        if self.split and (self.mode != "pp" or len(self.split) != self.world or min(self.split) < 1):
            raise ValueError(f"split {self.split!r}: only for pp, one positive layer count per rank ({self.world})")

    @property
    def tag(self) -> str:
        """What the bank's entry identity carries: a different layout is a different model."""
        split = "s" + "-".join(map(str, self.split)) if self.split else ""
        return f"{self.mode}{self.world}r{self.rank}{split}"

    def describe(self) -> dict:
        return {"mode": self.mode, "ranks": self.world, "rank": self.rank, "split": list(self.split) or None}


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def refusal(config: dict, layout: Layout) -> str | None:
    """Why `config` cannot run under `layout` (None when it can, as far as the config says)."""
    text, n = _text(config), layout.world
    layers = int(text.get("num_hidden_layers") or 0)
    if layout.mode == "pp":
        if layers < n:
            return f"pipeline parallel over {n} ranks needs at least {n} layers; the model has {layers}"
        if layout.split and sum(layout.split) != layers:
            return f"split {list(layout.split)} adds up to {sum(layout.split)} layers; the model has {layers}"
        return None
    widths = {
        "num_attention_heads": text.get("num_attention_heads"),
        "num_key_value_heads": text.get("num_key_value_heads"),
        "intermediate_size": text.get("intermediate_size"),
        "linear_num_key_heads": text.get("linear_num_key_heads"),
        "linear_num_value_heads": text.get("linear_num_value_heads"),
    }
    if not config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
        widths["vocab_size"] = text.get("vocab_size")  # an untied LM head is split by vocabulary
    for name, value in widths.items():
        if value is not None and int(value) % n:
            return f"tensor parallel over {n} ranks needs {name} divisible by {n}; the model has {value}"
    return None


def check(config: dict, layout: Layout) -> None:
    if (why := refusal(config, layout)) is not None:
        raise LayoutError(f"{config.get('model_type', 'this model')} cannot run sharded: {why}")
