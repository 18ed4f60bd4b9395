"""One snapshot per TUI screen, fed fixed events so timings cannot make it flaky."""

from __future__ import annotations

from mtplx.events import DraftVerified, Finished, FirstToken, Restored, Tokens
from mtplx.engine.stats import GenerationStats
from tui.app import MtplxApp


def _turn(rid: str, prompt: int, cached: int, text: str, drafted: list[int], accepted: list[int]) -> list:
    stats = GenerationStats(mode="mtp", depth=len(drafted), prompt_tokens=prompt, cached_tokens=cached,
                            completion_tokens=40, verify_calls=drafted[0], drafted_by_depth=drafted,
                            accepted_by_depth=accepted, ttft_s=0.125, decode_s=0.5)
    stats.drafted_by_segment.update(reasoning=sum(drafted) // 2, content=sum(drafted) - sum(drafted) // 2)
    stats.accepted_by_segment.update(reasoning=sum(accepted) // 2, content=sum(accepted) - sum(accepted) // 2)
    return [Restored(rid, prompt, cached, "ram" if cached else "cold", "message" if cached else None, 650 if cached else 37),
            FirstToken(rid, 0.125),
            Tokens(rid, (1,), text, "content"), DraftVerified(rid, 2, 1, "content"),
            Finished(rid, "stop", prompt, 40, cached, text, (1,), stats.as_dict())]


def test_chat_screen(snap_compare):
    app = MtplxApp(engine=None, model_name="tiny-dense")

    async def run_before(pilot):
        chat = app.query_one("#chat")
        chat.add_message("user", "Explain what src/ledger/events.py does")
        chat.start_reply()
        app.feed(_turn("r1", 620, 0, "<think>\nI need to read it.\n</think>\n\nIt defines `emit`.", [10, 9], [9, 7]))
        chat.add_message("user", "Now run the tests")
        chat.start_reply()
        app.feed(_turn("r2", 700, 650, "The tests pass.", [8, 8], [8, 6]))
        app.query_one("#bank").show([
            {"session": "tui", "tokens": 740, "bytes": 3_100_000, "hits": 1, "checkpoints": [37, 620, 699],
             "anchors": [(37, "head"), (60, "message"), (619, "prompt_end"), (661, "generation_end"), (700, "message")]},
            {"session": "tui", "tokens": 662, "bytes": 2_700_000, "hits": 0, "checkpoints": [37],
             "anchors": [(37, "head"), (60, "message"), (619, "prompt_end"), (661, "generation_end")]},
        ])
        await pilot.pause()

    assert snap_compare(app, terminal_size=(150, 34), run_before=run_before)
