"""The bank's pure planner, on small integer lists (no MLX)."""

from __future__ import annotations

from mtplx.bank.anchors import Anchor, Markers, prompt_anchors, turn_ends
from mtplx.bank.plan import (EntryView, MessageSpan, attribute_miss, common_prefix, plan_eviction, plan_restore,
                             plan_room, superseded, thin_checkpoints)

M = Markers(turn_start=1, turn_end=2, newline=3, system=(9,))


def convo(n_messages: int, body: int = 20) -> list[int]:
    out = []
    for k in range(n_messages):
        out += [1, 9 if k == 0 else 8] + [100 + (k * 7 + j) % 50 for j in range(body)] + [2, 3]
    return out + [1, 7]  # generation prompt


def entry(eid, tokens, restorable=None, mtp_len=None, last_hidden=False, used=0.0, nbytes=10, identity="m:ar"):
    return EntryView(eid, tuple(tokens), identity, restorable, mtp_len, last_hidden, None, used, nbytes)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix(list(range(5000)), list(range(4000)) + [0]) == 4000


def test_anchors_find_turn_ends_and_head():
    prompt = convo(3)
    anchors = prompt_anchors(prompt, M, min_restore=1, grid=10_000)
    kinds = [(a.position, a.kind) for a in anchors]
    assert kinds[0] == (24, "head") and (48, "message") in kinds and (72, "message") in kinds
    assert kinds[-1] == (len(prompt) - 1, "prompt_end")
    assert turn_ends(prompt, Markers(None, None, None)) == []


def test_short_head_is_not_an_anchor():
    anchors = prompt_anchors(convo(2, body=2), M, min_restore=32, grid=10_000)
    assert all(a.kind != "head" for a in anchors)


def test_dense_restores_at_the_match_and_hybrid_at_checkpoints():
    prompt = convo(4)
    old = prompt[:60] + [999] * 10
    dense = plan_restore(prompt, [], [entry("a", old)], "m:ar", need_mtp=False, recurrent=False, min_restore=1)
    assert (dense.entry_id, dense.position) == ("a", 60)
    hybrid = plan_restore(prompt, prompt_anchors(prompt, M, min_restore=1, grid=10_000),
                          [entry("a", old, restorable=(24, 48, 70))], "m:ar", need_mtp=False, recurrent=True, min_restore=1)
    assert hybrid.position == 48 and hybrid.note and all(c > 48 for c in hybrid.captures)


def test_mtp_needs_history_up_to_the_point():
    prompt = convo(4)
    e = entry("a", prompt[:48], restorable=(24, 48), mtp_len=47, last_hidden=True)
    assert plan_restore(prompt, [], [e], "m:ar", need_mtp=True, recurrent=True, min_restore=1).position == 48
    e = entry("a", prompt[:48], restorable=(24, 48), mtp_len=47, last_hidden=False)
    assert plan_restore(prompt, [], [e], "m:ar", need_mtp=True, recurrent=True, min_restore=1).position == 24


def test_identity_mismatch_is_never_restored():
    prompt = convo(3)
    plan = plan_restore(prompt, [], [entry("a", prompt, identity="other:ar")], "m:ar", need_mtp=False, recurrent=False)
    assert plan.entry_id is None and plan.position == 0


def test_longest_restore_wins_then_recency():
    prompt = convo(4)
    entries = [entry("short", prompt[:30], used=5), entry("long", prompt[:70], used=1), entry("long2", prompt[:70], used=2)]
    assert plan_restore(prompt, [], entries, "m:ar", need_mtp=False, recurrent=False).entry_id == "long2"


def test_eviction_is_lru_and_spares_protected():
    entries = [entry("a", [1], used=1, nbytes=50), entry("b", [2], used=2, nbytes=50), entry("c", [3], used=3, nbytes=50)]
    assert plan_eviction(entries, 100, protected={"a"}) == ["b"]
    assert plan_eviction(entries, 200) == []


def test_longer_entry_supersedes_prefix():
    a = entry("a", [1, 2, 3])
    b = entry("b", [1, 2, 3, 4])
    c = entry("c", [1, 2, 9, 9])
    assert superseded(b, [a, b, c]) == ["a"]
    assert superseded(entry("h", [1, 2, 3, 4], restorable=(4,)), [entry("g", [1, 2, 3], restorable=(2, 3))]) == []


def test_thinning_keeps_pinned_oldest_and_frontier():
    kept = thin_checkpoints(list(range(10, 200, 10)), 5, pinned={30})
    assert kept == [10, 30, 170, 180, 190]


def test_miss_attribution_names_stripped_reasoning():
    think = 77
    prompt = [1, 9, 5, 2, 3, 1, 8, 5, 2, 3, 1, 6, 4, 4]
    old = prompt[:10] + [1, 6, think, 4]
    spans = [MessageSpan(0, "system", 0, 5), MessageSpan(1, "user", 5, 10), MessageSpan(2, "assistant", 10, 14)]
    report = attribute_miss(prompt, spans, achieved=10, ceiling=14, best_entry_tokens=tuple(old),
                            other_identity=False, evicted_match=0, note=None, think_id=think)
    assert report.cause == "assistant[2].reasoning stripped"
    report = attribute_miss(prompt, spans, 0, 14, None, other_identity=True, evicted_match=0, note=None, think_id=think)
    assert report.cause.startswith("identity mismatch")


def test_room_for_an_ssd_file_drops_least_recently_used_only_when_it_then_fits():
    stored = [("old", 40), ("mid", 30), ("new", 20)]  # least recently used first
    assert plan_room(stored, 10, budget_bytes=100, free_bytes=500, floor_bytes=100) == []
    assert plan_room(stored, 30, budget_bytes=100, free_bytes=500, floor_bytes=100) == ["old"]  # the budget
    assert plan_room(stored, 10, budget_bytes=1000, free_bytes=105, floor_bytes=100) == ["old"]  # the free floor
    assert plan_room(stored, 50, budget_bytes=1000, free_bytes=100, floor_bytes=100) == ["old", "mid"]
    assert plan_room(stored, 95, budget_bytes=1000, free_bytes=100, floor_bytes=100) is None  # never fits
    assert plan_room(stored, 101, budget_bytes=100, free_bytes=10**9, floor_bytes=0) is None  # over the budget alone
    assert plan_room([], 5, budget_bytes=100, free_bytes=5, floor_bytes=0) == []  # exactly fits
