"""The ids each reply was generated as, so a history that sends the reply back renders to them.

A model often samples a text in a tokenization the tokenizer would not choose ("\\n\\n" as two
"\\n" tokens; the tiny models do it within the first ~50 tokens of most long replies). A client
sends the reply back as text; re-encoded, the history differs from what the model computed from
that token on, so the bank restores only up to there and the rest of the reply is prefilled again
before the next turn can start (~4 ms a token at 9k tokens of context on a CPU: a Codex resend
0.9 s after a 500-token reply found it undone). Rendering the reply as the ids the model generated
keeps the history the model's own, and every later turn restores through it whenever it comes.

The rendering stays a function of the request and this store: a sent-back assistant message is
spliced only where the text the template renders for it contains the generated text verbatim (the
whole reply, or the part after the reasoning that a new user message strips, or the text before a
tool call the template re-serialises); everything else is encoded as before. The store lives with
the bank's SSD tier, so a restarted server renders the same history to the same ids (and restores
it from SSD); without a file it lasts as long as the process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from mtplx.damaged_file import opened

log = logging.getLogger(__name__)
_STORES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Span:
    """A run of generated ids and the text it decodes to."""

    text: str
    ids: tuple[int, ...]


def reply_calls(message: dict) -> list[tuple]:
    """A message's tool calls as (name, parsed arguments): how a call compares whichever route
    folded it back and however the client serialised its arguments."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        calls.append((fn.get("name"), args))
    return calls


