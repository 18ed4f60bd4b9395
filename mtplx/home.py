"""The one directory that holds everything mtplx writes: bank files, receipts, logs, settings.

`~/.mtplx` by default; `MTPLX_HOME` relocates it (tests and benchmarks point it at a temp dir).
"""

from __future__ import annotations

import os
from pathlib import Path


def mtplx_home() -> Path:
    home = Path(os.environ.get("MTPLX_HOME") or Path.home() / ".mtplx").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def home_path(*parts: str) -> Path:
    """A path under the home; its parent folder exists on return."""
    path = mtplx_home().joinpath(*parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
