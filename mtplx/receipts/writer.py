"""Folding engine events into receipt rows: the receipt writer is one more event consumer.

It runs as an engine listener (on the engine thread), so it only collects; a row is written
when its request ends. A store that cannot write holds the row back for a later write, or drops
it with a log line (receipts/store.py). The engine thread never waits long on the disk: its store
gives up on a lock after WAIT_S (another process holding receipts.db stalled every stream 2 s per
finished request), and rows held back are retried from a thread of their own.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import threading

from mtplx.events import EngineEvent, Failed, Finished, FirstToken, Queued, Restored, Tokens
from mtplx.receipts.store import SHARING, ReceiptStore

log = logging.getLogger("mtplx.receipts")


def client_finish(finish_reason: str, tool_calls: int) -> str:
    """The finish reason as an OpenAI client saw it: a reply that called a tool ended in
    `tool_calls`; "cancelled" stays (the client saw no finish at all)."""
    return "tool_calls" if tool_calls and finish_reason == "stop" else finish_reason


def receipt_id() -> str:
    """Sortable by time: nanoseconds since the epoch, then randomness."""
    import time

    return f"r{time.time_ns():019d}{os.urandom(3).hex()}"


WAIT_S = 0.05  # the most a write on the engine thread waits for a lock on receipts.db
RETRY_S = 0.5  # how often rows held back are tried again
BODY_LIMIT = 256 * 1024  # characters of raw request kept; a longer one keeps its head and says so


def bounded_body(raw: str, limit: int = BODY_LIMIT) -> str:
    if len(raw) <= limit:
        return raw
    return json.dumps({"truncated": True, "chars": len(raw), "head": raw[:limit]})


class ReceiptWriter:
    def __init__(self, store: ReceiptStore, model: str, identity: str, keep_body: bool | None = None):
        """`keep_body`: store the raw request (bounded); default on, off with MTPLX_RECEIPT_BODY=off."""
        self.store, self.model, self.identity = store, model, identity
        if keep_body is None:
            keep_body = os.environ.get("MTPLX_RECEIPT_BODY", "on").lower() not in ("off", "0", "no", "false")
        self.keep_body = keep_body
        self.open: dict[str, dict] = {}
        self.lock = threading.Lock()
        self._retrying: threading.Thread | None = None
        self._closed = threading.Event()

    def __call__(self, event: EngineEvent) -> None:
        with self.lock:
            row = self._fold(event)
        if row is not None and not self.store.add(row) and self.store.backlog and self.store.writable:
            self._retry_later()

    def _retry_later(self) -> None:
        """Rows held back (a lock, a full disk) go in as soon as the store takes them, without
        waiting for the next turn to end (a crash in between would lose them)."""
        if self._retrying is not None and self._retrying.is_alive():
            return

        def retry():
            while self.store.backlog and not self._closed.wait(RETRY_S):
                self.store.flush()

        self._retrying = threading.Thread(target=retry, name="mtplx-receipts-retry", daemon=True)
        self._retrying.start()

    def close(self) -> None:
        """The engine stops: one last try at the receipts a full disk held back."""
        self._closed.set()
        self.store.flush()
        if self.store.backlog:
            log.warning("%d receipts not stored: the disk still refuses them", len(self.store.backlog))

    def _body(self, request) -> str:
        """The request as its client sent it; for in-process callers (TUI chat, replay screen) that
        send no body, the chat they rendered. Bounded, or only its size when bodies are off."""
        raw = request.raw
        if raw is None and request.chat:
            raw = json.dumps({"messages": request.chat.get("messages"), "tools": request.chat.get("tools"),
                              "max_tokens": getattr(request.sampling, "max_tokens", None)}, default=str)
        if raw is None or not self.keep_body:
            return json.dumps({"prompt_tokens": len(request.prompt), "body": "not kept" if raw else "none"})
        return bounded_body(raw)

    def _fold(self, event: EngineEvent) -> dict | None:
        """The row to write when `event` ends its request, else None."""
        rid = event.request_id
        if rid is None:
            return None
        if isinstance(event, Queued):
            r = event.request
            if r is None or r.source == "render_ahead":
                return None
            self.open[rid] = {"t0": event.t, "row": {
                "id": receipt_id(), "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
                "session": r.session, "source": r.source, "model": self.model, "model_identity": self.identity,
                "arm": r.arm, "prompt_tokens": len(r.prompt), "request_id": rid, "request_json": self._body(r),
            }}
            return None
        state = self.open.get(rid)
        if state is None:
            return None
        row = state["row"]
        if isinstance(event, Restored):
            row.update(ceiling=event.ceiling, cached_tokens=event.cached_tokens, restore_source=event.source,
                       anchor=event.anchor, shortfall=event.shortfall, entry_id=event.entry_id,
                       render_ahead=event.render_ahead, entry_origin=event.entry_origin)
        elif isinstance(event, FirstToken):
            row["ttft_first_token_s"] = event.ttft_s
        elif isinstance(event, Tokens):  # the engine split the reply: the first content piece is visible
            if any(p.kind == "content" for p in event.pieces) and "ttft_first_visible_s" not in row:
                row["ttft_first_visible_s"] = event.t - state["t0"]
        elif isinstance(event, (Finished, Failed)):
            self.open.pop(rid)
            if isinstance(event, Finished):
                s = event.stats
                finish = client_finish(event.finish_reason, len(event.reply.get("tool_calls", [])))
                row.update(completion_tokens=event.completion_tokens, finish_reason=finish,
                           output_sha256=hashlib.sha256(event.text.encode()).hexdigest(),
                           prefill_tps=s.prefill_tps, decode_tps=s.decode_tps, mode=s.mode,
                           depth=s.depth, tau=s.tau,
                           drafted_by_depth=json.dumps(list(s.drafted_by_depth)),
                           accepted_by_depth=json.dumps(list(s.accepted_by_depth)),
                           reasoning_tokens=s.tokens_by_segment.get("reasoning"),
                           **{column: getattr(s, column) for column in SHARING},
                           **({"predicted_drafted": s.predicted_drafted, "predicted_accepted": s.predicted_accepted}
                              if s.predicted_drafted else {}))
            else:
                row.update(finish_reason="failed", shortfall=row.get("shortfall") or event.message)
            return row
        return None
