"""The small-row kernel: a C sgemm for 1-32 rows that takes MLX's decode-step matmuls before MKL.

Why: inside decoding on this 2-core AMD box, MKL multiplied 4 rows in 1.6-2.5x the time of one
(bench/blas_time.py), so an MTP verify over k+1 tokens cost about two AR steps and a batch's rows
were far from free. The kernel (mtplx/native/small_gemm.c) reads the weights once for all rows;
side by side in one process it made MTP decode ~1.4x and AR ~1.2x faster (bench/small_gemm.py).
Its sums run in one fixed order whatever the row count, so a row's result is the same alone, in
a verify or in a batch.

How: compiled once per machine with the system C compiler into the user's cache (AVX2 + FMA, and
AVX-512 where the CPU has it: sixteen lanes per dot product, twice the multiply-adds per cycle on a
full-width core; MTPLX_AVX512=off keeps AVX2, e.g. on a CPU that slows down under 512-bit work),
loaded with RTLD_GLOBAL before MKL, so `cblas_sgemm` in MLX resolves to it; calls it does not take
go on to MKL's `cblas_sgemm`. A missing compiler or CPU feature leaves MKL alone, with the reason
in `Blas.kernel_reason`. Never imports MLX. MTPLX_SMALL_GEMM=off turns it off.

Products big enough (a verify's or a batch's rows) are shared with one helper thread in column
chunks: MLX's CPU stream computes on one thread while the engine's Python thread mostly waits on
it. MTPLX_SMALL_GEMM_THREADS=off keeps them on the calling thread, =on keeps the helper in every
process; unset, a process that serves (`launch.open_engine`: serve, tui, generate) keeps it only
for a model whose step is big enough (`fit_helper`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os

from mtplx import native_build

ENV = "MTPLX_SMALL_GEMM"
THREADS_ENV = "MTPLX_SMALL_GEMM_THREADS"
SPIN_ENV = "MTPLX_SMALL_GEMM_SPIN_US"  # how long the idle helper polls before it sleeps (default 2000)
BUILD = native_build.Kernel("small_gemm", libs=("-ldl", "-lpthread"), wide=True)  # dlsym, the helper thread


def wanted() -> bool:
    return native_build.switched_on(ENV)


def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can, built or buildable)."""
    return f"{ENV}=off" if not wanted() else BUILD.unavailable()


def _built():
    return BUILD.built()


def load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded kernel, None), or (None, why not). Load before the BLAS it forwards to."""
    if not wanted():
        return None, f"{ENV}=off"
    return BUILD.load(ctypes.RTLD_GLOBAL)


def attach(kernel: ctypes.CDLL, blas: ctypes.CDLL) -> None:
    """Hand the calls the kernel does not take to `blas`'s cblas_sgemm; share big products with a
    second thread where this process may run on two cores or more."""
    kernel.mtplx_small_gemm_next(ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p))
    set_threads(kernel, threads_wanted())
    set_prefetch(kernel, native_build.switched_on(native_build.PREFETCH_ENV))
    if (spin := spin_ns()) is not None:
        ctypes.c_long.in_dll(kernel, "mtplx_small_spin_ns").value = spin


def spin_ns() -> int | None:
    """MTPLX_SMALL_GEMM_SPIN_US in nanoseconds (None: unset, or not a number, which is ignored)."""
    try:
        return max(0, int(float(os.environ.get(SPIN_ENV, "").strip()) * 1000))
    except (ValueError, OverflowError):
        return None


def wide() -> bool:
    """Is the kernel built here with its AVX-512 tiles (MTPLX_AVX512=off or an AVX2-only CPU: no)?"""
    return "-mavx512f" in BUILD.flags()


def name() -> str:
    """How /health and `mtplx models` name it: the tiles' width sets the bits of every product."""
    return "small-row kernel" + (" (avx-512)" if wide() else "")


def set_wide(kernel: ctypes.CDLL, on: bool) -> None:
    """In an AVX-512 build, its sixteen-lane tiles (True) or the AVX2 ones (False), for side-by-side
    runs. The two sum in other orders, so their bits differ; each is the same for any row count."""
    ctypes.c_int.in_dll(kernel, "mtplx_small_wide").value = 1 if on else 0


def set_prefetch(kernel: ctypes.CDLL, on: bool) -> None:
    """Fetch the next block of weight rows while a block computes (True, the default) or not, for
    side-by-side runs (bench/small_gemm.py --compare prefetch). The same bits either way."""
    ctypes.c_int.in_dll(kernel, "mtplx_small_prefetch").value = 1 if on else 0


@contextlib.contextmanager
def rows_up_to(kernel: ctypes.CDLL | None, rows: int):
    """Inside the block the kernel takes products of up to `rows` rows (at least its usual 32),
    for a batched decode step: B rows x (k + 1) tokens passes 32 at 7-8 rows and depth 4, and MKL
    beyond would give a batched row other bits than the same row alone (whose k + 1 rows the
    kernel takes), so greedy batch == alone would hold only by luck there. The kernel's sums do not
    depend on the row count. The count is read at each call: the block must contain the eval."""
    cap = None if kernel is None else ctypes.c_int.in_dll(kernel, "mtplx_small_rows")
    before = None if cap is None else cap.value
    if cap is None or rows <= before:
        yield
        return
    cap.value = rows
    try:
        yield
    finally:
        cap.value = before


def threads_wanted() -> bool:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2 and native_build.switched_on(THREADS_ENV)


# Multiply-adds of one token's step (trunk + LM head) from which a serving process keeps the
# helper. Through `mtplx serve` on a 2-core machine, the helper's polling competes with the HTTP
# loop, the client and the engine's own threads. Measured side by side (bench/serve_ab.py,
# MTPLX_SMALL_GEMM_THREADS on/off): tiny-hybrid (~3.5M multiply-adds a token) decoded 1.11x faster
# with MTP and 0.96x with AR without it (MTP/AR 1.15 -> 1.33), tiny-dense's MTP/AR 1.41 -> 1.55;
# a 281M-parameter Qwen3-shaped stand-in (~270M a token) decoded 0.76x as fast without it. The
# bound sits between the two, an order of magnitude from each.
HELPER_FROM_MACS = 30_000_000


def helper_pays(step_macs: int) -> bool:
    """Whether a process that serves a model with this step size keeps the helper thread."""
    return step_macs >= HELPER_FROM_MACS


def fit_helper(kernel: ctypes.CDLL, step_macs: int) -> bool:
    """In a serving process: the helper for a model whose step is big enough (`helper_pays`),
    unless MTPLX_SMALL_GEMM_THREADS says otherwise. Returns whether the helper is on."""
    on = threads_wanted() and (THREADS_ENV in os.environ or helper_pays(step_macs))
    set_threads(kernel, on)
    return on


def set_threads(kernel: ctypes.CDLL, on: bool) -> None:
    """Share products of at least `mtplx_small_split_macs` multiply-adds with the kernel's helper
    thread (True) or run every product on the calling thread; results are the same bits."""
    ctypes.c_int.in_dll(kernel, "mtplx_small_threads").value = 1 if on else 0


def set_enabled(kernel: ctypes.CDLL, on: bool) -> None:
    """Route small products to the kernel (True) or to the BLAS behind it, for side-by-side runs."""
    kernel.mtplx_small_gemm_enable(1 if on else 0)
