"""One rank of a test ring (run by tests/test_distributed.py through mtplx.distributed.launch).

`python tests/rank_worker.py JOB OUT [args]`: every rank runs JOB; rank 0 writes its findings as
JSON to OUT. Jobs: smoke, logits MODEL MODE, engine MODEL MODE HOME, kill, diverge MODEL.
"""

from __future__ import annotations

import json
import os
import sys
import time

import mtplx  # noqa: F401  (the MKL fast path, before MLX)
import mlx.core as mx

from mtplx.distributed.group import join


def smoke(out, g=None):
    g = g or join("tp", timeout_s=20)
    total = mx.distributed.all_sum(mx.array([g.rank + 1.0]), group=g.group)
    gathered = g.gather_ints([g.rank, 7], "a test gather")
    sent = g.broadcast_bytes(b"hello ring" if g.rank == 0 else None, 10, "a test broadcast")
    picked = g.from_rank0(mx.array([float(g.rank + 10)]))
    mx.eval(total, picked)
    found = {"world": g.world, "sum": total.item(), "gathered": gathered, "bytes": sent.decode(), "rank0": picked.item()}
    everyone = g.gather_ints([int(found["sum"]), int(found["rank0"]), int(sent == b"hello ring")], "a test check")
    if g.rank == 0:
        found["everyone"] = everyone
        write(out, found)


def logits(out, model, mode):
    from mtplx.catalog import resolve
    from mtplx.distributed.shard import load_sharded
    from mtplx.engine.checkpoint import load_checkpoint
    from mtplx.engine.runner import ModelRunner

    g = join(mode, timeout_s=30)
    path = resolve(model)
    sharded = ModelRunner(load_sharded(path, g))
    prompt = [(i * 37 + 11) % 4000 + 5 for i in range(40)]
    steps = [17, 230, 1999]

    def run(runner):
        cache = runner.new_trunk_cache()
        rows = [runner.logits(runner.hidden(prompt, cache))[0]]
        for t in steps:  # short forwards after the prompt (decode steps)
            with runner.small_forwards():
                rows.append(runner.logits(runner.hidden([t], cache))[0])
        out = mx.concatenate(rows, axis=0)
        mx.eval(out)
        return out

    mine = run(sharded)
    refused = None
    if mode == "tp" and model == "tiny-dense":  # the same ring asked for pp on qwen3 (no pipeline())
        from mtplx.distributed.group import Group
        from mtplx.distributed.layout import Layout, LayoutError
        from mtplx.distributed.shard import shard_model
        from mtplx.engine.checkpoint import load_trunk

        try:
            shard_model(load_trunk(path, lazy=True).model, Group(g.group, Layout("pp", g.world, g.rank), g.watchdog))
        except LayoutError as exc:
            refused = str(exc)
    if g.rank == 0:
        alone = run(ModelRunner(load_checkpoint(path)))
        diff = mx.abs(mine - alone)
        write(out, {"pp_refused": refused, "max_abs": diff.max().item(), "scale": mx.abs(alone).max().item(),
                    "argmax_equal": bool(mx.all(mx.argmax(mine, -1) == mx.argmax(alone, -1)).item()),
                    "exact": bool(mx.array_equal(mine, alone).item()), "layout": sharded.checkpoint.extras["layout"],
                    "identity": sharded.checkpoint.identity,
                    # mlx-lm's shard() split the head by vocabulary (an untied head under tp)
                    "head_sharded": getattr(getattr(sharded.model, "language_model", sharded.model), "sharding_group",
                                            None) is not None})
    g.gather_ints([0], "the end of the test")


def _turns(engine, turns=2, max_tokens=32):
    """An agent's turns (the model's own replies sent back), greedy, with its tool time between."""
    from mtplx.chat import chat_request
    from mtplx.engine.sampling import SamplingParams
    from mtplx.replay.live_agent import AgentSession
    from mtplx.synth.agent import Sizes, conversation
    from mtplx.synth.corpus import Corpus

    session, out = AgentSession("agent", conversation(77, Corpus(), Sizes(20, 50), max_user_turns=2)), []
    while len(out) < turns and (nxt := session.next_request(engine.checkpoint.tokenizer)) is not None:
        prompt, chat = nxt
        req = chat_request(engine.checkpoint.tokenizer, chat["messages"], chat["tools"], prompt=prompt,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0), session="agent")
        fin = engine.submit(req).result()
        engine.settle()
        out.append({"prompt": list(prompt), "tokens": list(fin.token_ids), "cached": fin.cached_tokens,
                    "tau": fin.stats.tau, "accepted": list(fin.stats.accepted_by_depth),
                    "decode_tps": fin.stats.decode_tps, "ttft_s": fin.stats.ttft_s})
        session.send_back(fin.reply)
    return out


def _ask(engine, prompt, max_tokens=32):
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    fin = engine.submit(GenerationRequest(tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                          session="agent")).result()
    return {"tokens": list(fin.token_ids), "cached": fin.cached_tokens, "tau": fin.stats.tau}


