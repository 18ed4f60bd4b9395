"""The compute path of a loaded model: fp32 weights on the CPU backend when the fast path is on.

MLX's CPU backend sends only fp32 matmuls to BLAS (MKL when mtplx/fast_path.py loaded it); bf16
runs in MLX's own scalar loops. So a bf16 checkpoint is cast to fp32 once, at load, when the
fast path allows (mtplx.fast_path.use_fp32), and small forwards run MKL on one thread
(blas_threads). Knows parameters, dtypes and BLAS threads, never requests.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from mtplx import fast_path


@dataclass(frozen=True)
class ComputePath:
    label: str  # 'cpu fp32 + mkl', 'cpu bf16 reference blas', 'metal', ...
    cast: bool  # weights were cast from their stored dtype (the bank keys entries by this too)


def _floats(module) -> list[mx.array]:
    return [v for _, v in tree_flatten(module.parameters()) if mx.issubdtype(v.dtype, mx.floating)]


def prepare(model, mtp=None) -> ComputePath:
    """Cast `model` (and the MTP head) to fp32 where the fast path says so; name the path."""
    on_cpu = mx.default_device() == mx.cpu
    floats = _floats(model) + (_floats(mtp) if mtp is not None else [])
    cast = (any(v.dtype != mx.float32 for v in floats)
            and fast_path.use_fp32(on_cpu, sum(v.size for v in floats) * 4))
    if cast:
        # set_dtype's default predicate casts float tensors only: packed quantized weights stay.
        for module in filter(None, (model, mtp)):
            module.set_dtype(mx.float32)
            mx.eval(module.parameters())
        floats = _floats(model)
    dtype = {mx.float32: "fp32", mx.bfloat16: "bf16", mx.float16: "fp16"}.get(floats[0].dtype if floats else None, "mixed")
    if on_cpu and dtype == "fp32" and os.environ.get("MTPLX_CPU_ATTENTION", "on").lower() not in ("off", "0", "false"):
        from mtplx.engine import cpu_attention

        cpu_attention.install()  # MLX's CPU attention is exp-bound at agent context lengths (cpu_attention.py)
    return ComputePath(fast_path.label(on_cpu, dtype, fast_path.activate()), cast)


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
