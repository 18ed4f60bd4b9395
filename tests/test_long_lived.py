"""mtplx/long_lived.py: a serving process's startup heap leaves Python's full collections, and
what it allocates later is still collected; `mtplx tui` freezes once its dashboard is drawn."""

from __future__ import annotations

import subprocess
import sys


def test_frozen_heap_is_left_alone_and_later_cycles_still_collected():
    # In a process of its own: a freeze is for the life of the process, never the test runner's.
    code = """
import gc
from mtplx import long_lived
import mlx.core, transformers  # a heap like a server's
long_lived.freeze()
frozen = gc.get_freeze_count()
class Node: pass
a, b = Node(), Node(); a.other, b.other = b, a
del a, b
print(frozen, gc.collect())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    frozen, collected = map(int, out.stdout.split())
    assert frozen > 10_000  # the imported modules' objects
    assert collected >= 2  # the cycle made after the freeze


def test_the_tui_freezes_once_its_dashboard_is_drawn(monkeypatch):
    import asyncio

    from mtplx import long_lived
    from tui.app import MtplxApp

    calls = []
    monkeypatch.setattr(long_lived, "freeze", lambda: calls.append(1))

    async def flow(flag):
        app = MtplxApp(engine=None, model_name="tiny-dense", server_url=None)
        app.freeze_when_drawn = flag
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.1)

    asyncio.run(flow(False))
    assert calls == []  # a library user's app (and every other test) is left alone
    asyncio.run(flow(True))
    assert calls == [1]
