"""Several projections of one input as one matmul, for the compiled short steps (compiled.py).

A decode step is dispatch-bound on the CPU: each Linear is a matmul plus its transposes and
reshapes, a few microseconds each whatever its size. Queries, keys and values (and an MLP's gate
and up projections, a GatedDeltaNet's four input projections) all read the same input, so their
weights are stacked into one matrix and multiplied once; the output is split back. Every output
column is still one dot product over the same input in the same order, so the values are those of
the separate Linears (tests/test_compiled_steps.py compares whole steps bit for bit).

The stacked matrix costs no memory: each Linear's weight becomes a row view of it, so mlx-lm's own
forward (prefill chunks) keeps working on the same buffer.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn


def fuse(linears: list) -> Callable[[mx.array], list[mx.array]] | None:
    """f(x) -> [linear(x) for linear in linears] as one matmul, or None where the layers are not
    all plain bias-free nn.Linear over the same input width (quantized or sharded ones keep
    their own calls)."""
    if len(linears) < 2 or any(type(m) is not nn.Linear or "bias" in m for m in linears):
        return None
    weights = [m.weight for m in linears]
    if len({w.shape[1] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
        return None
    stacked = mx.concatenate(weights)
    mx.eval(stacked)
    ends, end = [], 0
    for m, w in zip(linears, weights):
        m.weight = stacked[end : end + w.shape[0]]
        end += w.shape[0]
        ends.append(end)
    mx.eval([m.weight for m in linears])
    cuts = ends[:-1]
    return lambda x: mx.split(x @ stacked.T, cuts, axis=-1)


def swiglu_mlp(mlp) -> Callable[[mx.array], mx.array] | None:
    """The MLP down(silu(gate(x)) * up(x)) with gate and up as one matmul, for mlx-lm's dense
    Qwen-family MLPs (a mixture of experts keeps its own call), or None."""
    from mlx_lm.models.activations import swiglu
    from mlx_lm.models.qwen3 import MLP
    from mlx_lm.models.qwen3_next import Qwen3NextMLP

    if type(mlp) not in (MLP, Qwen3NextMLP):
        return None
    gate_up = fuse([mlp.gate_proj, mlp.up_proj])
    if gate_up is None:
        return None

    def forward(x: mx.array) -> mx.array:
        gate, up = gate_up(x)
        return mlp.down_proj(swiglu(gate, up))

    return forward
