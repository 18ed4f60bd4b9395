"""Quality of the embedded models on held-out generated transcripts (seeds never trained on).

    python bench/model_quality.py [--models tiny-dense tiny-hybrid] [--conversations 12]

Reports, per model:
- perplexity of the trunk over rendered held-out conversations;
- MTP depth-1 agreement: where the trunk's greedy token equals the next transcript token, how
  often the MTP head's argmax equals the trunk's own greedy next-next token (teacher-forced);
- live depth-1 acceptance while greedily answering the held-out turns (the same quantity, measured
  on the model's own output);
- tool calls: of the assistant turns that call a tool in the transcript, the share whose greedy
  output is a well-formed <tool_call> with parseable JSON naming an offered tool (and the share
  that names the same tool as the transcript).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import render  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from mtplx.synth.agent import Sizes, conversation  # noqa: E402
from mtplx.synth.corpus import Corpus  # noqa: E402

HELD_OUT_SEED = 5_000_000  # training used seeds from 100_000, the tokenizer from 1_000_000
# Prompts past this many tokens are reported apart: a model trained on shorter windows than the
# prompt loses the thread there (see docs/models.md), and the total hides it.
LONG_PROMPT = 1024
CALL = re.compile(r"^(?:<think>.*?</think>\s*)?<tool_call>\s*(\{.*\})\s*</tool_call>\s*$", re.S)


def teacher_forced(engine: Engine, tokens: list[int]) -> tuple[float, int, int, int]:
    """(summed NLL, predicted tokens, MTP agreements, MTP comparisons) over one sequence."""
    import mlx.core as mx

    runner = engine.runner
    hidden = runner.hidden(tokens, runner.new_trunk_cache())
    logits = runner.logits(hidden)[0]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    target = mx.array(tokens[1:])
    nll = -mx.take_along_axis(logp[:-1], target[:, None], axis=-1).sum().item()
    greedy = mx.argmax(logits, axis=-1)
    mtp = runner.draft_hidden(hidden[:, :-1], tokens[1:], runner.new_mtp_cache())
    mtp_greedy = mx.argmax(runner.logits(mtp)[0], axis=-1)
    # position t: trunk greedy at t matches x[t+1]; compare MTP(h_t, x[t+1]) with trunk greedy at t+1
    match = (greedy[:-2] == target[:-1])
    agree = (mtp_greedy[:-1] == greedy[1:-1]) & match
    return nll, len(tokens) - 1, int(agree.sum().item()), int(match.sum().item())


def tool_call_ok(text: str, tools: list[dict]) -> tuple[bool, str | None]:
    found = CALL.match(text.strip())
    if not found:
        return False, None
    try:
        call = json.loads(found.group(1))
    except json.JSONDecodeError:
        return False, None
    names = {t["function"]["name"] for t in tools}
    ok = isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict)
    return ok, call.get("name") if isinstance(call, dict) else None


def evaluate(name: str, conversations: int, max_len: int) -> dict:
    engine = Engine(resolve(name), EngineConfig(depth=1), name=name).start()
    tok = engine.checkpoint.tokenizer
    corpus = Corpus()
    nll = count = agree = compared = 0
    turns = well_formed = same_tool = drafted = accepted = 0
    short, long = f"<{LONG_PROMPT}", f">={LONG_PROMPT}"
    by_length = {short: [0, 0], long: [0, 0]}  # prompt tokens -> [well-formed, turns]
    try:
        for i in range(conversations):
            convo = conversation(HELD_OUT_SEED + i, corpus, Sizes(6, 36))
            msgs, tools = convo["messages"], convo["tools"]
            tokens = render(tok, msgs, tools, add_generation_prompt=False)[:max_len]
            a, b, c, d = engine.call(lambda: teacher_forced(engine, tokens))
            nll, count, agree, compared = nll + a, count + b, agree + c, compared + d
            for k, m in enumerate(msgs):
                if m["role"] != "assistant" or not m.get("tool_calls"):
                    continue
                prompt = tuple(render(tok, msgs[:k], tools))
                fin = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=160), use_mtp=True, depth=1,
                                                      source="bench")).result()
                ok, called = tool_call_ok(fin.text, tools)
                turns += 1
                well_formed += ok
                bucket = by_length[long if len(prompt) >= LONG_PROMPT else short]
                bucket[0], bucket[1] = bucket[0] + ok, bucket[1] + 1
                same_tool += ok and called == m["tool_calls"][0]["function"]["name"]
                drafted += fin.stats.drafted_by_depth[0]
                accepted += fin.stats.accepted_by_depth[0]
    finally:
        engine.stop()
    return {
        "model": name, "conversations": conversations, "tokens_scored": count,
        "perplexity": math.exp(nll / count),
        "mtp_depth1_agreement_teacher_forced": agree / compared,
        "mtp_depth1_acceptance_live": accepted / drafted if drafted else None,
        "tool_turns": turns, "tool_call_well_formed": well_formed / turns, "tool_call_same_tool": same_tool / turns,
        "tool_call_well_formed_by_prompt_length": {k: f"{a}/{n}" for k, (a, n) in by_length.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()
    rows = [evaluate(m, args.conversations, args.max_len) for m in args.models]
    print(f"{'model':<12} {'ppl':>7} {'mtp agree (tf)':>15} {'mtp accept (live)':>18} {'tool turns':>10} {'well-formed':>12} {'same tool':>10}")
    for r in rows:
        print(f"{r['model']:<12} {r['perplexity']:7.3f} {r['mtp_depth1_agreement_teacher_forced']:15.3f} "
              f"{r['mtp_depth1_acceptance_live'] or 0:18.3f} {r['tool_turns']:10d} {r['tool_call_well_formed']:12.3f} "
              f"{r['tool_call_same_tool']:10.3f}   by prompt length: "
              + ", ".join(f"{k} {v}" for k, v in r["tool_call_well_formed_by_prompt_length"].items()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
