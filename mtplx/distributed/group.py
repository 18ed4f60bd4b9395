"""Joining the ring and the two collectives mtplx adds to the model's own: a broadcast of bytes
from rank 0 and a gather of a few integers from every rank. Every collective here runs under the
watchdog, so a peer that hangs or vanishes ends every rank with one line instead of a silent hang.

Knows MLX's distributed group and the environment `mlx.launch` (or launch.py) sets; never models.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from mtplx.distributed.layout import Layout, LayoutError
from mtplx.distributed.watchdog import Watchdog

DEFAULT_TIMEOUT_S = 60.0  # a prefill chunk of a large model on a slow link stays well under this


def launched() -> bool:
    """Whether this process was started as one rank of a ring (by mlx.launch or launch.py)."""
    return bool(os.environ.get("MLX_HOSTFILE")) and os.environ.get("MLX_RANK") is not None


class Group:
    """This rank's view of the ring: its layout, the MLX group, and the watchdog."""

    def __init__(self, group, layout: Layout, watchdog: Watchdog):
        self.group, self.layout, self.watchdog = group, layout, watchdog

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world(self) -> int:
        return self.layout.world

    def watch(self, what: str):
        return self.watchdog.watch(what)

    def gather_ints(self, values: list[int], what: str) -> list[list[int]]:
        """Every rank's `values` (same length on every rank), in rank order. Values are int32."""
        with self.watch(what):
            out = mx.distributed.all_gather(mx.array([values], dtype=mx.int32), group=self.group)
            mx.eval(out)
        return out.tolist()

    def broadcast_bytes(self, data: bytes | None, length: int, what: str) -> bytes:
        """Rank 0's `data` (`length` bytes, told to every rank beforehand) on every rank."""
        if length == 0:
            return b""
        with self.watch(what):
            if self.rank == 0:
                mine = mx.array(np.frombuffer(data, dtype=np.uint8).astype(np.int32))
            else:
                mine = mx.zeros((length,), dtype=mx.int32)
            out = mx.distributed.all_sum(mine, group=self.group)
            mx.eval(out)
        return np.asarray(out).astype(np.uint8).tobytes()

    def from_rank0(self, x: mx.array) -> mx.array:
        """`x` as rank 0 computed it, on every rank, lazily (inside the caller's graph): the others
        add zeros, so the sum is rank 0's bits exactly. The zeros still depend on `x`: a collective
        whose input is ready early could otherwise run before the model's own collectives on one
        rank and after them on another, pairing the wrong operations across ranks."""
        if self.rank != 0:
            x = mx.where(mx.array(False), x, mx.zeros_like(x))
        return mx.distributed.all_sum(x, group=self.group)


def join(mode: str, split: tuple[int, ...] = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> Group:
    """Join the ring this process was launched into and agree on the layout: every rank must have
    been started with the same mode and split, or every rank refuses to start."""
    if not launched():
        raise LayoutError("a sharded run must be launched as ranks: `mtplx serve --shard tp --ranks N`, or under "
                          "`mlx.launch` (MLX_HOSTFILE and MLX_RANK are not set)")
    if not mx.distributed.is_available():
        raise LayoutError("this MLX build has no distributed backend")
    try:
        group = mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as exc:
        raise LayoutError(f"could not join the ring ({exc})") from exc
    if group.size() < 2:
        raise LayoutError(f"the ring has {group.size()} rank; a sharded run needs at least 2")
    layout = Layout(mode, group.size(), group.rank(), tuple(split))
    joined = Group(group, layout, Watchdog(group.rank(), timeout_s))
    mine = [("tp", "pp").index(mode), len(split), *(list(split) + [0] * (64 - len(split)))[:64]]
    everyone = joined.gather_ints(mine, "the start-up handshake")
    if any(row != everyone[0] for row in everyone):
        raise LayoutError(f"ranks were started with different layouts: {everyone[0][:2 + everyone[0][1]]} on rank 0, "
                          f"{mine[:2 + len(split)]} on rank {layout.rank}")
    return joined
