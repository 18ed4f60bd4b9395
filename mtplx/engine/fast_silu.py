"""The MLP's SwiGLU on the CPU fast path, with its exponent in vectorised arithmetic.

mlx-lm's `swiglu(gate, x)` is silu(gate) * x, and MLX's CPU sigmoid takes each exponent through
its scalar `simd::exp<float, 1>`, whose fused multiply-adds are calls into libm (the wheel is
built without FMA): ~25 ns a value here. A Qwen-family MLP takes one per intermediate unit per
token, so in a 4-row MTP round on tiny-dense (16 verify tokens x 640 units x 4 layers, plus the
head) the sigmoid cost about as much as a third of all the matmuls, growing with every row and
every verify token (perf, side by side: 2,000 verifies of 1 vs 4 rows). Here e^-g = 2^n * e^r:
2^n from its exponent bits (n + 127) << 23, r by Cody-Waite reduction, e^r a
degree-7 polynomial, all plain multiplies and adds that MLX's compiled kernels run as vectorised
loops. Relative error against float64 at most 1.5e-7 (MLX's own sigmoid: 3.7e-6).

The bits differ from MLX's sigmoid in the last places, so it is installed for the whole process
(every mlx-lm module's `swiglu`, hence prefill, decode, verify, batch rows and the MTP head all
compute it the same way) and the model identity names it (compute.ComputePath.salt): a bank
entry computed with the other SiLU never restores into this one. Only on the CPU backend with
fp32 compute, on x86-64 (fast_path.vector_silu_wanted); `MTPLX_VECTOR_SILU=off` keeps MLX's
sigmoid. bench/vector_silu.py measures it against MLX's, side by side.

A GatedDeltaNet's convolution output goes through a SiLU too (512 values a token a layer on
tiny-hybrid, against 640 in its MLP). Those layers are mtplx's own (gdn_capture.py), so `silu`
below is switched on per layer (`vector_silu`, set when the runner installs them), which every
path of that layer (prefill, capture, compiled step) reads.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu  # kept: install() replaces the module's name


_LOG2E = 1.4426950408889634
_ROUND = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds a float32 below 2**22 to an integer
_LN2_HI = 0.693145751953125  # 16 significant bits: n * _LN2_HI is exact for |n| <= 127
_LN2_LO = 1.428606765330187e-06


def _exponent(gate: mx.array) -> tuple[mx.array, mx.array]:
    """e^-gate as (e^r, the bit pattern of 2^n) with -gate = n ln 2 + r, |r| <= ln 2 / 2: n is
    rounded from -gate log2 e (clamped to 2^n's normal range) and r taken with ln 2 in two parts
    (Cody-Waite), so the product's rounding does not reach the result. The bits (n + 127) << 23
    are made as a float and converted here, inside the compiled kernel: only the view to float32
    is left outside it (a decode step's MLP pays one op more than with MLX's sigmoid)."""
    z = -gate
    n = (mx.clip(z * _LOG2E, -126.0, 127.0) + _ROUND) - _ROUND  # round to nearest, exactly
    r = (z - n * _LN2_HI) - n * _LN2_LO
    p = 1.9841270e-4  # e^r by its Taylor series to r^7 / 7!: below 1e-8 on |r| <= 0.347
    p = p * r + 1.3888889e-3
    p = p * r + 8.3333333e-3
    p = p * r + 4.1666667e-2
    p = p * r + 1.6666667e-1
    p = p * r + 0.5
    p = p * r + 1.0
    return p * r + 1.0, ((n + 127.0) * 8388608.0).astype(mx.int32)


def _gated(gate: mx.array, x: mx.array, p: mx.array, scale: mx.array) -> mx.array:
    return gate * x / (1.0 + p * scale)


def _silu(x: mx.array, p: mx.array, scale: mx.array) -> mx.array:
    return x / (1.0 + p * scale)


# Shapeless (a prefill chunk's shape changes chunk to chunk). The bit view between them cannot be
# traced shapeless, so it runs as one op of its own; inside a shaped compile (compiled.py's layer
# steps) the whole function is traced with the layer.
_exponent_c = mx.compile(_exponent, shapeless=True)
_gated_c = mx.compile(_gated, shapeless=True)
_silu_c = mx.compile(_silu, shapeless=True)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's activations.swiglu computes it, for float32 inputs."""
    if gate.dtype != mx.float32 or x.dtype != mx.float32:
        return mlx_lm_swiglu(gate, x)
    p, bits = _exponent_c(gate)
    return _gated_c(gate, x, p, bits.view(mx.float32))


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x), for float32 input (a GatedDeltaNet's convolution output: gdn_capture.py and
    compiled.py's recurrent step, where the layer says so)."""
    if x.dtype != mx.float32:
        return nn.silu(x)
    p, bits = _exponent_c(x)
    return _silu_c(x, p, bits.view(mx.float32))


def install() -> None:
    """Make every mlx-lm model module (loaded now or later) call `swiglu` above."""
    from mlx_lm.models import activations

    activations.swiglu = swiglu  # modules imported later take it from here
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "swiglu", None) is mlx_lm_swiglu:
            module.swiglu = swiglu

