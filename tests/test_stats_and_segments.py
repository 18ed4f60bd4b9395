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


def test_a_tracker_never_builds_the_whole_vocabulary(monkeypatch):
    """One tracker per request: with Qwen3's real 151k-entry tokenizer, `get_vocab()` took ~200 ms
    of every turn's time to first token. The markers are looked up one by one."""
    from pathlib import Path

    import pytest
    from transformers import AutoTokenizer

    path = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers" / "qwen3"
    if not path.exists():
        pytest.skip("needs the real Qwen3 tokenizer in ../shared/fixtures/tokenizers/qwen3 (absent)")
    tokenizer = AutoTokenizer.from_pretrained(str(path))

    def whole(*args, **kwargs):
        raise AssertionError("get_vocab() per request")

    monkeypatch.setattr(type(tokenizer), "get_vocab", whole)
    tracker = SegmentTracker(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    assert tracker.opens == {ids[0]: "reasoning", ids[2]: "tool_call"} and tracker.closes == {ids[1], ids[3]}
    from mtplx.vocab import token_id

    assert token_id(tokenizer, "<not a token>") is None
