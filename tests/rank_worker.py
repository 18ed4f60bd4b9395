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


def smoke(out):
    g = join("tp", timeout_s=20)
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
    if g.rank == 0:
        alone = run(ModelRunner(load_checkpoint(path)))
        diff = mx.abs(mine - alone)
        write(out, {"max_abs": diff.max().item(), "scale": mx.abs(alone).max().item(),
                    "argmax_equal": bool(mx.all(mx.argmax(mine, -1) == mx.argmax(alone, -1)).item()),
                    "exact": bool(mx.array_equal(mine, alone).item()), "layout": sharded.checkpoint.extras["layout"],
                    "identity": sharded.checkpoint.identity})
    g.gather_ints([0], "the end of the test")


def kill(out):
    g = join("tp", timeout_s=float(os.environ.get("MTPLX_TEST_WATCHDOG_S", "4")))
    g.gather_ints([1], "a first gather")
    if g.rank == g.world - 1:
        os._exit(0)  # a peer vanishes (exits without a word) before the next collective
    if g.rank == 1 and g.world > 2:
        time.sleep(3600)  # a peer hangs: alive, never joining the next collective
    g.gather_ints([2], "the gather after a peer left")
    write(out, {"unexpected": "the gather completed"})


def write(out, found):
    with open(out, "w") as fh:
        json.dump(found, fh)


if __name__ == "__main__":
    job, out, *args = sys.argv[1:]
    {"smoke": smoke, "logits": logits, "kill": kill}[job](out, *args)
