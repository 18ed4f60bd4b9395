"""Many agents over several engines (docs/scale.md): two `mtplx serve` instances of tiny-dense,
each with its own MTPLX_HOME, behind SMG (PyPI `smg`, in the test extra) with consistent hashing
on the session headers. bench/router.py drives the same scenario at length; this is its short form.

What one engine restores is known without a third instance: the server reports a turn's cached
tokens, and the bank of a dense model restores a later turn up to where its prompt stops agreeing
with the earlier turn's prompt plus reply (render-ahead renders the reply as the template will
re-render it). So the floor asserted for turn 2 is the turn-1 prompt's share of the turn-2 prompt,
token for token (tokenizer only, no engine): "the whole previous prompt". Routed without affinity
the turn would land on an instance that never saw the session about half the time and restore 0.
"""

from __future__ import annotations

import itertools
import re
import shutil
import signal
import sys
from pathlib import Path

import httpx
import pytest

SMG = shutil.which("smg") or shutil.which("smg", path=str(Path(sys.executable).parent))
pytestmark = pytest.mark.skipif(SMG is None, reason="SMG's router is not installed (pip install -e '.[test]' brings it)")


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _placement(procs, prompts: dict[str, int]) -> dict[str, int]:
    """Which instance served each session, from the prompt tokens each instance counted (SMG does
    not forward the session header, so the banks name no sessions). Exactly one assignment must add
    up: a session whose turns were split over the instances matches none."""
    totals = [int(re.search(r"^mtplx_prompt_tokens_total (\d+)$", httpx.get(url + "/metrics").text, re.M)[1])
              for _, url in procs]
    fits = [dict(zip(prompts, where)) for where in itertools.product(range(len(procs)), repeat=len(prompts))
            if all(sum(n for s, n in prompts.items() if dict(zip(prompts, where))[s] == i) == total
                   for i, total in enumerate(totals))]
    assert len(fits) == 1, f"prompt tokens per instance {totals} for sessions {prompts}: {len(fits)} placements fit"
    return fits[0]


def test_router_affinity_restores_the_previous_prompt_and_survives_a_killed_instance(tokenizer):
    from bench.router import POLICIES, Session, instances, router
    from mtplx.chat import render
    from mtplx.synth.heads import HEADS

    with instances("tiny-dense", 2) as procs, router(SMG, [u for _, u in procs], POLICIES["affinity"]) as url, \
            httpx.Client(timeout=120) as client:
        sessions = [Session(f"agent-{i}", 700 + i, HEADS[i % len(HEADS)], "tiny-dense") for i in range(2)]
        rows = {}
        for turn in (1, 2):
            for s in sessions:
                rows[s.name, turn] = s.turn(client, url)
                assert rows[s.name, turn]["status"] == 200, rows[s.name, turn]
                rows[s.name, turn]["ids"] = render(tokenizer, s.sent[:-1], s.tools)  # what it sent (the reply is last)
        for s in sessions:
            first, second = rows[s.name, 1], rows[s.name, 2]
            assert len(first["ids"]) == first["prompt"] and len(second["ids"]) == second["prompt"]  # our render is the server's
            floor = _common(first["ids"], second["ids"])
            assert floor > 0.9 * first["prompt"], (s.name, floor, first["prompt"])  # the test asks something real
            print(f"{s.name}: turn 1 prompt {first['prompt']} cached {first['cached']}; turn 2 prompt {second['prompt']} "
                  f"cached {second['cached']}, turn-1 prompt shared {floor}")
            assert second["cached"] >= floor, (s.name, second["cached"], floor)

        where = _placement(procs, {s.name: rows[s.name, 1]["prompt"] + rows[s.name, 2]["prompt"] for s in sessions})
        killed = where[sessions[0].name]
        procs[killed][0].send_signal(signal.SIGKILL)
        procs[killed][0].wait()
        for s in sessions:  # the router moves the dead instance's sessions: they start cold, never fail
            row = s.turn(client, url)
            moved = where[s.name] == killed
            print(f"{s.name} on instance {where[s.name]}, after instance {killed} was killed ({'moved' if moved else 'stays'}): "
                  f"status {row['status']}, prompt {row.get('prompt')}, cached {row.get('cached')}")
            assert row["status"] == 200, row
            if not moved:  # a session on the surviving instance keeps its cache
                assert row["cached"] >= _common(rows[s.name, 2]["ids"], render(tokenizer, s.sent[:-1], s.tools)), row
