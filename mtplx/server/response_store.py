"""The responses a client asked to keep (`store`, true unless it says false): each one's chat
messages (its input and output, as a follow-up naming it in `previous_response_id` renders them),
the response object itself (what `GET /v1/responses/{id}` returns) and its request's input items
(`GET /v1/responses/{id}/input_items`), by response id.

Kept in a small SQLite file under MTPLX_HOME, so a client that names a response after the server
restarted still gets its history (the session bank restores the state from SSD the same way).
Bounded: the `capacity` most recently used responses are kept. A file that cannot be opened costs
persistence, never a request: the store then lives in memory. A write the disk refuses (full, I/O
error) costs nothing either: the response waits in memory, answers `previous_response_id` from
there, and is written with the next write that succeeds.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path

from mtplx.damaged_file import opened
from mtplx.server.api_error import bad_request

log = logging.getLogger(__name__)


class ResponseStore:
    def __init__(self, path: Path | None = None, capacity: int = 1024, label: str = "response store"):
        """`label` names the store in the log (Anthropic's message threads keep theirs in one too)."""
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity, self.lock, self.label = capacity, threading.Lock(), label
        # (used, messages, response, input items) as JSON, written once the disk takes them
        self.held: OrderedDict[str, tuple[float, str, str | None, str | None]] = OrderedDict()
        self.db = self._open(path)

    def _open(self, path: Path | None) -> sqlite3.Connection:
        if path is not None:
            try:  # a damaged file is set aside and a new one started
                return opened(path, self.label, self._connect)
            except sqlite3.Error as exc:  # unwritable: the responses live in memory until restart
                log.warning("%s %s unusable (%s); what it keeps lasts until restart", self.label, path, exc)
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
        columns = {row[1] for row in db.execute("pragma table_info(responses)")}
        if "response" not in columns:
            db.execute("alter table responses add column response text")  # a store from before retrieval
        if "input" not in columns:
            db.execute("alter table responses add column input text")  # ... or from before input_items
        db.execute("create index if not exists responses_used on responses (used)")
        db.commit()
        return db

    def get(self, response_id: str) -> list[dict]:
        """The conversation a follow-up naming `response_id` continues."""
        row = self._row(response_id)
        if row is None:
            raise bad_request(f"previous_response_id {response_id!r} is unknown to this server (it keeps its "
                              f"{self.capacity} most recently used responses, and none sent with store: false)",
                              "previous_response_id", "previous_response_not_found")
        return json.loads(row[0])

    def response(self, response_id: str) -> dict | None:
        """The response object as the client got it; None when unknown (or kept before retrieval)."""
        row = self._row(response_id)
        return json.loads(row[1]) if row is not None and row[1] is not None else None

    def inputs(self, response_id: str) -> list[dict] | None:
        """The request's input items; None when unknown (or kept before input items were)."""
        row = self._row(response_id)
        return json.loads(row[2]) if row is not None and row[2] is not None else None

    def item(self, item_id: str) -> dict | None:
        """An input or output item of a kept response, by its id (what an `item_reference` names)."""
        needle = json.dumps(item_id, ensure_ascii=False)  # as the id is written inside the kept JSON
        with self.lock:
            rows = [row[2:] for row in self.held.values()]
            try:
                rows += self.db.execute("select response, input from responses where instr(coalesce(input, ''), ?) > 0 "
                                        "or instr(coalesce(response, ''), ?) > 0", (needle, needle)).fetchall()
            except sqlite3.Error as exc:  # what the disk cannot give is not kept, as for a row it lost
                log.warning("%s: items not searched (%s)", self.label, exc)
        for response, inputs in rows:
            output = json.loads(response).get("output", []) if response else []
            for candidate in output + (json.loads(inputs) if inputs else []):
                if isinstance(candidate, dict) and candidate.get("id") == item_id:
                    return candidate
        return None

    def _row(self, response_id: str) -> tuple[str, str | None, str | None] | None:
        with self.lock:
            if response_id in self.held:
                _, *row = self.held[response_id]
                self.held[response_id] = (time.time(), *row)
                self.held.move_to_end(response_id)
                return tuple(row)
            row = self.db.execute("select messages, response, input from responses where id = ?", (response_id,)).fetchone()
            if row is not None:
                self._write("update responses set used = ? where id = ?", (time.time(), response_id))
            return row

    def put(self, response_id: str, messages: list[dict], response: dict | None = None,
            inputs: list[dict] | None = None) -> None:
        as_json = lambda value: None if value is None else json.dumps(value, ensure_ascii=False)
        with self.lock:
            self.held[response_id] = (time.time(), json.dumps(messages, ensure_ascii=False), as_json(response),
                                      as_json(inputs))
            self.held.move_to_end(response_id)
            while len(self.held) > self.capacity:
                self.held.popitem(last=False)
            while self.held:
                key, row = next(iter(self.held.items()))
                if not self._write("insert or replace into responses (id, used, messages, response, input) "
                                   "values (?, ?, ?, ?, ?)", (key, *row)):
                    return
                del self.held[key]
            self._write("delete from responses where id not in (select id from responses order by used desc limit ?)",
                        (self.capacity,))

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not kept. A disk that refuses the delete keeps the
        row (logged): the answer is then False, so the client is never told it is gone."""
        with self.lock:
            held = self.held.pop(response_id, None) is not None
            try:
                with self.db:
                    gone = self.db.execute("delete from responses where id = ?", (response_id,)).rowcount > 0
            except sqlite3.Error as exc:
                log.warning("%s: %s not deleted (%s)", self.label, response_id, exc)
                return False
            return held or gone

    def _write(self, sql: str, args: tuple) -> bool:
        """One statement, committed; False (logged) when the disk refuses it. Holds the lock."""
        try:
            with self.db:
                self.db.execute(sql, args)
            return True
        except sqlite3.Error as exc:
            log.warning("%s not written (%s); %d entries wait in memory", self.label, exc, len(self.held))
            return False

    def __len__(self) -> int:
        with self.lock:
            stored = {r[0] for r in self.db.execute("select id from responses")}
            return len(stored | set(self.held))