def _concurrent(engine):
    """Four requests at once (the scheduler batches them), one of them sampled with a seed."""
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    prompts = [[(i * 31 + j * 7) % 3000 + 5 for i in range(60 + 20 * j)] for j in range(4)]
    subs = [engine.submit(GenerationRequest(tuple(p), SamplingParams(max_tokens=24, temperature=0.8 if j == 2 else 0.0,
                                                                      seed=11 + j))) for j, p in enumerate(prompts)]
    return [list(s.result().token_ids) for s in subs]


def engine(out, model, mode, home, extras=""):
    """Two agent turns sharded and in one process. `extras` (comma-separated): "concurrent" adds four
    requests at once; "restart" a cancel mid-decode, then a restart of the ring that restores the
    second turn's prompt from each rank's SSD, and an unsharded engine over rank 0's SSD directory."""
    restart = "restart" if "restart" in extras.split(",") else ""
    from pathlib import Path

    from mtplx.bank.bank import BankConfig
    from mtplx.bank.ssd import SsdConfig
    from mtplx.catalog import resolve
    from mtplx.distributed.lockstep import RankEngine
    from mtplx.engine.engine import Engine, EngineConfig

    g = join(mode, timeout_s=float(os.environ.get("MTPLX_TEST_WATCHDOG_S", "30")))
    config = EngineConfig(chunk_size=64, depth=2)
    ssd = SsdConfig.default(root=Path(home) / "bank", budget_bytes=1 << 30)

    def ring_engine():
        return RankEngine(resolve(model), g, config, name=model, bank=BankConfig(), ssd=ssd).start()

    sharded = ring_engine()
    if g.rank != 0:
        code = sharded.follow()
        if code == 0 and restart == "restart":
            code = ring_engine().follow()  # the restart
        sys.exit(code)
    found = {"sharded": _turns(sharded), "health": sharded.health()}
    if "concurrent" in extras.split(","):
        found["concurrent"] = _concurrent(sharded)
    if restart == "restart":  # a cancel mid-decode reaches every rank at the same pass; they go on together
        from mtplx.engine.request import GenerationRequest
        from mtplx.engine.sampling import SamplingParams
        from mtplx.events import Finished, Tokens

        sub = sharded.submit(GenerationRequest(tuple(found["sharded"][0]["prompt"]), SamplingParams(max_tokens=400)))
        for event in sub:
            if isinstance(event, Tokens):
                sub.cancel()
            if isinstance(event, Finished):
                found["cancelled"] = [event.finish_reason, event.completion_tokens]
        found["after_cancel"] = _ask(sharded, found["sharded"][1]["prompt"])
    sharded.stop()
    alone = Engine(resolve(model), config, name=model, bank=BankConfig()).start()
    found["alone"] = _turns(alone)
    if "concurrent" in extras.split(","):
        found["concurrent_alone"] = _concurrent(alone)
    alone.stop()
    if restart != "restart":
        return write(out, found)
    restarted = ring_engine()
    found["restarted"] = _ask(restarted, found["sharded"][1]["prompt"])
    restarted.stop()
    rank0_dir = SsdConfig.default(root=ssd.root / f"{mode}{g.world}-rank0", budget_bytes=1 << 30)
    other = Engine(resolve(model), config, name=model, bank=BankConfig(), ssd=rank0_dir).start()
    found["other_layout"] = _ask(other, found["sharded"][1]["prompt"])
    found["other_layout_health"] = other.health()
    other.stop()
    write(out, found)


def diverge(out, model, mode):
    """The last rank emits one token that differs from rank 0's (injected): every rank must exit."""
    from mtplx.catalog import resolve
    from mtplx.distributed.lockstep import RankEngine
    from mtplx.engine.engine import EngineConfig
    from mtplx.events import Tokens

    g = join(mode, timeout_s=float(os.environ.get("MTPLX_TEST_WATCHDOG_S", "5")))
    engine = RankEngine(resolve(model), g, EngineConfig(chunk_size=64, depth=2), name=model)
    if g.rank == g.world - 1:
        publish, seen = engine._publish, []

        def forked(sub, event):
            seen.extend([event] if isinstance(event, Tokens) else [])
            if isinstance(event, Tokens) and len(seen) == 3:
                event = Tokens(event.request_id, tuple(t + 1 for t in event.token_ids), event.text, event.segment)
            publish(sub, event)
        engine._publish = forked
    engine.start()
    if g.rank != 0:
        sys.exit(engine.follow())
    _turns(engine, turns=1, max_tokens=24)
    engine.stop()
    write(out, {"unexpected": "the run completed"})


def kill(out):
    """The smoke checks, then the last rank vanishes (and with 4 ranks rank 1 hangs)."""
    g = join("tp", timeout_s=float(os.environ.get("MTPLX_TEST_WATCHDOG_S", "4")))
    smoke(out, g)
    if g.rank == g.world - 1:
        os._exit(0)  # a peer vanishes (exits without a word) before the next collective
    if g.rank == 1 and g.world > 2:
        time.sleep(3600)  # a peer hangs: alive, never joining the next collective
    g.gather_ints([2], "the gather after a peer left")
    write(out, {"unexpected": "the gather completed"})  # never reached: the watchdog ends the rank


def write(out, found):
    with open(out, "w") as fh:
        json.dump(found, fh)


if __name__ == "__main__":
    job, out, *args = sys.argv[1:]
    {"smoke": smoke, "logits": logits, "kill": kill, "engine": engine, "diverge": diverge}[job](out, *args)
