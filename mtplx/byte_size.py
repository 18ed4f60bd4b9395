"""Byte sizes as people type them: `512M`, `2GiB`, `1.5GB`, `4096` (bytes).

Decimal suffixes (kB, MB, GB, TB) mean powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of
1024; a bare K, M, G or T is read as binary, as `ls -h` and most memory settings do.
"""

from __future__ import annotations

import re

from mtplx.errors import MtplxError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "size") -> int:
    """`text` in bytes; a clear error naming `what` for anything else (zero included)."""
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise MtplxError(f"{what} {text!r} is not a size (examples: 512M, 2GiB, 1.5GB, 4096)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise MtplxError(f"{what} must be more than 0 bytes, got {text!r}")
    return value


def format_size(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
