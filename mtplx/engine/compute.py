"""The compute path of a loaded model: fp32 weights on the CPU backend when the fast path is on.

MLX's CPU backend sends only fp32 matmuls to BLAS (MKL when mtplx/fast_path.py loaded it); bf16
runs in MLX's own scalar loops. So a bf16 checkpoint is cast to fp32 once, at load, when the
fast path allows (mtplx.fast_path.use_fp32), and small forwards run MKL on one thread
(blas_threads). Knows parameters, dtypes and BLAS threads, never requests.

A quantized checkpoint (an MLX 4- or 8-bit conversion) is dequantized to fp32 there too: MLX's
CPU `quantized_matmul` never reaches BLAS either, and a 4-bit tiny-dense decoded at ~0.3x the
speed of its fp32 twin, where MTP did not pay at all (bench/dequantize.py). The same memory rule
holds (the whole fp32 copy within half of physical memory), so a model that would not fit stays
packed; MTPLX_CPU_DEQUANTIZE=off keeps it packed anyway (8x the weights' memory of 4-bit).
Only plain quantized Linear and Embedding layers are unpacked; mixture-of-experts and sharded
layers keep their own quantized kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mtplx import fast_path, native_build


DEQUANTIZE_ENV = fast_path.DEQUANTIZE_ENV
_PACKED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


@dataclass(frozen=True)
class ComputePath:
    label: str  # 'cpu fp32 + mkl', 'cpu bf16 reference blas', 'metal', ...
    cast: bool  # weights were cast (or dequantized) from how they were stored (the bank keys entries by this too)
    dequantized: int = 0  # quantized layers unpacked to fp32 (the label also counts those left packed)
    vector_silu: bool = False  # the MLP's SiLU is fast_silu's (other bits than MLX's sigmoid)

    @property
    def salt(self) -> str:
        """What the model identity adds for this path: KV computed through packed quantized
        matmuls must not restore into their unpacked twins, nor bf16 into fp32, nor values
        computed with one SiLU into a process computing with the other."""
        dtype = ("fp32-unpacked" if self.dequantized else "fp32") if self.cast else ""
        return dtype + ("+silu" if self.vector_silu else "")


def _floats(module) -> list[mx.array]:
    return [v for _, v in tree_flatten(module.parameters()) if mx.issubdtype(v.dtype, mx.floating)]


def _packed(module) -> list[tuple[str, nn.Module]]:
    """The plain quantized Linear / Embedding layers (exact types: subclasses such as sharded
    layers run their own kernels), with their paths."""
    return [(path, m) for path, m in module.named_modules() if type(m) in _PACKED]


def _unpacked_size(layer: nn.Module) -> int:
    """Elements of the layer's weight once dequantized (its packed uint32 words hold 32 / bits each)."""
    return layer.weight.size * 32 // layer.bits


def dequantize(module: nn.Module) -> int:
    """Replace every plain quantized Linear / Embedding of `module` by the float layer holding
    the same weights dequantized to fp32 (a quantized matmul's values, summed by BLAS instead).
    Returns how many layers were replaced."""
    swaps = []
    for path, layer in _packed(module):
        weight = mx.dequantize(layer.weight, layer.scales, layer.get("biases"), group_size=layer.group_size,
                               bits=layer.bits, mode=getattr(layer, "mode", "affine")).astype(mx.float32)
        if isinstance(layer, nn.QuantizedLinear):
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in layer)
            if "bias" in layer:
                plain.bias = layer.bias.astype(mx.float32)
        else:
            plain = nn.Embedding(weight.shape[0], weight.shape[1])
        plain.weight = weight
        mx.eval(plain.parameters())  # one layer at a time: the packed and unpacked copies never all coexist
        swaps.append((path, plain))
    if swaps:
        module.update_modules(tree_unflatten(swaps))
    return len(swaps)


def prepare(model, mtp=None) -> ComputePath:
    """Cast `model` (and the MTP head) to fp32 where the fast path says so, unpacking its
    quantized layers when the whole fp32 copy fits too; name the path."""
    on_cpu = mx.default_device() == mx.cpu
    modules = [m for m in (model, mtp) if m is not None]
    floats = [v for m in modules for v in _floats(m)]
    packed = [layer for m in modules for _, layer in _packed(m)]
    float_bytes = sum(v.size for v in floats) * 4
    unpack = (bool(packed) and fast_path.dequantize_wanted()
              and fast_path.use_fp32(on_cpu, float_bytes + sum(_unpacked_size(p) for p in packed) * 4))
    cast = unpack or (any(v.dtype != mx.float32 for v in floats) and fast_path.use_fp32(on_cpu, float_bytes))
    dequantized = 0
    if cast:
        for module in modules:
            if unpack:
                dequantized += dequantize(module)
            # set_dtype's default predicate casts float tensors only: packed quantized weights stay.
            module.set_dtype(mx.float32)
            mx.eval(module.parameters())
        floats = _floats(model)
    dtype = {mx.float32: "fp32", mx.bfloat16: "bf16", mx.float16: "fp16"}.get(floats[0].dtype if floats else None, "mixed")
    label = fast_path.label(on_cpu, dtype, fast_path.activate())
    if on_cpu and dtype == "fp32" and native_build.switched_on(native_build.CPU_ATTENTION_ENV):
        from mtplx.engine import cpu_attention

        cpu_attention.install()  # MLX's CPU attention is exp-bound at agent context lengths (cpu_attention.py)
        if cpu_attention.kernel()[0] is not None:
            label += " + attention kernel"
    vector_silu = on_cpu and dtype == "fp32" and fast_path.vector_silu_wanted()
    if vector_silu:
        from mtplx.engine import fast_silu

        fast_silu.install()  # MLX's CPU sigmoid is a scalar exp per value (fast_silu.py)
        label += " + vector silu"
    if not on_cpu:
        from mtplx.engine import gpu_attention

        if gpu_attention.wanted():
            gpu_attention.install()  # CUDA builds multi-query attention per shape (gpu_attention.py)
            label += " + short-step attention"
    left = len(packed) - dequantized
    if dequantized:
        label += f", {dequantized} quantized layers unpacked"
    if left and on_cpu:
        label += f", {left} quantized layers packed"
    return ComputePath(label, cast, dequantized, vector_silu)


@functools.cache
def _mkl():
    """The loaded libmkl_rt (None when MLX's BLAS here is not MKL)."""
    blas = fast_path.activate()
    return ctypes.CDLL(blas.library) if blas.kind == "mkl" else None


@contextlib.contextmanager
def blas_threads(n: int):
    """Run MKL on `n` threads inside the block (no-op without MKL).

    Decode and verify forwards multiply 1-5 rows: split over threads they wait on an OpenMP team
    wake-up per call (each worker sleeps at once, KMP_BLOCKTIME=0), and on this shared 2-core box a
    descheduled worker stalls the whole call; one thread ran a 4-token verify ~2-4x faster. Bits do
    not change with the thread count under MKL_CBWR=STRICT (checked), so exactness is untouched.
    The count is read at each BLAS call, so the block must contain the `mx.eval`."""
    lib = _mkl()
    if lib is None:
        yield
        return
    before = lib.MKL_Get_Max_Threads()
    lib.MKL_Set_Num_Threads(n)
    try:
        yield
    finally:
        lib.MKL_Set_Num_Threads(before)
