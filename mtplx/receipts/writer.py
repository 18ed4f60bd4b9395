"""Folding engine events into receipt rows: the receipt writer is one more event consumer.

It runs as an engine listener (on the engine thread), so it only collects; a row is written
when its request ends, and a store that cannot write drops the row with a log line.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading

from mtplx.events import EngineEvent, Failed, Finished, FirstToken, Queued, Restored, Tokens
from mtplx.receipts.store import ReceiptStore
from mtplx.reply_stream import ReplyStream


def receipt_id() -> str:
    """Sortable by time: nanoseconds since the epoch, then randomness."""
    import time

    return f"r{time.time_ns():019d}{os.urandom(3).hex()}"


class ReceiptWriter:
    def __init__(self, store: ReceiptStore, model: str, identity: str):
        self.store, self.model, self.identity = store, model, identity
        self.open: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.last_id: str | None = None

    def __call__(self, event: EngineEvent) -> None:
        with self.lock:
            self._fold(event)

    def _fold(self, event: EngineEvent) -> None:
        rid = event.request_id
        if rid is None:
            return
        if isinstance(event, Queued):
            r = event.request
            if r is None or r.source == "render_ahead":
                return
            self.open[rid] = {"t0": event.t, "reply": ReplyStream(), "row": {
                "id": receipt_id(), "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
                "session": r.session, "source": r.source, "model": self.model, "model_identity": self.identity,
                "arm": r.arm, "prompt_tokens": len(r.prompt), "request_json": r.raw or json.dumps({"prompt_tokens": len(r.prompt)}),
            }}
            return
        state = self.open.get(rid)
        if state is None:
            return
        row = state["row"]
        if isinstance(event, Restored):
            row.update(ceiling=event.ceiling, cached_tokens=event.cached_tokens, restore_source=event.source,
                       anchor=event.anchor, shortfall=event.shortfall)
        elif isinstance(event, FirstToken):
            row["ttft_first_token_s"] = event.ttft_s
        elif isinstance(event, Tokens) and "ttft_first_visible_s" not in row:
            if any(p.kind == "content" for p in state["reply"].feed(event.text)):
                row["ttft_first_visible_s"] = event.t - state["t0"]
        elif isinstance(event, (Finished, Failed)):
            self.open.pop(rid)
            if isinstance(event, Finished):
                s = event.stats
                row.update(completion_tokens=event.completion_tokens, finish_reason=event.finish_reason,
                           output_sha256=hashlib.sha256(event.text.encode()).hexdigest(),
                           prefill_tps=s.get("prefill_tps"), decode_tps=s.get("decode_tps"), mode=s.get("mode"),
                           depth=s.get("depth"), tau=s.get("tau"),
                           drafted_by_depth=json.dumps(s.get("drafted_by_depth", [])),
                           accepted_by_depth=json.dumps(s.get("accepted_by_depth", [])),
                           reasoning_tokens=s.get("tokens_by_segment", {}).get("reasoning"))
            else:
                row.update(finish_reason="failed", shortfall=row.get("shortfall") or event.message)
            self.store.add(row)
            self.last_id = row["id"]
