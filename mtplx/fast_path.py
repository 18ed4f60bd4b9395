"""The CPU fast path: Intel MKL's BLAS under MLX's CPU backend, and fp32 compute there.

MLX's Linux CPU wheel calls a bundled reference BLAS (fp32 matmul ~6 GFLOP/s on a 2-core box);
the `mkl` wheel from PyPI (a Linux x86_64 dependency of mtplx) does ~350. libmlx resolves
`cblas_sgemm` through the global symbol scope first, so loading libmkl_rt with RTLD_GLOBAL
*before* `mlx.core` is first imported routes every fp32 matmul to MKL — no LD_PRELOAD, no re-exec.
`import mtplx` does that (see mtplx/__init__.py), with the small-row kernel of mtplx/small_gemm.py
ahead of MKL for products of 1-32 rows; a process that imported MLX earlier keeps the
reference BLAS and says so. bf16 matmuls never reach BLAS on CPU, so on the CPU backend weights
are cast to fp32 at load (when they fit in memory twice over).

Knows the platform, the environment and which library it loaded; never imports MLX itself.
MTPLX_FAST_PATH=off turns all of it off (weights as stored, reference BLAS).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from mtplx import native_build, small_gemm

ENV = "MTPLX_FAST_PATH"
_MKL_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")


@dataclass(frozen=True)
class Blas:
    """What BLAS MLX's CPU backend got in this process: 'mkl', 'reference', or 'none' (not Linux)."""

    kind: str
    library: str | None = None
    reason: str | None = None  # why not MKL, when that was wanted
    kernel: bool = False  # the small-row kernel (mtplx/small_gemm.py) takes MLX's 1-32-row matmuls first
    kernel_reason: str | None = None  # why not, when MKL is loaded without it

    def __post_init__(self):
        if self.kind not in ("mkl", "reference", "none"):
            raise ValueError(f"unknown BLAS kind {self.kind!r} (mkl, reference, none)")


def wanted() -> bool:
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def mkl_library() -> Path | None:
    """libmkl_rt from the `mkl` wheel: <prefix>/lib of this environment (or a --user install)."""
    import site

    for base in dict.fromkeys((sys.prefix, sys.base_prefix, site.getuserbase())):
        for name in _MKL_NAMES:
            if (Path(base) / "lib" / name).is_file():
                return Path(base) / "lib" / name
    return None


def _unavailable() -> str | None:
    """Why MKL cannot be used here (None: it can)."""
    if sys.platform != "linux":
        return "not Linux"
    if not wanted():
        return f"{ENV}=off"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no MKL wheel for {platform.machine()}"
    if mkl_library() is None:
        return f"libmkl_rt.so.3 not found under {sys.prefix}/lib (pip install mkl)"
    return None


def _settle_env() -> None:
    """MKL and Intel's OpenMP read these once, at the first BLAS call; a user's own values win."""
    # STRICT: the same shapes give the same bits whatever the buffers' alignment (MLX does not
    # align to MKL's liking); a fixed thread count (not MKL_DYNAMIC's load-dependent one) keeps a
    # restored prefill and a cold one comparable.
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")
    # Intel OpenMP's workers spin 200 ms after each MKL call by default, on the cores MLX's own
    # (non-BLAS) ops need next: a 2-token verify measured 5-15x slower than a 1-token step.
    os.environ.setdefault("KMP_BLOCKTIME", "0")


KERNEL: ctypes.CDLL | None = None  # the loaded small-row kernel (benches switch it off and on)


@functools.cache
def activate() -> Blas:
    """Load MKL into the global symbol scope if it can still reach MLX; idempotent, ~1 ms."""
    if sys.platform != "linux":
        return Blas("none")
    reason = _unavailable()
    preloaded = next((p for p in os.environ.get("LD_PRELOAD", "").split(":") if "libmkl_rt" in p), None)
    if reason is None and preloaded:  # the loader put MKL first already, whatever was imported since
        _settle_env()
        return Blas("mkl", library=preloaded, kernel_reason="MKL was preloaded (LD_PRELOAD) ahead of it")
    if reason is None and "mlx.core" in sys.modules:
        reason = "mlx.core was imported before mtplx, so MLX already bound its reference BLAS"
    if reason is not None:
        return Blas("reference", reason=reason)
    library = mkl_library()
    _settle_env()
    try:
        mkl = ctypes.CDLL(str(library))  # loaded, not yet in the global scope: nothing binds to it yet
    except OSError as exc:
        return Blas("reference", reason=f"{library} did not load ({exc})")
    # The kernel goes into the global scope first, so MLX's cblas_sgemm resolves to it; it hands
    # what it does not take to MKL, which joins the scope next (for every other BLAS routine).
    kernel, why = small_gemm.load()
    if kernel is not None:
        small_gemm.attach(kernel, mkl)
        global KERNEL
        KERNEL = kernel
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    return Blas("mkl", library=str(library), kernel=kernel is not None, kernel_reason=why)



