"""Every key, on one screen that fits the terminal (it scrolls when the terminal is small)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """[b]mtplx — keys[/b] (f1 works while typing; ctrl+p lists every action)

  enter      send the message typed below the chat (queued while a reply generates)
  ctrl+l     new chat: a new session id (the bank keeps its entries)
  f4 / f5 / f6   focus the turns table / the bank table / the chat input
  enter      on a turn or a receipt: its numbers, receipt, raw request, restored entry
  f2         replay a frozen transcript: n next turn, a run all, p agent pauses between
             turns on/off (off: back to back, as mtplx replay), c compare bank on/off
  f3         browse receipts (one row per turn, any source, newest first)
  f7         TTFT charts with axes: by turn, and by prompt tokens computed
  f1         this help          escape  back          ctrl+q  quit

[b]reading the panels[/b]
  turns      newest first: prompt tokens, the reuse ceiling (tokens known when the
             previous turn ended), cached (restored from the bank), ratio = cached /
             ceiling ('+' when more was restored than the ceiling counted), TTFT,
             decode speed, tau (tokens per verify), session, where the restore came
             from, finish as the client saw it, why a turn fell short; narrow
             terminals drop the later columns first. The chart: TTFT and ratio
  bank       one row per entry (live: updated on every store and restore); "ahead"
             marks a render-ahead entry (the next turn's expected rendering); the
             strip: H head, M message end, P prompt end, G generation end, # grid,
             | recurrent checkpoint
  anchor map the selected entry to scale; the red mark is where the restore cut:
             the selected turn's own restore, or the entry's latest
  acceptance MTP drafts kept by draft depth: live for the request decoding, and over
             all turns (also by segment: reasoning, content, tool call)
  in flight  requests being served: source, session, queued / prefill / decode
  decisions  what the bank stored, restored, thinned, superseded or evicted, and why
  attached   the line under the panels says connected, refused, unauthorized or
             when it reconnects
"""


class HelpScreen(ModalScreen):
    BINDINGS = [("escape", "app.pop_screen", "Back"), ("q", "app.pop_screen", "Back"), ("f1", "app.pop_screen", "Back")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(HELP)
