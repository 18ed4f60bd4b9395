"""`mtplx tune` on the real tiny model: every arm decodes the same prompt in a round, the rounds
cycle through prompts of different kinds (a depth tuned on one kind of text overfits it), and every
other round runs the arms in reverse."""

from __future__ import annotations

import pytest

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
    # every other round in reverse: no arm always decodes at the same point of a round
    order = lambda batch: [(mtp, d) for _, mtp, d in batch]
    assert order(rounds[1]) == order(rounds[0])[::-1] and order(rounds[2]) == order(rounds[0])
    assert set(result) == {"ar", "depth 1", "depth 2", "depth 3", "depth 4", "chosen"}
    assert any(line.startswith("chosen") for line in lines)


def test_a_failed_settings_write_keeps_the_old_file_whole(tmp_path, monkeypatch):
    import mtplx.settings as settings

    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    settings.store_tuned("model-a", True, 3, {"ar": 1.0})

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(settings.os, "replace", full)
    with pytest.raises(OSError):
        settings.store_tuned("model-b", False, 1, {"ar": 1.0})
    assert settings.tuned_default("model-a")["depth"] == 3 and settings.tuned_default("model-b") is None
    assert [p.name for p in tmp_path.iterdir()] == ["settings.json"]  # no temp file left


@pytest.mark.parametrize("text", ['{"tuned": []}', '{"tuned": {"m": "fast"}}', '{"tuned": {"m": {"mtp": "yes", "depth": 2}}}',
                                  '{"tuned": {"m": {"mtp": true, "depth": "3"}}}', '{"tuned": {"m": {"mtp": true, "depth": 0}}}',
                                  "[1, 2]", "{not json"])
def test_a_hand_edited_settings_file_of_another_shape_means_the_defaults(tmp_path, monkeypatch, text):
    import mtplx.settings as settings

    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    (tmp_path / "settings.json").write_text(text)
    assert settings.tuned_default("m") is None
    settings.store_tuned("m", True, 3, {"ar": 1.0})  # and a new tuning replaces what could not be read
    assert settings.tuned_default("m")["depth"] == 3
