"""Every key, on one screen."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """[b]mtplx — keys[/b]

  enter      send the message typed below the chat
  ctrl+l     new conversation (the bank keeps its entries)
  f2         replay a frozen transcript: n next turn, a run all, c compare bank on/off
  f3         browse receipts (one row per turn, any source)
  f1 / ?     this help          escape  back          ctrl+q  quit

[b]reading the panels[/b]
  turns      prompt tokens, the reuse ceiling (tokens known when the previous turn ended),
             cached (restored from the bank), ratio = cached / ceiling, TTFT, decode speed,
             tau (tokens per verify), where the restore came from, why a turn fell short;
             the chart below: TTFT and ratio per turn
  bank       one row per entry; the strip marks anchors: H head, M message end,
             P prompt end, G generation end, # grid, | recurrent checkpoint
  anchor map the selected entry to scale (arrows select); the red mark is where the
             latest restore from it cut
  acceptance MTP drafts kept by draft depth: live for the request decoding, and over all
             turns (also by segment: reasoning, content, tool call)
  in flight  requests being served, their source, prefill progress and live speed
  decisions  what the bank stored, restored, thinned, superseded or evicted, and why
"""


class HelpScreen(ModalScreen):
    BINDINGS = [("escape", "app.pop_screen", "Back"), ("q", "app.pop_screen", "Back")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Static(HELP)
