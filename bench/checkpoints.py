"""Real-checkpoint measurements (issue #13), side by side in one run:

1. the Qwen3.5 stand-in (the trained tiny-hybrid in real Qwen3.5 on-disk layout, bf16) against
   its `mtplx convert` (4-bit trunk, group 64, bf16 MTP head): depth-1 acceptance on held-out
   prompts, and whether MTP greedy equals AR greedy on the converted one;
2. a tool conversation on the real Qwen3 tokenizer and template (../shared/fixtures): the share
   of its reuse ceiling each warm turn restored.

    python bench/checkpoints.py [--prompts 8] [--tokens 128]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def acceptance(path: Path, prompts, tokens: int) -> tuple[float, list, list]:
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    engine = Engine(path, EngineConfig(chunk_size=256, depth=1)).start()
    drafted = accepted = 0
    mtp_out, ar_out = [], []
    try:
        for prompt in prompts:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
            mtp = engine.submit(GenerationRequest(prompt, params, use_mtp=True, depth=1)).result()
            ar = engine.submit(GenerationRequest(prompt, params, use_mtp=False)).result()
            drafted += mtp.stats.drafted_by_depth[0]
            accepted += mtp.stats.accepted_by_depth[0]
            mtp_out.append(mtp.token_ids)
            ar_out.append(ar.token_ids)
    finally:
        engine.stop()
    return accepted / max(drafted, 1), mtp_out, ar_out


def reuse_on_real_template() -> list:
    import standins
    from fastapi.testclient import TestClient

    from mtplx.bank.bank import BankConfig
    from mtplx.bank.spans import reuse_ratio
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.events import Restored
    from mtplx.server.app import create_app

    if not standins.SHARED.is_dir():
        return ["skipped: ../shared/fixtures/tokenizers/qwen3 absent"]
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
    with tempfile.TemporaryDirectory() as tmp:
        path = standins.build("qwen3", Path(tmp) / "qwen3", standins.SHARED)
        engine = Engine(path, EngineConfig(chunk_size=64), name="qwen3", bank=BankConfig()).start()
        seen = []
        engine.listeners.append(lambda e: seen.append(e) if isinstance(e, Restored) else None)
        messages, rows = [], []
        turns = [
            [{"role": "system", "content": "You are a careful coding agent working inside a repository. " * 8},
             {"role": "user", "content": "Read src/app.py and tell me what it does."}],
            [{"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": {
                "name": "read_file", "arguments": '{"path": "src/app.py"}'}}]},
             {"role": "tool", "tool_call_id": "c0", "content": "def main():\n    print('hello')\n" * 6}],
            [{"role": "assistant", "content": "It prints hello six times."},
             {"role": "user", "content": "Now make it print goodbye instead."}],
        ]
        try:
            with TestClient(create_app(engine, "qwen3")) as client:
                for turn in turns:
                    messages += turn
                    client.post("/v1/chat/completions", headers={"x-session-id": "bench"},
                                json={"messages": messages, "tools": tools, "max_tokens": 8, "temperature": 0})
                    r = seen[-1]
                    rows.append((r.prompt_tokens, r.ceiling, r.cached_tokens, reuse_ratio(r.cached_tokens, r.ceiling)))
                    engine.settle()
        finally:
            engine.stop()
    return rows


def main() -> None:
    import standins
    from test_mtp_held_out import held_out_prompts

    from mtplx.convert import convert
    from mtplx.engine.checkpoint import load_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = standins.qwen3_5_from_tiny(Path(tmp) / "qwen3_5-hf")
        q4 = Path(tmp) / "qwen3_5-4bit"
        convert(hf, q4, bits=4, group_size=64)
        prompts = held_out_prompts(load_checkpoint(hf).tokenizer, args.prompts)
        a_hf, _, _ = acceptance(hf, prompts, args.tokens)
        a_q4, mtp, ar = acceptance(q4, prompts, args.tokens)
    same = sum(m == a for m, a in zip(mtp, ar))
    print(f"{'checkpoint':<32} {'depth-1 acceptance':>20}")
    print(f"{'Qwen3.5 stand-in, HF bf16':<32} {a_hf:>20.3f}")
    print(f"{'mtplx convert (4-bit trunk, 8-bit embedding, bf16 head)':<32} {a_q4:>20.3f}   (delta {a_q4 - a_hf:+.3f})")
    print(f"4-bit: MTP greedy == AR greedy on {same}/{len(prompts)} prompts x {args.tokens} tokens")
    print("\nreal Qwen3 template, tool conversation (prompt, ceiling, cached, ratio) per turn:")
    for row in reuse_on_real_template():
        print("  ", row)


if __name__ == "__main__":
    main()
