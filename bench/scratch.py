"""Throwaway directories for benches, removed when the bench's process exits.

A bench that starts servers gives each a fresh MTPLX_HOME, and with the SSD tier on each home
collects the bank's files (~0.7 GB for bench/turns.py's servers). Left behind, 376 of them filled
this machine's disk; from then on every server's SSD tier skipped its writes, and the figures
measured a full disk, not what a user runs.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path
