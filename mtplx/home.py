"""The one directory that holds everything mtplx writes: bank files, receipts, logs, settings.

`~/.mtplx` by default; `MTPLX_HOME` relocates it (tests and benchmarks point it at a temp dir).

A home that cannot be created (a read-only or full disk, no permission) is not an error here:
the paths are still handed out, and each store that then fails to open runs without its file
(receipts unsaved, the bank RAM-only, responses and reply ids in memory), as when its own file
is unusable. The server then serves; one warning says why nothing is kept.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("mtplx")
_warned: set[str] = set()


def _made(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if str(folder) not in _warned:
            _warned.add(str(folder))
            log.warning("%s cannot be created (%s): receipts, the SSD bank and saved history are off for this "
                        "run; set MTPLX_HOME to a writable directory to keep them", folder, exc.strerror or exc)


def mtplx_home() -> Path:
    home = Path(os.environ.get("MTPLX_HOME") or Path.home() / ".mtplx").expanduser()
    _made(home)
    return home


def home_path(*parts: str) -> Path:
    """A path under the home; its parent folder exists on return where it can be made."""
    path = mtplx_home().joinpath(*parts)
    _made(path.parent)
    return path
