"""Requests being served right now: who sent them, the phase (queued, prefill with its progress,
decode with live speed)."""

from __future__ import annotations

from textual.widgets import Static

from mtplx.events import Failed, Finished, FirstToken, PrefillProgress, Queued, Restored, Tokens



class InFlight(Static):
    def on_mount(self) -> None:
        self.requests: dict[str, dict] = {}
        self.border_title = "in flight"
        self.refresh_view()

    def track(self, event, show: bool = True) -> None:
        """Note the event; `show` False only counts it (the dashboard shows the panel later)."""
        rid = event.request_id
        if isinstance(event, Queued):
            r = event.request
            self.requests[rid] = {"source": getattr(r, "source", "?"), "session": getattr(r, "session", None),
                                  "phase": "queued", "done": 0,
                                  "total": getattr(r, "prompt_tokens", None) or len(getattr(r, "prompt", ()) or ()),
                                  "tokens": 0, "first": None, "last": None}
        elif rid in self.requests:
            r = self.requests[rid]
            if isinstance(event, Restored):
                r["phase"] = "prefill"
            elif isinstance(event, PrefillProgress):
                r["done"], r["total"] = event.done, event.total
            elif isinstance(event, FirstToken):
                r["phase"], r["first"] = "decode", event.t
            elif isinstance(event, Tokens):
                r["tokens"] += len(event.token_ids)
                r["last"] = event.t
            elif isinstance(event, (Finished, Failed)):
                del self.requests[rid]
        if show:
            self.refresh_view()

    def on_resize(self) -> None:
        if hasattr(self, "requests"):
            self.refresh_view()

    def refresh_view(self) -> None:
        if not self.requests:
            self.update("nothing running")
            return
        lines = []
        for r in self.requests.values():
            who = f"{r['source'][:6]:<6} {str(r['session'] or '-')[:10]:<10}"
            if r["phase"] == "decode":
                # speed from the engine's own event times, so it is the decode rate, not the UI's
                span = (r["last"] or r["first"]) - r["first"]
                speed = f" {r['tokens'] / span:5.1f} tok/s" if span > 0 and r["tokens"] > 1 else ""
                lines.append(f"{who} decode  {r['tokens']} tokens{speed}")
            else:
                count = f"{r['done']}/{r['total']}"
                room = (self.content_size.width or 60) - len(who) - 9 - len(count) - 1
                frac = r["done"] / r["total"] if r["total"] else 0
                width = min(16, room)
                bar = ("█" * round(frac * width) + "░" * (width - round(frac * width)) + " ") if width >= 4 else ""
                lines.append(f"{who} {r['phase']:<7} {bar}{count}")
        self.update("\n".join(lines))
