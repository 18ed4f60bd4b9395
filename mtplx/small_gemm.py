"""The small-row kernel: a C sgemm for 1-32 rows that takes MLX's decode-step matmuls before MKL.

Why: inside decoding on this 2-core AMD box, MKL multiplied 4 rows in 1.6-2.5x the time of one
(bench/blas_time.py), so an MTP verify over k+1 tokens cost about two AR steps and a batch's rows
were far from free. The kernel (mtplx/native/small_gemm.c) reads the weights once for all rows;
side by side in one process it made MTP decode ~1.4x and AR ~1.2x faster (bench/small_gemm.py).
Its sums run in one fixed order whatever the row count, so a row's result is the same alone, in
a verify or in a batch.

How: compiled once per machine with the system C compiler (AVX2 + FMA) into the user's cache,
loaded with RTLD_GLOBAL before MKL, so `cblas_sgemm` in MLX resolves to it; calls it does not take
go on to MKL's `cblas_sgemm`. A missing compiler or CPU feature leaves MKL alone, with the reason
in `Blas.kernel_reason`. Never imports MLX. MTPLX_SMALL_GEMM=off turns it off.

Products big enough (a verify's or a batch's rows) are shared with one helper thread in column
chunks: MLX's CPU stream computes on one thread while the engine's Python thread mostly waits on
it. MTPLX_SMALL_GEMM_THREADS=off keeps them on the calling thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = "MTPLX_SMALL_GEMM"
THREADS_ENV = "MTPLX_SMALL_GEMM_THREADS"
SPIN_ENV = "MTPLX_SMALL_GEMM_SPIN_US"  # how long the idle helper polls before it sleeps (default 2000)
SOURCE = Path(__file__).with_name("native") / "small_gemm.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")
LIBS = ("-ldl", "-lpthread")  # dlsym, the helper thread (both in libc itself since glibc 2.34)


def wanted() -> bool:
    return _switched_on(ENV)


def _switched_on(name: str) -> bool:
    return os.environ.get(name, "on").strip().lower() not in ("off", "0", "false", "no")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_has(*features: str) -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return set(features) <= set(flags.split(":", 1)[1].split())


def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can, built or buildable)."""
    if not wanted():
        return f"{ENV}=off"
    if sys.platform != "linux" or not _cpu_has("avx2", "fma"):
        return "needs Linux on a CPU with AVX2 and FMA"
    if not _built().is_file() and compiler() is None:
        return "no C compiler (cc) to build it"
    return None


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtplx"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"mtplx-{os.getuid()}"


def _built() -> Path:
    """Where this source, built with these flags, lives (the name changes when either does)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS + LIBS).encode()).hexdigest()[:16]
    return _cache_dir() / f"small_gemm-{digest}.so"


def build() -> Path:
    """The compiled kernel, built now if it is not yet (a temporary file renamed into place, so a
    crash or a concurrent build never leaves half a library under the final name)."""
    target = _built()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler() or "cc", *FLAGS, "-o", tmp, str(SOURCE), *LIBS], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in target.parent.glob("small_gemm-*.so"):  # builds of an earlier source (a loaded one stays mapped)
        if old != target:
            old.unlink(missing_ok=True)
    return target


def load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded kernel, None), or (None, why not). Load before the BLAS it forwards to."""
    if (reason := unavailable()) is not None:
        return None, reason
    try:
        try:
            return ctypes.CDLL(str(build()), mode=ctypes.RTLD_GLOBAL), None
        except OSError:  # a cached build that no longer loads (a damaged file): built once more
            _built().unlink(missing_ok=True)
            return ctypes.CDLL(str(build()), mode=ctypes.RTLD_GLOBAL), None
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return None, f"could not build or load it ({exc}{': ' + detail.decode(errors='replace')[:200] if detail else ''})"


def attach(kernel: ctypes.CDLL, blas: ctypes.CDLL) -> None:
    """Hand the calls the kernel does not take to `blas`'s cblas_sgemm; share big products with a
    second thread where this process may run on two cores or more."""
    kernel.mtplx_small_gemm_next(ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p))
    set_threads(kernel, threads_wanted())
    if (spin := spin_ns()) is not None:
        ctypes.c_long.in_dll(kernel, "mtplx_small_spin_ns").value = spin


def spin_ns() -> int | None:
    """MTPLX_SMALL_GEMM_SPIN_US in nanoseconds (None: unset, or not a number, which is ignored)."""
    try:
        return max(0, int(float(os.environ.get(SPIN_ENV, "").strip()) * 1000))
    except (ValueError, OverflowError):
        return None


def threads_wanted() -> bool:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2 and _switched_on(THREADS_ENV)


def set_threads(kernel: ctypes.CDLL, on: bool) -> None:
    """Share products of at least `mtplx_small_split_macs` multiply-adds with the kernel's helper
    thread (True) or run every product on the calling thread; results are the same bits."""
    ctypes.c_int.in_dll(kernel, "mtplx_small_threads").value = 1 if on else 0


def set_enabled(kernel: ctypes.CDLL, on: bool) -> None:
    """Route small products to the kernel (True) or to the BLAS behind it, for side-by-side runs."""
    kernel.mtplx_small_gemm_enable(1 if on else 0)