def reply_key(message: dict) -> str:
    """What identifies a reply as sent back: its content and reasoning (trimmed) and its calls,
    as every route folds them back. A client that drops the reasoning finds no record: that reply
    renders as text, as before."""
    text = lambda v: v.strip() if isinstance(v, str) else ""
    blob = json.dumps([text(message.get("content")), text(message.get("reasoning_content")), reply_calls(message)],
                      sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def spans_of(tokenizer, ids: list[int]) -> list[Span]:
    """The runs of `ids` a template may render verbatim, longest first: the whole reply; after the
    reasoning's closing tag (with and without the whitespace after it); before the first tool-call
    tag; each with trailing whitespace tokens trimmed too."""
    from mtplx.tool_formats import format_of

    think_end = _token_id(tokenizer, "</think>")
    call_start = _token_id(tokenizer, format_of(tokenizer).start)
    blank = lambda i: tokenizer.decode([ids[i]]).strip() == ""
    starts = [0]
    if think_end is not None and think_end in ids:
        j = len(ids) - 1 - ids[::-1].index(think_end) + 1
        starts.append(j)
        while j < len(ids) and blank(j) and j - starts[1] < 3:
            j += 1
            starts.append(j)
    ends = [len(ids)]
    if call_start is not None and call_start in ids:
        ends.append(ids.index(call_start))
    for end in list(ends):
        while end > 0 and blank(end - 1):
            end -= 1
        ends.append(end)
    out, seen = [], set()
    for s in starts:
        for e in ends:
            if e - s >= 2 and (s, e) not in seen:
                seen.add((s, e))
                out.append(Span(tokenizer.decode(ids[s:e]), tuple(ids[s:e])))
    return sorted(out, key=lambda sp: -len(sp.ids))


def _token_id(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


@dataclass(frozen=True)
class Variant:
    """One generation of a reply: its spans, and the text its prompt ended with (`tail`), which
    tells apart two generations of the same text in different ids (an agent repeating a call)."""

    spans: tuple[Span, ...]
    tail: str

    def as_json(self) -> list:
        return [[[sp.text, list(sp.ids)] for sp in self.spans], self.tail]

    @classmethod
    def from_json(cls, data) -> "Variant":
        spans, tail = data
        return cls(tuple(Span(str(t), tuple(int(i) for i in ids)) for t, ids in spans), str(tail))


def _shared_suffix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


WRITE_WAIT_MS = 50  # the most a record's write waits for a lock on the file (it runs on the engine thread)


class ReplyIds:
    """Replies this model generated, by reply_key, each with its variants (the most recent
    last); the `capacity` most recent keys are kept (in a SQLite file when one is given)."""

    VARIANTS = 8  # generations of one key kept: an agent repeating the same call
    TAIL = 64  # prompt tokens kept, as text, to tell variants apart

    def __init__(self, capacity: int = 4096):
        self.capacity, self.lock = capacity, threading.Lock()
        # MTPLX_REPLY_IDS=off re-encodes sent-back replies (what mtplx did before; bench/resend.py compares)
        self.enabled = os.environ.get("MTPLX_REPLY_IDS", "on").lower() not in ("off", "0", "false")
        self.records: OrderedDict[str, tuple[Variant, ...]] = OrderedDict()
        self.unsaved: OrderedDict[str, None] = OrderedDict()  # keys a refusing disk has not taken yet
        self.db: sqlite3.Connection | None = None

    @classmethod
    def of(cls, tokenizer) -> "ReplyIds":
        """The store of the model this tokenizer belongs to: every rendering of its conversations
        (server routes, the bank's render-ahead, the TUI, replay) splices the same way."""
        key = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper and the HF tokenizer alike
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = cls()
        return store

    def persist(self, path: Path) -> None:
        """Keep the records in `path` too, loading what an earlier process left; a file that cannot
        be used costs persistence, never a request."""
        def load(file):
            db = sqlite3.connect(str(file), check_same_thread=False)
            try:
                db.execute("create table if not exists replies (key text primary key, variants text, used integer)")
                rows = db.execute("select key, variants from replies order by used desc limit ?",
                                  (self.capacity,)).fetchall()
                # Records are written on the engine thread at every turn's end: in WAL mode with no
                # fsync a write costs ~0.1 ms (0.9 ms with a rollback journal), and a lock another
                # process holds is waited on for WRITE_WAIT_MS, not 5 s; a refused record stays in
                # memory and goes in with the next one (_save).
                db.execute("pragma journal_mode=wal")
                db.execute("pragma synchronous=normal")
                db.execute(f"pragma busy_timeout={WRITE_WAIT_MS}")
                return db, rows
            except sqlite3.Error:
                db.close()
                raise

        try:  # a damaged file is set aside and a new one started: this run's records persist again
            db, rows = opened(path, "reply ids file", load)
        except sqlite3.Error as exc:
            log.warning("reply ids file %s unusable (%s); sent-back replies render as generated until restart", path, exc)
            return
        with self.lock:
            for key, blob in reversed(rows):
                try:
                    self.records[key] = tuple(Variant.from_json(v) for v in json.loads(blob))
                except (ValueError, TypeError):
                    continue  # a damaged row: that reply renders as text, as before
            self.db = db

    def record(self, tokenizer, reply: dict, ids, prompt=()) -> None:
        """A reply the model generated (`ids` without the stop token), its split message and the
        prompt it continued."""
        ids = [int(i) for i in ids]
        if len(ids) < 2 or not reply:
            return
        key = reply_key(reply)
        variant = Variant(tuple(spans_of(tokenizer, ids)), tokenizer.decode(list(prompt)[-self.TAIL:]))
        with self.lock:
            kept = tuple(v for v in self.records.get(key, ()) if v.spans[:1] != variant.spans[:1])
            self.records[key] = (kept + (variant,))[-self.VARIANTS:]
            self.records.move_to_end(key)
            while len(self.records) > self.capacity:
                old, _ = self.records.popitem(last=False)
                self._write("delete from replies where key = ?", (old,))
            self._save(key)

    def _save(self, key: str) -> None:
        """Write `key`'s record, after those a refusing disk held back (oldest first), so a full
        disk costs persistence only until space is freed."""
        self.unsaved[key] = None
        for k in list(self.unsaved):
            if k in self.records and not self._write(
                    "insert or replace into replies values (?, ?, (select coalesce(max(used), 0) + 1 from replies))",
                    (k, json.dumps([v.as_json() for v in self.records[k]], ensure_ascii=False))):
                return
            del self.unsaved[k]

    def _write(self, sql: str, args: tuple) -> bool:
        if self.db is None:
            return True
        try:
            with self.db:
                self.db.execute(sql, args)
            return True
        except sqlite3.Error as exc:  # a full or failing disk: keep serving from memory
            if len(self.unsaved) <= 1:  # once per outage
                log.warning("reply ids not persisted yet (%s); kept in memory until the disk takes them", exc)
            return False

    def splices(self, messages: list[dict], text: str, turn_end: str | None = None) -> list[tuple[int, Span]]:
        """Where in the rendered `text` each sent-back reply's generated span sits: (offset, span),
        in order. Each message's content is looked for after the previous one's, so a reply's text
        quoted in an earlier message is never taken for the reply; with `turn_end` (the text that
        closes a turn: the model's stop token) a span must also start in the turn after that
        point, so a later turn repeating the reply is not taken for it either. Of a reply's
        variants, the longest span found wins, then the one whose prompt ended as the text before
        it does, then the most recent."""
        out, cursor = [], 0
        within = lambda at: not turn_end or text.count(turn_end, cursor, at) <= 1
        with self.lock:
            for m in messages:
                variants = self.records.get(reply_key(m)) if m.get("role") == "assistant" else None
                found = []
                for rank, variant in enumerate(variants or ()):
                    for sp in variant.spans:  # longest first
                        if (at := text.find(sp.text, cursor)) >= 0 and within(at):
                            found.append((len(sp.text), _shared_suffix(text[:at], variant.tail), rank, at, sp))
                            break
                if found:
                    *_, at, span = max(found, key=lambda f: f[:3])
                    out.append((at, span))
                    cursor = at + len(span.text)
                    continue
                content = m.get("content")
                if isinstance(content, str) and content and (at := text.find(content, cursor)) >= 0:
                    cursor = at + len(content)
        return out

    def has_any(self, messages: list[dict]) -> bool:
        with self.lock:
            return self.enabled and bool(self.records) and any(
                m.get("role") == "assistant" and reply_key(m) in self.records for m in messages)


def encode_spliced(tokenizer, text: str, splices: list[tuple[int, Span]]) -> list[int]:
    """`text` encoded with each spliced span's generated ids in place of its own encoding."""
    out, cursor = [], 0
    for at, span in splices:
        out += tokenizer.encode(text[cursor:at], add_special_tokens=False)
        out += list(span.ids)
        cursor = at + len(span.text)
    return out + tokenizer.encode(text[cursor:], add_special_tokens=False)
