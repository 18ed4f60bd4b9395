"""The receipt store: one SQLite row per turn, at $MTPLX_HOME/receipts.db by default.

Migrates itself on open (an append-only list of named migrations), runs in WAL mode, keeps
columns *and* the raw request JSON. A write never fails or stalls a request. A row that cannot be
written for a passing reason (a full disk, a lock held too long, an I/O error) waits in a bounded
backlog and goes in with the next write that succeeds, so a full disk loses no receipt once space
is freed; one refused for good (a read-only or broken database) is logged and dropped.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections import deque
from pathlib import Path
from typing import Callable

import sqlite_utils

from mtplx.damaged_file import is_damaged, opened

log = logging.getLogger("mtplx.receipts")

COLUMNS = {
    "id": str, "created_utc": str, "session": str, "source": str, "model": str, "model_identity": str,
    "arm": str, "prompt_tokens": int, "ceiling": int, "cached_tokens": int, "restore_source": str,
    "anchor": str, "shortfall": str, "ttft_first_token_s": float, "ttft_first_visible_s": float,
    "prefill_tps": float, "decode_tps": float, "mode": str, "depth": int, "tau": float,
    "drafted_by_depth": str, "accepted_by_depth": str, "completion_tokens": int, "finish_reason": str,
    "output_sha256": str, "request_json": str,
}


def _create(db: sqlite_utils.Database) -> None:
    db["receipts"].create(COLUMNS, pk="id", if_not_exists=True)
    db["receipts"].create_index(["session"], if_not_exists=True)
    db["receipts"].create_index(["created_utc"], if_not_exists=True)


def _add_replay_run(db: sqlite_utils.Database) -> None:
    if "replay_run" not in db["receipts"].columns_dict:
        db["receipts"].add_column("replay_run", str)
        db["receipts"].add_column("turn_index", int)


def _add_reasoning_tokens(db: sqlite_utils.Database) -> None:
    if "reasoning_tokens" not in db["receipts"].columns_dict:
        db["receipts"].add_column("reasoning_tokens", int)


def _add_request_and_entry(db: sqlite_utils.Database) -> None:
    # the engine's request id (a TUI turn finds its receipt) and the bank entry restored from
    for column in ("request_id", "entry_id"):
        if column not in db["receipts"].columns_dict:
            db["receipts"].add_column(column, str)
    db["receipts"].create_index(["request_id"], if_not_exists=True)


def _add_render_ahead(db: sqlite_utils.Database) -> None:
    # how far render-ahead had prepared the prompt's rendering when the request came
    if "render_ahead" not in db["receipts"].columns_dict:
        db["receipts"].add_column("render_ahead", str)


def _add_prediction(db: sqlite_utils.Database) -> None:
    # a predicted output's tokens that verifies took / kept (OpenAI `prediction`)
    for column in ("predicted_drafted", "predicted_accepted"):
        if column not in db["receipts"].columns_dict:
            db["receipts"].add_column(column, int)


def _add_entry_origin(db: sqlite_utils.Database) -> None:
    # what made the bank entry restored from: its own turn, render-ahead, or a prompt shared with
    # a turn running beside it (the entry may be gone when the receipt is read)
    if "entry_origin" not in db["receipts"].columns_dict:
        db["receipts"].add_column("entry_origin", str)


# How the turn shared the engine with others (engine/stats.py): its wait for admission, its decode
# rounds and those in a batch, the mean rows per round, the other requests' work between its rounds
SHARING = {"queued_s": float, "rounds": int, "batched_rounds": int, "rows_mean": float, "others_s": float}


def _add_sharing(db: sqlite_utils.Database) -> None:
    for column, kind in SHARING.items():
        if column not in db["receipts"].columns_dict:
            db["receipts"].add_column(column, kind)


# Append-only: never edit or reorder; add a new named step instead.
MIGRATIONS: list[tuple[str, Callable[[sqlite_utils.Database], None]]] = [
    ("001_create_receipts", _create),
    ("002_replay_run", _add_replay_run),
    ("003_reasoning_tokens", _add_reasoning_tokens),
    ("004_request_and_entry", _add_request_and_entry),
    ("005_render_ahead", _add_render_ahead),
    ("006_prediction", _add_prediction),
    ("007_entry_origin", _add_entry_origin),
    ("008_sharing", _add_sharing),
]


def migrate(db: sqlite_utils.Database) -> list[str]:
    db["_migrations"].create({"name": str, "applied_utc": str}, pk="name", if_not_exists=True)
    done = {row["name"] for row in db["_migrations"].rows}
    applied = []
    for name, step in MIGRATIONS:
        if name not in done:
            step(db)
            db["_migrations"].insert({"name": name, "applied_utc": _utc_now()})
            applied.append(name)
    return applied


# sqlite3's messages for a write that may succeed later (its error codes are not exposed before 3.11)
PASSING = ("database or disk is full", "database is locked", "disk i/o error")
BACKLOG = 10_000  # rows held while the disk refuses them (~a few MB); past it the oldest go


def _passing(exc: Exception) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and any(p in str(exc).lower() for p in PASSING)


def _utc_now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


class ReceiptStore:
    def __init__(self, path: Path | str | None = None, busy_s: float = 2.0):
        """`busy_s`: how long a write waits for a lock another connection holds before its row is
        held back (the engine's writer waits briefly: receipts/writer.py)."""
        if path is None:
            from mtplx.home import home_path

            path = home_path("receipts.db")
        self.path, self.busy_s = path, busy_s
        self.writable = True
        self._lock = threading.Lock()  # the backlog and the writes: a retry may run on another thread
        self.backlog: deque[dict] = deque()
        self.db: sqlite_utils.Database | None = None
        try:  # a damaged file is set aside and a new store started: the turns to come keep their receipts
            opened(path, "receipt store", self._open)
        except sqlite3.Error as exc:  # read-only or locked: readable where possible, writes dropped
            log.warning("receipt store %s is not writable (%s); receipts will not be saved", path, exc)
            self.writable = False
            self._open_read_only(path)

    def _open(self, path) -> None:
        conn = sqlite3.connect(str(path), timeout=self.busy_s, check_same_thread=False, isolation_level=None)
        self.db = sqlite_utils.Database(conn)
        try:
            if str(path) != ":memory:":
                self.db.enable_wal()
                # In WAL mode a commit then waits for no fsync (0.36 -> 0.05 ms a row here); the
                # file stays consistent, and a power cut loses at most the last rows.
                conn.execute("pragma synchronous=normal")
            migrate(self.db)
        except sqlite3.Error as exc:
            if is_damaged(exc):
                conn.close()  # let go of the file before it is renamed
            raise

    def _open_read_only(self, path) -> None:
        """`mtplx receipts` on a read-only home still lists what is there (nothing when no file)."""
        if str(path) == ":memory:" or not Path(path).is_file():
            return
        try:
            conn = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, check_same_thread=False)
            conn.execute("select count(*) from sqlite_master").fetchone()
            self.db = sqlite_utils.Database(conn)
        except sqlite3.Error:
            self.db = None

    def add(self, row: dict) -> bool:
        """Insert one receipt (after any held back); never raises. Returns whether it is stored."""
        if not self.writable:
            return False
        with self._lock:
            if len(self.backlog) >= BACKLOG:
                dropped = self.backlog.popleft()
                log.warning("receipt %s dropped: %d receipts wait for the disk already", dropped.get("id"), BACKLOG)
            self.backlog.append(row)
            return row.get("id") in self._flush()

    def flush(self) -> set:
        """Write the rows held back, oldest first; the ids written (what the disk refused stays
        in `backlog`)."""
        with self._lock:
            return self._flush()

    def _flush(self) -> set:
        stored = set()
        while self.backlog and self.writable:
            row = self.backlog[0]
            try:
                self.db["receipts"].insert(row, alter=False)
                stored.add(row.get("id"))
            except (sqlite3.Error, sqlite_utils.db.NotFoundError) as exc:
                if _passing(exc):
                    if len(self.backlog) == 1:  # one line per outage, not one per held row
                        log.warning("receipt %s not stored yet (%s); held until the disk takes it", row.get("id"), exc)
                    break
                log.warning("receipt %s not stored: %s", row.get("id"), exc)
            self.backlog.popleft()
        return stored

    def claim(self, session: str, since_utc: str, fields: dict) -> str | None:
        """Complete the server's own row for a turn a replay client just sent (an in-process or
        local mtplx server sharing this store) with the replay's fields, so a turn has one row
        with the server's restore source, anchor, tau, acceptance and speed. Returns its id, or
        None when there is no such row (another server, another home): the caller adds its own."""
        if not self.writable or "receipts" not in self.db.table_names():
            return None
        try:
            # the server may scope the client's session id ("<session>/<hash of system + tools>")
            found = self.rows("(session = ? or session like ?) and created_utc >= ? and replay_run is null "
                              "and source = 'api'", (session, session + "/%", since_utc))
            if not found:
                return None
            self.db["receipts"].update(found[-1]["id"], fields)
            return found[-1]["id"]
        except sqlite3.Error as exc:
            log.warning("receipt for %s not completed: %s", session, exc)
            return None

    def rows(self, where: str | None = None, params: tuple = (), limit: int | None = None) -> list[dict]:
        if self.db is None or "receipts" not in self.db.table_names():
            return []
        return list(self.db["receipts"].rows_where(where, params, order_by="id", limit=limit))

    def get(self, receipt_id: str) -> dict | None:
        found = self.rows("id = ? or id like ?", (receipt_id, receipt_id + "%"), limit=2)
        return found[0] if len(found) == 1 else None

    def export(self, fmt: str, rows: list[dict]) -> str:
        if fmt == "json":
            return json.dumps(rows, indent=2)
        import csv
        import io

        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
