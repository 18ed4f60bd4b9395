"""Requests being served right now: who sent them, prefill progress, live decode speed."""

from __future__ import annotations

import time

from textual.widgets import Static

from mtplx.events import Failed, Finished, FirstToken, PrefillProgress, Queued, Tokens

BAR = 16


class InFlight(Static):
    def on_mount(self) -> None:
        self.requests: dict[str, dict] = {}
        self.border_title = "in flight"
        self.refresh_view()

    def track(self, event) -> None:
        rid = event.request_id
        if isinstance(event, Queued):
            r = event.request
            self.requests[rid] = {"source": getattr(r, "source", "?"), "session": getattr(r, "session", None),
                                  "done": 0, "total": getattr(r, "prompt_tokens", None) or len(getattr(r, "prompt", ()) or ()),
                                  "tokens": 0, "first": None}
        elif rid in self.requests:
            r = self.requests[rid]
            if isinstance(event, PrefillProgress):
                r["done"], r["total"] = event.done, event.total
            elif isinstance(event, FirstToken):
                r["first"] = time.monotonic()
            elif isinstance(event, Tokens):
                r["tokens"] += len(event.token_ids)
            elif isinstance(event, (Finished, Failed)):
                del self.requests[rid]
        self.refresh_view()

    def refresh_view(self) -> None:
        if not self.requests:
            self.update("nothing running")
            return
        lines = []
        for rid, r in self.requests.items():
            frac = r["done"] / r["total"] if r["total"] else 0
            bar = "█" * round(frac * BAR) + "░" * (BAR - round(frac * BAR))
            speed = ""
            if r["first"] and r["tokens"]:
                speed = f" {r['tokens'] / max(time.monotonic() - r['first'], 1e-3):5.1f} tok/s"
            lines.append(f"{r['source']:<6} {str(r['session'] or '-')[:10]:<10} prefill {bar} {r['done']}/{r['total']}"
                         f"  {r['tokens']} tokens{speed}")
        self.update("\n".join(lines))
