"""A damaged SQLite file is set aside, not left in the way.

A store that cannot open its file (random bytes after a crash of the disk, a truncated copy, a
different file under the same name) otherwise stays broken for every later turn: receipts stop
being written, sent-back replies stop splicing. The damaged file is renamed beside itself (with its
write-ahead log and shared-memory files), so nothing is deleted and anyone can inspect or recover
it, and the store starts a fresh one. Locked, read-only or failing files are *not* damaged: their
contents may be fine, so they are never moved (the store degrades instead, as before).
"""

from __future__ import annotations

import datetime
import logging
import sqlite3
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def is_damaged(exc: BaseException) -> bool:
    """SQLite's "file is not a database" / "database disk image is malformed" (a DatabaseError
    that is not an OperationalError: locks, permissions and I/O errors are operational)."""
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)


def set_aside(path: Path | str, what: str, exc: BaseException) -> Path | None:
    """Rename the damaged `path` (and its -wal, -shm) to `<name>.damaged-<utc>`; returns the new
    path, or None when it could not be moved (the caller then degrades as it would anyway)."""
    path = Path(path)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    try:
        path.rename(aside)
        for suffix in ("-wal", "-shm"):
            extra = path.with_name(path.name + suffix)
            if extra.exists():
                extra.rename(aside.with_name(aside.name + suffix))
    except OSError as err:
        log.warning("%s %s is damaged (%s) and could not be set aside (%s)", what, path, exc, err)
        return None
    log.warning("%s %s was damaged (%s); kept as %s, starting a new one", what, path, exc, aside.name)
    return aside


def opened(path: Path | str, what: str, open_file: Callable[[Path | str], T]) -> T:
    """open_file(path); where that fails because the file is damaged, the file is set aside and
    open_file runs once more on a fresh one. Any other error (and a second failure) propagates.
    open_file closes what it opened before it raises."""
    try:
        return open_file(path)
    except sqlite3.DatabaseError as exc:
        if str(path) == ":memory:" or not is_damaged(exc) or set_aside(path, what, exc) is None:
            raise
    return open_file(path)