def predicted() -> str:
    """The compute path a model loaded in a fresh mtplx process gets here (no MLX import)."""
    if sys.platform == "darwin":
        return "metal"
    if not wanted():
        return "cpu, weights as stored, reference blas"
    if _unavailable() is not None:
        path = "cpu fp32 reference blas"
    else:
        path = "cpu fp32 + mkl" + (f" + {small_gemm.name()}" if small_gemm.unavailable() is None else "")
    path += " + attention kernel" if native_build.attention_unavailable() is None else ""
    return path + (" + vector silu" if vector_silu_wanted() else "")


def use_fp32(on_cpu: bool, fp32_bytes: int) -> bool:
    """Cast weights to fp32? Only on the CPU backend, with the fast path on, and when the fp32
    copy takes at most half of physical memory (a large bf16 checkpoint stays as stored)."""
    if not (on_cpu and wanted()):
        return False
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return True
    return fp32_bytes <= physical // 2


DEQUANTIZE_ENV = "MTPLX_CPU_DEQUANTIZE"
VECTOR_SILU_ENV = "MTPLX_VECTOR_SILU"  # off: MLX's own sigmoid in the MLP (mtplx/engine/fast_silu.py)


def vector_silu_wanted() -> bool:
    """The MLP's SiLU in vectorised arithmetic (fp32 on the CPU)? Only on x86-64, where MLX's CPU
    wheel takes a scalar exp per value (measured there); other arches keep MLX's sigmoid."""
    return wanted() and platform.machine().lower() in ("x86_64", "amd64") and native_build.switched_on(VECTOR_SILU_ENV)


def dequantize_wanted() -> bool:
    """Unpack quantized layers to fp32 where the fp32 copy fits (engine/compute.py)? On unless
    MTPLX_CPU_DEQUANTIZE=off."""
    return os.environ.get(DEQUANTIZE_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def quantized_here(quantization: dict | None, fp32_bytes: int) -> str | None:
    """What a checkpoint stored quantized (its config's `quantization`) runs as here, in words,
    for `mtplx models`; None when it is not quantized. `fp32_bytes`: its weights unpacked."""
    from mtplx.byte_size import format_size

    if not quantization:
        return None
    stored = f"stored {quantization.get('bits', '?')}-bit (group {quantization.get('group_size', '?')})"
    if sys.platform == "darwin":
        return f"{stored}: quantized matmuls on Metal"
    if not wanted():
        return f"{stored}: kept packed ({ENV}=off)"
    if not dequantize_wanted():
        return f"{stored}: kept packed ({DEQUANTIZE_ENV}=off; MLX's CPU quantized matmul is slower)"
    if use_fp32(True, fp32_bytes):
        return f"{stored}: unpacked to fp32 at load here ({format_size(fp32_bytes)})"
    return f"{stored}: kept packed here (its fp32 copy, {format_size(fp32_bytes)}, is over half of memory)"


def label(on_cpu: bool, dtype: str, blas: Blas) -> str:
    """'cpu fp32 + mkl', 'cpu bf16 reference blas', 'metal', ... for /health and `mtplx models`."""
    if not on_cpu:
        return "metal" if sys.platform == "darwin" else "gpu"
    if blas.kind != "mkl":
        return f"cpu {dtype} reference blas"
    return f"cpu {dtype} + mkl" + (f" + {small_gemm.name()}" if blas.kernel else "")


def rows_bitwise(blas: Blas) -> bool:
    """Does a row of a matmul come out bit-identical whatever the number of rows in the call?
    The reference BLAS (and MLX's own bf16 loops) yes. MKL no: it runs 1-3-row calls through other
    kernels and splits a call's rows over its threads, so a token's logits and KV differ in the
    last bits between a 1-token forward, a (k+1)-token verify and a prefill chunk (measured: ~1e-6
    on values of ~5). Equal shapes still give equal bits (MKL_CBWR STRICT, fixed thread count)."""
    return blas.kind != "mkl"


def notice(blas: Blas) -> str | None:
    """The one line a CLI prints when the fast path was wanted on Linux and is not active."""
    if blas.kind != "reference" or not wanted():
        return None
    return (f"mtplx: CPU fast path unavailable ({blas.reason}); fp32 matmuls use MLX's reference BLAS, "
            f"~50x slower. {ENV}=off silences this.")
