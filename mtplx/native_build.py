"""mtplx's C kernels (mtplx/native/*.c): built once per machine with the system compiler into the
user's cache, loaded with ctypes.

A wheel of prebuilt binaries would need one per CPU and platform; these are a few hundred lines
each, so the machine that runs them compiles them (AVX2 + FMA, and AVX-512 for a kernel with a
path for it where the CPU has it; ~1 s) the first time they are wanted. A missing compiler or CPU
feature only means the kernel is not used; the caller says why.
Never imports MLX.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NATIVE = Path(__file__).with_name("native")
WIDE_ENV = "MTPLX_AVX512"  # off: kernels with an AVX-512 path are built for AVX2 only
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")
WIDE = ("-mavx512f",)  # added for a kernel written for it too, where this CPU has it (its #if picks the path)


def switched_on(env: str) -> bool:
    return os.environ.get(env, "on").strip().lower() not in ("off", "0", "false", "no")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cpu_has(*features: str) -> bool:
    return set(features) <= _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(flags.split(":", 1)[1].split())


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtplx"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"mtplx-{os.getuid()}"


class Kernel:
    """One C source of mtplx/native, the flags and libraries it is built with."""

    def __init__(self, name: str, libs: tuple[str, ...] = (), wide: bool = False, extra: tuple[str, ...] = (),
                 features: tuple[str, ...] = ()):
        # extra flags and CPU features beyond FLAGS, AVX2 and FMA
        self.name, self.libs, self.wide, self.extra, self.features = name, libs, wide, extra, features
        self.source = NATIVE / f"{name}.c"

    def flags(self) -> tuple[str, ...]:
        """FLAGS, and AVX-512 for a kernel that has a path for it on a CPU that has it."""
        wide = self.wide and switched_on(WIDE_ENV) and cpu_has("avx512f")
        return FLAGS + self.extra + (WIDE if wide else ())

    def unavailable(self) -> str | None:
        """Why it cannot run here (None: it can, built or buildable)."""
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx2", "fma", *self.features):
            return f"needs Linux on a CPU with {', '.join(('AVX2', 'FMA') + tuple(f.upper() for f in self.features))}"
        if not self.built().is_file() and compiler() is None:
            return "no C compiler (cc) to build it"
        return None

    def built(self) -> Path:
        """Where this source, built with these flags, lives (the name changes when either does, or
        a header of mtplx/native)."""
        headers = b"".join(h.read_bytes() for h in sorted(NATIVE.glob("*.h")))
        digest = hashlib.sha256(self.source.read_bytes() + headers + " ".join(self.flags() + self.libs).encode()).hexdigest()[:16]
        return cache_dir() / f"{self.name}-{digest}.so"

    def build(self) -> Path:
        """The compiled library, built now if it is not yet (a temporary file renamed into place, so
        a crash or a concurrent build never leaves half a library under the final name)."""
        target = self.built()
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler() or "cc", *self.flags(), "-o", tmp, str(self.source), *self.libs], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for old in target.parent.glob(f"{self.name}-*.so"):  # builds of an earlier source (a loaded one stays mapped)
            if old != target:
                old.unlink(missing_ok=True)
        return target

    def load(self, mode: int = ctypes.DEFAULT_MODE) -> tuple[ctypes.CDLL | None, str | None]:
        """(the loaded library, None), or (None, why not)."""
        if (reason := self.unavailable()) is not None:
            return None, reason
        try:
            try:
                return ctypes.CDLL(str(self.build()), mode=mode), None
            except OSError:  # a cached build that no longer loads (a damaged file): built once more
                self.built().unlink(missing_ok=True)
                return ctypes.CDLL(str(self.build()), mode=mode), None
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            return None, f"could not build or load it ({exc}{': ' + detail.decode(errors='replace')[:200] if detail else ''})"


# The prefill attention kernel (used by mtplx/engine/cpu_attention.py), named here so that
# `mtplx models` can say whether it runs without importing MLX.
ATTENTION = Kernel("attention", libs=("-lpthread",))
ATTENTION_ENV = "MTPLX_ATTENTION_KERNEL"
PREFETCH_ENV = "MTPLX_PREFETCH"  # off: neither the small-row kernel nor the draft chain fetches weight rows ahead
CPU_ATTENTION_ENV = "MTPLX_CPU_ATTENTION"  # off: MLX's own attention everywhere, kernel or not


def attention_unavailable() -> str | None:
    """Why prefill attention on the CPU fp32 path does not run the kernel (None: it does)."""
    for env in (CPU_ATTENTION_ENV, ATTENTION_ENV):
        if not switched_on(env):
            return f"{env}=off"
    return ATTENTION.unavailable()
