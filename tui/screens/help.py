"""Every key, on one screen: lines of at most 76 cells, so it fits 80 columns; it scrolls when
the terminal is short."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """[b]mtplx — keys[/b] (f1 works while typing; ctrl+p lists every action)

  enter     send the message typed below the chat (queued while a reply
            generates; sent in order)
  ctrl+l    new chat: a new session id (the bank keeps its entries)
  f4 f5 f6  focus the turns table / the bank table / the chat input
  enter     on a turn or a receipt: its numbers, receipt, raw request and
            the entry it restored from
  f2        replay a transcript: n next turn, a run all, p agent pauses
            between turns (off: back to back, as mtplx replay), c compare
            bank on/off on fresh engines
  f3        receipts (one row per turn, any source, newest first)
  f7        TTFT charts with axes: by turn, by prompt tokens computed
  f1        this help       escape  back       ctrl+q  quit

[b]reading the panels[/b]
  turns     newest first: prompt tokens, reuse ceiling (tokens known when
            the previous turn ended), cached (restored from the bank),
            ratio = cached / ceiling ('+': more restored than counted),
            TTFT, decode speed, tau (tokens per verify), session, restore
            source, finish as the client saw it, why a turn fell short;
            narrow terminals drop the later columns first
  chart     TTFT and ratio per turn (f7: with axes)
  bank      one row per entry, live (every store and restore); "ahead":
            a render-ahead entry (the next turn's expected rendering),
            "ssd": on disk only; the strip: H head (S: its system text
            before the tools), M message end, P prompt end, G generation
            end, # grid, | recurrent checkpoint
  anchor    the selected entry to scale; the red mark is where the restore
  map       cut: the bank's latest, or the selected turn's own (f4)
  accept-   MTP drafts kept by draft depth: live for the request decoding,
  ance      and over all turns (also by segment)
  in flight requests being served: source, session, queued/prefill/decode
  decisions what the bank stored, restored, thinned, superseded, evicted
  attached  the line under the panels: connected, refused, unauthorized,
            or when it reconnects
"""


class HelpScreen(ModalScreen):
    BINDINGS = [("escape", "app.pop_screen", "Back"), ("q", "app.pop_screen", "Back"), ("f1", "app.pop_screen", "Back")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(HELP)
