from __future__ import annotations

from mtplx.engine.segments import SegmentTracker
from mtplx.engine.stats import GenerationStats


def test_segments_follow_markup(tokenizer):
    ids = tokenizer.encode("<think>\nplan\n</think>\n\n<tool_call>\n{\"a\": 1}\n</tool_call>done", add_special_tokens=False)
    tracker = SegmentTracker(tokenizer)
    segs = [tracker.segment_of(t) for t in ids]
    text = lambda seg: tokenizer.decode([t for t, s in zip(ids, segs) if s == seg])
    assert text("reasoning") == "<think>\nplan\n</think>"
    assert text("tool_call") == "<tool_call>\n{\"a\": 1}\n</tool_call>"
    assert text("content") == "\n\ndone"


def test_tau_and_acceptance_by_depth():
    s = GenerationStats(mode="mtp", depth=3)
    s.record_verify(["content"] * 3, 3)
    s.record_verify(["reasoning"] * 3, 1)
    assert s.tau == (4 + 2) / 2
    assert s.acceptance_by_depth == [1.0, 0.5, 0.5]
    assert s.accepted_by_segment == {"reasoning": 1, "content": 3, "tool_call": 0}
