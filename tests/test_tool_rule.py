"""Tool rules on the logits: what they allow, and that MTP under a rule stays AR under it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplx.chat import render
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.tool_rule import ToolRule

OPEN, END = 5, 2


def test_never_masks_the_opening_token():
    logits = mx.zeros((16,))
    out = ToolRule("never", OPEN).apply(logits, [])
    assert out[OPEN].item() == float("-inf") and out[0].item() == 0.0


def test_required_moves_the_end_mass_onto_the_opening_token_while_reasoning():
    logits = mx.log(mx.array([0.1, 0.1, 0.5, 0.1, 0.1, 0.1]))
    rule = ToolRule("required", OPEN, (END,), head=(3, 1), think=(3, 4))
    probs = mx.softmax(rule.apply(logits, [3, 1]), axis=-1)  # inside <think>: free but for ending
    assert probs[END].item() == 0.0 and abs(probs[OPEN].item() - 0.6) < 1e-5 and abs(probs[0].item() - 0.1) < 1e-5
    # once opened, the named tool's head is forced token by token, then the model is free again
    assert mx.argmax(rule.apply(logits, [0, OPEN])).item() == 3
    assert mx.argmax(rule.apply(logits, [0, OPEN, 3])).item() == 1
    assert mx.argmax(rule.apply(logits, [0, OPEN, 3, 1])).item() == END


def test_required_lets_only_blanks_before_the_call_once_the_reply_starts():
    logits = mx.log(mx.array([0.4, 0.1, 0.2, 0.1, 0.1, 0.1]))
    rule = ToolRule("required", OPEN, (END,), think=(3, 4), blank=(1,))
    first = mx.softmax(rule.apply(logits, []), axis=-1)  # may open reasoning, a blank or the call
    assert {i for i in range(6) if first[i].item() > 0} == {1, 3, OPEN}
    after_think = mx.softmax(rule.apply(logits, [3, 0, 4]), axis=-1)
    assert {i for i in range(6) if after_think[i].item() > 0} == {1, OPEN}
    assert mx.argmax(rule.apply(logits, [3, 0, 4, 1, 1])).item() == OPEN  # two blanks, then forced


def test_one_call_only_masks_a_second_opening_once_a_call_has_closed():
    CLOSE = 7
    logits = mx.zeros((8,))
    for rule in (ToolRule("free", OPEN, single_close=CLOSE), ToolRule("required", OPEN, (END,), single_close=CLOSE)):
        assert rule.apply(logits, [OPEN, 0, CLOSE])[OPEN].item() == float("-inf")
        assert rule.apply(logits, [OPEN, 0])[OPEN].item() == 0.0  # inside the first call
    assert ToolRule("free", OPEN, single_close=CLOSE).apply(logits, [CLOSE, 0])[OPEN].item() == 0.0  # no call yet
    assert ToolRule("free", OPEN).apply(logits, [OPEN, 0, CLOSE])[OPEN].item() == 0.0  # parallel calls allowed


def test_mtp_greedy_equals_ar_greedy_with_parallel_calls_off(engine, tokenizer):
    """Nudged to call again and again (the opening token favoured, ending the turn banned), the
    model makes several calls; with parallel calls off it makes one, MTP and AR alike."""
    from mtplx.server.tool_choice import ToolChoice, ToolRules

    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
    prompt = tuple(render(tokenizer, [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Read core/billing/mac_turkish.py and tests/test_mac_turkish.py"}],
                          tools, enable_thinking=False))
    rules = ToolRules(tokenizer, engine.eos_ids)
    nudge = tuple(sorted([(rules.open, 3.0)] + [(e, -100.0) for e in engine.eos_ids]))
    run = lambda rule, mtp: engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=120, logit_bias=nudge),
                                                            use_mtp=mtp, depth=3, tool_rule=rule)).result()
    once = rules.rule(ToolChoice("auto", parallel=False), False)
    assert once.mode == "free" and once.single_close == rules.close
    ar, mtp = run(once, False), run(once, True)
    assert ar.token_ids == mtp.token_ids and mtp.stats.verify_calls > 0
    assert ar.token_ids.count(rules.open) == 1
    if engine.checkpoint.path.name == "tiny-dense":  # free, it calls again: the rule did bite
        assert run(None, False).token_ids.count(rules.open) >= 2


def test_rule_modes_are_checked():
    with pytest.raises(ValueError):
        ToolRule("sometimes", OPEN)


def _tool_prompt(tokenizer):
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    return tuple(render(tokenizer, [{"role": "user", "content": "Read src/app.py and tell me what it does."}], tools))


@pytest.mark.parametrize("mode", ["never", "required"])
def test_mtp_greedy_equals_ar_greedy_under_a_rule(engine, tokenizer, mode):
    prompt = _tool_prompt(tokenizer)
    rule = ToolRule(mode, tokenizer.convert_tokens_to_ids("<tool_call>"), tuple(engine.eos_ids))
    runs = [engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=40), use_mtp=mtp, depth=3,
                                            tool_rule=rule)).result() for mtp in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[1].stats.verify_calls > 0
    opened = rule.call_open in runs[0].token_ids
    assert opened if mode == "required" else not opened


def test_never_keeps_greedy_drafts_on_the_device(engine, tokenizer, monkeypatch):
    """Every chat turn without tools runs under "never"; as a history-free mask it shapes the lazy
    draft chain and the verify rows at once, so a round still syncs with the host once (drafting
    token by token on the host cost those turns most of MTP's gain), and the tokens are still AR's
    under the rule."""
    from mtplx.engine.speculation import Speculator

    prompt = _tool_prompt(tokenizer)
    rule = ToolRule("never", tokenizer.convert_tokens_to_ids("<tool_call>"))
    request = lambda mtp, rule: GenerationRequest(prompt, SamplingParams(max_tokens=40), use_mtp=mtp, depth=2,
                                                  tool_rule=rule)
    free = engine.submit(request(False, None)).result()
    ar = engine.submit(request(False, rule)).result()

    def host_draft(self, k):
        raise AssertionError("a history-free rule drafted on the host")

    monkeypatch.setattr(Speculator, "_draft", host_draft)
    mtp = engine.submit(request(True, rule)).result()
    assert mtp.token_ids == ar.token_ids and mtp.stats.verify_calls > 0
    assert rule.call_open not in ar.token_ids
    if engine.checkpoint.path.name == "tiny-dense":  # free, it calls a tool: the mask did bite
        assert rule.call_open in free.token_ids and free.token_ids != ar.token_ids
