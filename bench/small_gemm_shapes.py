"""The small-row kernel against MKL, product by product, on the embedded models' weight shapes.

    python bench/small_gemm_shapes.py [--rows 1 2 3 4 5 8 16 20] [--reps 7]

For each weight shape (N x K, as MLX's Linear hands it to cblas_sgemm: x @ W.T) and row count M,
the best of `--reps` timings of a burst of calls through the kernel on one thread, the kernel with
its helper thread (as mtplx runs it on two cores or more) and MKL's own cblas_sgemm on one thread
(as decoding runs it: engine/compute.blas_threads), in turn, in one process (the weights stay warm
in cache, as they do between the layers of a tiny model). Where the kernel was built with its
AVX-512 tiles, the same kernel with its AVX2 tiles on one thread too (`avx2 us`, and `avx2/wide`:
how much the sixteen lanes save). Prints microseconds per product, the kernel's GFLOP/s and its
ratios, and its cost at M rows over its cost at one row: what a verify over M = k + 1 tokens pays
in matmul next to a decode step. Asserts nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from mtplx import fast_path, small_gemm  # noqa: E402

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
# (N, K): attention q/o, k/v, MLP gate/up, MLP down, a GatedDeltaNet in_proj_qkv, the LM head.
SHAPES = [(256, 256), (128, 256), (640, 256), (256, 640), (512, 256), (4096, 256)]


def _sgemm(fn):
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                        ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return fn


def timed(fn, m: int, n: int, k: int, x, w, c, reps: int) -> float:
    calls = max(3, int(3e7 / (2 * m * n * k)))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn(ROW_MAJOR, NO_TRANS, TRANS, m, n, k, 1.0, x, k, w, k, 0.0, c, n)
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16, 20])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    blas = fast_path.activate()
    if fast_path.KERNEL is None:
        sys.exit(f"the small-row kernel is not active here: {blas.kernel_reason or blas.reason}")
    kernel = _sgemm(fast_path.KERNEL.cblas_sgemm)
    mkl_lib = ctypes.CDLL(str(fast_path.mkl_library()))
    mkl_lib.MKL_Set_Num_Threads(1)
    mkl = _sgemm(mkl_lib.cblas_sgemm)  # MKL's own, not the scope's
    threads = ctypes.c_int.in_dll(fast_path.KERNEL, "mtplx_small_threads")
    helper = threads.value

    def alone(*a, wide=True):
        threads.value = 0
        small_gemm.set_wide(fast_path.KERNEL, wide and small_gemm.wide())
        try:
            return timed(kernel, *a)
        finally:
            threads.value = helper
            small_gemm.set_wide(fast_path.KERNEL, small_gemm.wide())

    rng = np.random.default_rng(0)
    wide = small_gemm.wide()
    print(f"{small_gemm.name()}; helper thread {'on' if helper else 'off (MTPLX_SMALL_GEMM_THREADS or one core)'}; "
          "MKL on one thread")
    print(f"{'N x K':>10} {'M':>3} {'1 thread us':>11} {'helper us':>9} {'GFLOP/s':>8} {'MKL us':>8} "
          f"{'helper/1':>8} {'kernel/MKL':>10} {'cost / M=1':>10}" + (f" {'avx2 us':>8} {'avx2/wide':>9}" if wide else ""))
    for n, k in SHAPES:
        w = rng.standard_normal((n, k)).astype(np.float32)
        one = None
        for m in args.rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            c = np.empty((m, n), np.float32)
            ptrs = (x.ctypes.data, w.ctypes.data, c.ctypes.data)
            single = mine = theirs = narrow = float("inf")
            for _ in range(2):  # in turn, so a slow moment hits all of them
                single = min(single, alone(m, n, k, *ptrs, args.reps))
                mine = min(mine, timed(kernel, m, n, k, *ptrs, args.reps))
                theirs = min(theirs, timed(mkl, m, n, k, *ptrs, args.reps))
                if wide:
                    narrow = min(narrow, alone(m, n, k, *ptrs, args.reps, wide=False))
            one = mine if m == args.rows[0] else one
            print(f"{f'{n} x {k}':>10} {m:>3} {single * 1e6:11.1f} {mine * 1e6:9.1f} {2 * m * n * k / mine / 1e9:8.1f} "
                  f"{theirs * 1e6:8.1f} {mine / single:8.2f} {mine / theirs:10.2f} {mine / one:10.2f}"
                  + (f" {narrow * 1e6:8.1f} {narrow / single:9.2f}" if wide else ""))


if __name__ == "__main__":
    main()
