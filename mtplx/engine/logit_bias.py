"""OpenAI's `logit_bias`: a fixed amount added to chosen tokens' logits before anything is drawn.

The same at every position, so it is a history-free rule: it shapes greedy drafts inside the lazy
draft chain, every verify row and each autoregressive pick alike, and MTP under a bias keeps what
autoregressive decoding under it keeps. -100 bans a token in practice, +100 all but forces it.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx


class LogitBias:
    history_free = True

    def __init__(self, bias: Sequence[tuple[int, float]]):
        self.bias = tuple(bias)
        self._vectors: dict[int, mx.array] = {}  # by vocabulary width

    def apply(self, logits: mx.array, history: Sequence[int] = ()) -> mx.array:
        width = logits.shape[-1]
        if width not in self._vectors:
            ids = [t for t, _ in self.bias if t < width]
            vector = mx.zeros((width,), dtype=mx.float32)
            if ids:
                vector[mx.array(ids)] = mx.array([b for t, b in self.bias if t < width], dtype=mx.float32)
            self._vectors[width] = vector
        return logits + self._vectors[width].astype(logits.dtype)
