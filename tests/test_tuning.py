"""`mtplx tune` on the real tiny model: every arm decodes the same prompt in a round, and the
rounds cycle through prompts of different kinds (a depth tuned on one kind of text overfits it)."""

from __future__ import annotations

from mtplx import tuning
from mtplx.engine.engine import Engine


def test_tune_rotates_prompts_and_compares_arms_on_the_same_one(monkeypatch):
    seen = []
    submit = Engine.submit

    def spy(self, request):
        seen.append((request.prompt, request.use_mtp, request.depth))
        return submit(self, request)

    monkeypatch.setattr(Engine, "submit", spy)
    lines = []
    result = tuning.tune_model("tiny-dense", tokens=12, save=False, echo=lines.append)
    arms = 1 + 4
    warm, rounds = seen[:arms], [seen[arms + r * arms: arms + (r + 1) * arms] for r in range(tuning.ROUNDS)]
    assert len(seen) == arms * (1 + tuning.ROUNDS)
    assert len({p for p, _, _ in warm}) == 1
    for r, batch in enumerate(rounds):
        assert len({p for p, _, _ in batch}) == 1  # one prompt for every arm of a round
    assert len({batch[0][0] for batch in rounds}) == min(tuning.ROUNDS, len(tuning.PROMPTS))
    assert {d for _, mtp, d in rounds[0] if mtp} == {1, 2, 3, 4}
    assert set(result) == {"ar", "depth 1", "depth 2", "depth 3", "depth 4", "chosen"}
    assert any(line.startswith("chosen") for line in lines)
