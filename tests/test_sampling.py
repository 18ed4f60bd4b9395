from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mtplx.engine.sampling import Sampler, SamplingParams, apply_penalties, probabilities
from mtplx.errors import RequestError


@pytest.mark.parametrize("field,value", [("temperature", -1), ("temperature", math.nan), ("temperature", math.inf),
                                         ("top_p", 0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.0),
                                         ("max_tokens", 0), ("stop", ("",)), ("seed", "x"),
                                         ("presence_penalty", 2.5), ("frequency_penalty", -3)])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_filters_shape_the_distribution():
    logits = mx.array([4.0, 3.0, 2.0, 1.0, 0.0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2)).tolist()
    assert p[2:] == [0, 0, 0] and abs(sum(p) - 1) < 1e-6 and p[0] > p[1]
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5)).tolist()
    assert p[0] == pytest.approx(1.0)  # the top token alone holds more than half the mass
    p = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.2)).tolist()
    assert p[2:] == [0, 0, 0]


def test_seeded_sampler_repeats():
    probs = mx.softmax(mx.array([0.1, 0.5, 0.2, 0.9]))
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    assert [a.draw(probs) for _ in range(20)] == [b.draw(probs) for _ in range(20)]


def test_presence_and_frequency_penalties_follow_openai():
    logits = mx.array([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    assert params.penalised and not SamplingParams().penalised
    # token 1 generated three times, token 2 once, the prompt's token 3 not at all (reply only)
    out = apply_penalties(logits, params, prompt=[3, 3], generated=[1, 2, 1, 1]).tolist()
    assert out == pytest.approx([1.0, 1.0 - 0.5 - 0.75, 1.0 - 0.5 - 0.25, 1.0])
    both = apply_penalties(mx.array([2.0, -2.0, 1.0]), SamplingParams(repetition_penalty=2.0, presence_penalty=1.0),
                           prompt=[0], generated=[1]).tolist()
    assert both == pytest.approx([1.0, -4.0 - 1.0, 1.0])  # repetition over prompt + reply, presence over the reply
