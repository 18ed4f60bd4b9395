"""Where decode time goes on the CPU fast path: MKL's own time for every sgemm of AR decoding, of
MTP decoding and of a 4-row batch, by call shape, next to each phase's wall time.

    python bench/blas_time.py [--model tiny-dense] [--depth 3] [--tokens 128] [--sessions 4]

Each phase runs after a warm-up, in this process. MKL's verbose mode (one line per BLAS call, with
the call's time) is switched on with mkl_verbose(1) only while a phase runs, and the C stdout it
writes to is redirected to a file for that span. The small-row kernel (mtplx/small_gemm.py) is
switched off for the run, so every product reaches MKL: this shows what MKL alone does with the
row counts decoding hands it. Printed per phase: wall seconds, tokens, the sum
of sgemm time and its share of the wall, then the heaviest shapes: rows x out x in, calls, µs per
call and GFLOP/s. The verbose lines cost a few µs each, so the wall is a little inflated. Rows are
what the MTP verify (k + 1 per sequence) and a batch (rows x tokens) multiply; MKL's rate at 1-16
rows is what bounds c(k+1)/c(1) and a batch's gain here. Speed is printed, never asserted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtplx import fast_path, small_gemm  # noqa: E402  (before MLX: loads MKL in this process)
from mtplx.catalog import resolve  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from concurrency import prompts as session_prompts  # noqa: E402  (the same sessions bench/concurrency.py runs)

LINE = re.compile(r"MKL_VERBOSE SGEMM\((\w),(\w),(\d+),(\d+),(\d+),.*?\) ([\d.]+)(ns|us|ms|s) ")
UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}

@contextlib.contextmanager
def verbose_calls(lib, out: list):
    """MKL verbose on inside the block; its SGEMM lines as (rows, out, in, seconds) appended to `out`."""
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        libc.fflush(None)
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            lib.MKL_Verbose(1)
            yield
        finally:
            lib.MKL_Verbose(0)
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        for line in sink.read().decode(errors="replace").splitlines():
            if m := LINE.match(line):
                # column-major view of MLX's row-major x @ W.T: m = out features, n = rows, k = in
                out.append((int(m.group(4)), int(m.group(3)), int(m.group(5)), float(m.group(6)) * UNIT[m.group(7)]))


def phase(engine: Engine, prompts: list, tokens: int, mtp: bool, depth: int) -> tuple[float, int]:
    subs = [engine.submit(GenerationRequest(p, SamplingParams(max_tokens=tokens, ignore_eos=True), use_mtp=mtp,
                                            depth=depth, session=f"s{i}", source="bench"))
            for i, p in enumerate(prompts)]
    start = time.perf_counter()
    done = [s.result() for s in subs]
    return time.perf_counter() - start, sum(d.completion_tokens for d in done)


def report(name: str, wall: float, tokens: int, calls: list) -> None:
    gemm = sum(c[3] for c in calls)
    print(f"{name:<14} wall {wall:6.2f} s  {tokens:5d} tokens  {tokens / wall:7.1f} tok/s  "
          f"sgemm {gemm:6.2f} s = {gemm / wall:4.0%} of wall")
    by = collections.defaultdict(list)
    for rows, n_out, n_in, s in calls:
        by[(rows, n_out, n_in)].append(s)
    heavy = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:8]
    for (rows, n_out, n_in), times in heavy:
        per = sum(times) / len(times)
        print(f"    {rows:3d} rows x {n_out:5d} out x {n_in:5d} in: {len(times):5d} calls {per * 1e6:8.1f} µs "
              f"{2 * rows * n_out * n_in / per / 1e9:6.1f} GFLOP/s  ({sum(times) / wall:4.0%} of wall)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-dense")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--sessions", type=int, default=4)
    args = ap.parse_args()
    blas = fast_path.activate()
    if blas.kind != "mkl":
        sys.exit(f"needs the MKL fast path ({blas.reason})")
    lib = ctypes.CDLL(blas.library)
    if fast_path.KERNEL is not None:  # every product to MKL, whose calls are what this counts
        small_gemm.set_enabled(fast_path.KERNEL, False)
    engine = Engine(resolve(args.model), EngineConfig(depth=args.depth)).start()
    try:
        prompts = session_prompts(engine, args.sessions)
        arms = [("ar", prompts[:1], False), (f"mtp depth {args.depth}", prompts[:1], True),
                (f"{len(prompts)} at once", prompts, True)]
        for _, batch, mtp in arms:  # warm-up: compiles every step shape
            phase(engine, batch, 16, mtp, args.depth)
        print(f"{args.model}: {args.tokens} greedy tokens per sequence, {engine.checkpoint.extras.get('compute')}")
        for name, batch, mtp in arms:
            calls: list = []
            with verbose_calls(lib, calls):
                wall, tokens = phase(engine, batch, args.tokens, mtp, args.depth)
            report(name, wall, tokens, calls)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
