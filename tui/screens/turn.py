"""One turn in full: its numbers, the bank entry it restored from drawn with the point it cut at
(the anchor map at that moment), its receipt and the raw request. Opened with enter on a turn
(the dashboard) or on a receipt (the receipts screen)."""

from __future__ import annotations

import json

from rich.markup import escape
from textual import work
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from mtplx.receipts.store import SHARING
from tui.widgets.anchor_map import AnchorMap
from tui.widgets.bank import made_by, origin_of

RAW_SHOWN = 20_000  # characters of the raw request drawn (the receipt keeps more)


def _f(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def numbers(receipt: dict) -> str:
    """The key numbers of a receipt-shaped row, a few per line."""
    from mtplx.bank.spans import reuse_ratio

    r = receipt
    ratio = reuse_ratio(r.get("cached_tokens"), r.get("ceiling"))
    by_depth = ""
    drafted, accepted = (json.loads(r.get(k) or "[]") for k in ("drafted_by_depth", "accepted_by_depth"))
    if drafted:
        by_depth = "  ".join(f"d{i + 1} {a}/{d}" for i, (d, a) in enumerate(zip(drafted, accepted)))
    if r.get("predicted_drafted"):  # a predicted output's drafts: they, not the head, make a tau of 16
        by_depth = (by_depth + "  " if by_depth else "") + \
            f"predicted {_f(r.get('predicted_accepted'))}/{r['predicted_drafted']}"
    return (f"prompt {_f(r.get('prompt_tokens'))}  ceiling {_f(r.get('ceiling'))}  cached {_f(r.get('cached_tokens'))}"
            f"  ratio {_f(ratio, '.2f')}\n"
            f"TTFT {_f(r.get('ttft_first_token_s'), '.3f')}s (first token)  {_f(r.get('ttft_first_visible_s'), '.3f')}s"
            f" (first visible)  prefill {_f(r.get('prefill_tps'), '.1f')} tok/s  decode {_f(r.get('decode_tps'), '.1f')}"
            f" tok/s\nmode {r.get('mode') or '-'} depth {_f(r.get('depth'))}  tau {_f(r.get('tau'), '.2f')}  "
            f"acceptance {by_depth or '-'}\n"
            f"from {r.get('restore_source') or '-'} at {r.get('anchor') or '-'} (entry {r.get('entry_id') or '-'}"
            f"{', ' + made_by(r['entry_origin']) if r.get('entry_origin') else ''})"
            f"  finish {r.get('finish_reason') or '-'}  completion {_f(r.get('completion_tokens'))} tokens\n"
            f"shortfall: {r.get('shortfall') or 'none'}\n"
            f"{sharing(r)}")


def sharing(r: dict) -> str:
    """How the turn shared the engine: what it waited for, and how many decoded beside it."""
    if r.get("rounds") is None:  # a receipt written before these were counted
        return "shared engine: -"
    if not r["rounds"]:
        return f"shared engine: queued {_f(r.get('queued_s'), '.3f')}s  no decode round after the first token"
    rows = r.get("rows_mean")
    return (f"shared engine: queued {_f(r.get('queued_s'), '.3f')}s  rounds {r['rounds']}, "
            f"{_f(r.get('batched_rounds'))} in a batch ({_f(rows, '.1f')} rows a round)  "
            f"others' work between its rounds {_f(r.get('others_s'), '.3f')}s")


def from_record(record) -> dict:
    """A turn the dashboard saw, in the receipt's shape (used until, or without, its receipt)."""
    s, r, f = record.finished.stats, record.restored, record.finished
    return {"request_id": record.request_id, "session": record.session, "source": record.source,
            "prompt_tokens": f.prompt_tokens, "ceiling": r.ceiling if r else None, "cached_tokens": f.cached_tokens,
            "restore_source": r.source if r else None, "anchor": r.anchor if r else None,
            "entry_id": r.entry_id if r else None, "entry_origin": r.entry_origin if r else None,
            "shortfall": r.shortfall if r else None,
            "ttft_first_token_s": s.ttft_s, "prefill_tps": s.prefill_tps,
            "decode_tps": s.decode_tps, "mode": s.mode, "depth": s.depth, "tau": s.tau,
            "drafted_by_depth": json.dumps(list(s.drafted_by_depth)),
            "accepted_by_depth": json.dumps(list(s.accepted_by_depth)),
            "predicted_drafted": s.predicted_drafted, "predicted_accepted": s.predicted_accepted,
            **{column: getattr(s, column) for column in SHARING},
            "finish_reason": record.finish, "completion_tokens": f.completion_tokens}


class TurnScreen(Screen):
    BINDINGS = [("escape", "app.pop_screen", "Back"), ("q", "app.pop_screen", "Back")]

    def __init__(self, title: str, row: dict, entry: dict | None, store=None):
        super().__init__()
        self.heading, self.row, self.entry, self.store = title, row, entry, store

    @classmethod
    def for_turn(cls, record, entry: dict | None, store=None) -> "TurnScreen":
        return cls(f"turn {record.number} · {record.source} · session {record.session or '-'}", from_record(record),
                   entry, store)

    @classmethod
    def for_receipt(cls, row: dict, entry: dict | None) -> "TurnScreen":
        return cls(f"receipt {row['id']} · {row.get('source') or '-'} · session {row.get('session') or '-'}", row, entry)

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with VerticalScroll(id="turn-detail"):
            yield Static(f"[b]{escape(self.heading)}[/b]", id="turn-title")
            yield Static(escape(numbers(self.row)), id="turn-numbers")
            yield AnchorMap(id="turn-map")
            yield Static("", id="turn-entry")
            yield Static("", id="turn-receipt")
            yield Static("", id="turn-request")
        yield Footer()

    def on_mount(self) -> None:
        cached = self.row.get("cached_tokens")
        if self.entry is not None:
            self.query_one(AnchorMap).show(self.entry, cached, f"anchor map at this turn · {cached} restored from "
                                                              f"{self.entry['id']}")
            e = self.entry
            kind = origin_of(e)
            self.query_one("#turn-entry", Static).update(escape(
                f"entry {e['id']} (from {kind}) · session {e.get('session') or '-'} · {e['tokens']} tokens · "
                f"hits {e.get('hits')}\nanchors {[tuple(a) for a in e['anchors']]}\ncheckpoints {e['checkpoints']}"))
        else:
            made = f" (from {made_by(self.row['entry_origin'])})" if self.row.get("entry_origin") else ""
            why = "cold: nothing restored" if not cached else f"entry {self.row.get('entry_id') or '?'}{made} not in view"
            self.query_one(AnchorMap).show(None, title=f"anchor map · {why}")
        if "id" in self.row:
            self.show_receipt(self.row)
        elif self.row.get("request_id"):
            self.load_receipt(self.row["request_id"])

    @work(thread=True)
    def load_receipt(self, request_id: str) -> None:
        from mtplx.receipts.store import ReceiptStore

        found = (self.store or ReceiptStore()).rows("request_id = ?", (request_id,), limit=1)
        if found:
            self.app.call_from_thread(self.show_receipt, found[0])
        else:
            self.app.call_from_thread(self.query_one("#turn-receipt", Static).update, "no receipt stored for this turn")

    def show_receipt(self, row: dict) -> None:
        self.query_one("#turn-numbers", Static).update(escape(numbers(row)))
        rest = {k: v for k, v in row.items() if k != "request_json" and v is not None}
        self.query_one("#turn-receipt", Static).update("[b]receipt[/b]\n" + escape(
            "\n".join(f"{k}: {v}" for k, v in rest.items())))
        raw = row.get("request_json") or ""
        try:
            raw = json.dumps(json.loads(raw), indent=2, ensure_ascii=False)
        except json.JSONDecodeError:
            pass
        more = f"\n… {len(raw) - RAW_SHOWN} more characters" if len(raw) > RAW_SHOWN else ""
        self.query_one("#turn-request", Static).update("[b]raw request[/b]\n" + escape(raw[:RAW_SHOWN]) + more)
