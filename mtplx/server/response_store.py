"""The conversations behind `previous_response_id`: each response's chat messages (its input and
output, as a follow-up renders them), by response id.

Kept in a small SQLite file under MTPLX_HOME, so a client that names a response after the server
restarted still gets its history (the session bank restores the state from SSD the same way).
Bounded: the `capacity` most recently used responses are kept. A file that cannot be opened costs
persistence, never a request: the store then lives in memory.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path

from mtplx.damaged_file import opened
from mtplx.server.api_error import bad_request

log = logging.getLogger(__name__)


class ResponseStore:
    def __init__(self, path: Path | None = None, capacity: int = 1024):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity, self.lock = capacity, threading.Lock()
        self.db = self._open(path)

    def _open(self, path: Path | None) -> sqlite3.Connection:
        if path is not None:
            try:  # a damaged file is set aside and a new one started
                return opened(path, "response store", self._connect)
            except sqlite3.Error as exc:  # unwritable: the responses live in memory until restart
                log.warning("response store %s unusable (%s); previous_response_id lasts until restart", path, exc)
        return self._schema(sqlite3.connect(":memory:", check_same_thread=False))

    def _connect(self, path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(str(path), check_same_thread=False)
        try:
            return self._schema(db)
        except sqlite3.Error:
            db.close()
            raise

    @staticmethod
    def _schema(db: sqlite3.Connection) -> sqlite3.Connection:
        db.execute("pragma journal_mode=wal")
        db.execute("create table if not exists responses (id text primary key, used real not null, messages text not null)")
        db.execute("create index if not exists responses_used on responses (used)")
        db.commit()
        return db

    def get(self, response_id: str) -> list[dict]:
        with self.lock:
            row = self.db.execute("select messages from responses where id = ?", (response_id,)).fetchone()
            if row is not None:
                self.db.execute("update responses set used = ? where id = ?", (time.time(), response_id))
                self.db.commit()
        if row is None:
            raise bad_request(f"previous_response_id {response_id!r} is unknown to this server (it keeps its "
                              f"{self.capacity} most recently used responses)", "previous_response_id",
                              "previous_response_not_found")
        return json.loads(row[0])

    def put(self, response_id: str, messages: list[dict]) -> None:
        text = json.dumps(messages, ensure_ascii=False)
        with self.lock:
            self.db.execute("insert or replace into responses values (?, ?, ?)", (response_id, time.time(), text))
            self.db.execute("delete from responses where id not in (select id from responses order by used desc limit ?)",
                            (self.capacity,))
            self.db.commit()

    def __len__(self) -> int:
        with self.lock:
            return self.db.execute("select count(*) from responses").fetchone()[0]
