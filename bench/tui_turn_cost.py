"""What one more finished turn costs the TUI's UI thread, by the rows its turns table already holds.

    python bench/tui_turn_cost.py

Runs the dashboard headless (Textual's test driver, 150x42), feeds finished turns (the events an
agent's request produces: Queued, Restored, FirstToken, Tokens, DraftVerified, Finished) until the
table holds 10, 100, 300 and 500 rows, then times 5 more turns each (feed + render; median). The UI
thread shares the GIL with the engine thread, so this is time an agent served alongside loses.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.engine.stats import GenerationStats  # noqa: E402
from mtplx.events import DraftVerified, Finished, FirstToken, Queued, Restored, Tokens  # noqa: E402
from mtplx.reply_stream import ReplyStream  # noqa: E402
from tui.app import MtplxApp  # noqa: E402


def turn(rid: str) -> list:
    text = "The tests pass."
    stats = GenerationStats(mode="mtp", depth=2, prompt_tokens=600, completion_tokens=40, verify_calls=2,
                            drafted_by_depth=[2, 2], accepted_by_depth=[1, 0], ttft_s=0.125, decode_s=0.5)
    pieces = tuple(ReplyStream().feed(text, final=True))
    return [Queued(rid, 0, SimpleNamespace(source="api", session="agent", prompt_tokens=600)),
            Restored(rid, 600, 0, "cold", None, 37), FirstToken(rid, 0.125), Tokens(rid, (1,), text, "content", pieces),
            DraftVerified(rid, 2, 1, "content"), Finished(rid, "stop", 600, 40, 0, text, (1,), stats.freeze(), pieces)]


async def main() -> None:
    app = MtplxApp(engine=None, model_name="tiny-dense", server_url="http://127.0.0.1:8080")
    async with app.run_test(size=(150, 42)) as pilot:
        n = 0
        for rows in (10, 100, 300, 500):
            while n < rows:
                app.feed(turn(f"r{n}"))
                n += 1
            await pilot.pause(0.2)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                app.feed(turn(f"r{n}"))
                n += 1
                await pilot.pause()
                times.append(time.perf_counter() - t)
            print(f"{rows:>4} rows: one more turn {statistics.median(times) * 1e3:6.1f} ms (median of 5, feed + render)")


if __name__ == "__main__":
    asyncio.run(main())
