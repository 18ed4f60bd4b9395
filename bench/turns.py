"""Turn latency and decode speed, mtplx serve vs mlx_lm.server on the same weights, in one run.

    python bench/turns.py [--model tiny-dense --model tiny-hybrid] [--runs 3] [--pause 1.0]

Per model, each run measures on every server, interleaved so machine noise hits all alike:
- cold TTFT of a ~3k-token prompt (a fresh nonce at the head of the system message, so no
  server can reuse anything);
- warm append TTFT: the same conversation's next request, which appends the server's own reply
  and a short tool result (`--pause` seconds after the reply, as an agent's tool run allows);
- the strip turn (bench/strip_turn.py): a tool chain driven with each server's own replies, then a
  new user message `--idle` seconds (0, 1, 5) after the final reply; cached / reuse ceiling per idle,
  mtplx vs mlx-lm on the fast path, and a PNG of TTFT per turn (`--chart`; needs matplotlib);
- decode tok/s of a prose answer (no tools, so nothing is held back): (completion tokens - 1) /
  (total - TTFT), client-side; a run whose first delta came late (held back) is left out. Decode
  has its own phase per run: `--decodes` rounds, each one answer from every server back to back,
  so the arms compared (MTP vs AR, mtplx vs mlx-lm) are measured seconds apart. Measured inside
  each server's turn sequence they were a minute apart, and this VM's speed swings by up to 2x
  over a minute: single decode figures ranged 150-350 tok/s for one server. The MTP/AR line
  gives the ratio of medians and the median of the per-round ratios.

Servers, each `mtplx serve` / `mlx_lm.server` in its own process: mtplx as users get it after
`mtplx tune` (MTP at the depth the tuner chooses on this machine, measured at the start of each
model's run without storing it; bank; the CPU fast path),
mtplx with --no-mtp, mtplx with
MTPLX_FAST_PATH=off (what it ran before the fast path), and mlx_lm.server twice: with the same fast path (MKL preloaded, fp32 weights) and as it installs
(bf16, the wheel's reference BLAS). TTFT is to the first generated delta, client-side, streaming.
Prints medians and the ratios the issue asks for; speed is never asserted anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from mtplx import fast_path  # noqa: E402  (before MLX: loads MKL in this process)
from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import render  # noqa: E402
from mtplx.replay.client import stream_turn  # noqa: E402
from mtplx.synth.agent import Sizes, conversation  # noqa: E402
from mtplx.synth.corpus import Corpus  # noqa: E402
from peer_server import ROOT, mlx_lm_server, trunk_copy  # noqa: E402
from strip_turn import drive  # noqa: E402
from ttft_chart import write_chart  # noqa: E402

COLD_TOKENS = 3000
REPLY_TOKENS = 160


def fp32_copy(model: str) -> Path:
    """The trunk copy with every float tensor cast to fp32 (what mtplx computes with on CPU)."""
    import mlx.core as mx

    src = trunk_copy(model)
    dst = ROOT / "build" / "peer" / f"{src.name}-fp32"
    stamp = (src / ".source-mtime").read_text()
    if (dst / ".source-mtime").is_file() and (dst / ".source-mtime").read_text() == stamp:
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in mx.load(str(src / "model.safetensors")).items()}
    mx.save_safetensors(str(dst / "model.safetensors"), tensors, metadata={"format": "mlx"})
    return dst


def prompts(tokenizer, seed: int = 501):
    """(cold messages ~3k tokens, tools), (agent messages ending in a user turn, the tool result to append, tools)."""
    corpus = Corpus()
    cold = None
    for s in range(seed, seed + 200):
        convo = conversation(s, corpus, Sizes(150, 260), max_user_turns=1)
        msgs = convo["messages"]
        for k in range(len(msgs), 1, -1):
            if msgs[k - 1]["role"] in ("user", "tool") and len(render(tokenizer, msgs[:k], convo["tools"])) <= COLD_TOKENS + 300:
                if len(render(tokenizer, msgs[:k], convo["tools"])) >= COLD_TOKENS - 300:
                    cold = (msgs[:k], convo["tools"])
                break
        if cold:
            break
    convo = conversation(seed + 1000, corpus, Sizes(20, 40), max_user_turns=1)
    msgs = convo["messages"]
    k = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    tool = next(m for m in msgs[k:] if m["role"] == "tool")
    short = dict(tool, content="\n".join(tool["content"].splitlines()[:3]))  # ~40 new tokens
    return cold, (msgs[:k], short, convo["tools"])


def with_nonce(messages: list[dict]) -> list[dict]:
    first = dict(messages[0], content=f"[run {uuid.uuid4().hex[:12]}] " + messages[0]["content"])
    return [first, *messages[1:]]


QUESTION = "Explain in a few paragraphs how a hash map handles collisions, with a short example."


def measure(client, url: str, cold, agent, pause: float) -> dict:
    (cold_msgs, cold_tools), (msgs, tool_msg, tools) = cold, agent
    body = lambda m, t, n: {"messages": m, "max_tokens": n, "temperature": 0, **({"tools": t} if t else {})}
    c = stream_turn(client, url, body(with_nonce(cold_msgs), cold_tools, 8), {})
    msgs = with_nonce(msgs)
    first = stream_turn(client, url, body(msgs, tools, REPLY_TOKENS), {"x-session-id": "bench"})
    time.sleep(pause)
    append = stream_turn(client, url, body([*msgs, first.message, tool_msg], tools, 8), {"x-session-id": "bench"})
    return {"cold_ttft": c.ttft_first_token_s, "cold_prompt": c.prompt_tokens,
            "append_ttft": append.ttft_first_token_s, "append_new": append.prompt_tokens - append.cached_tokens,
            "append_prompt": append.prompt_tokens}


def decode(client, url: str, system: dict) -> dict:
    """Decode speed from a prose answer (no tools): servers hold a tool call back until it is
    complete, which would hide the decode time behind a late first delta."""
    body = {"messages": with_nonce([system, {"role": "user", "content": QUESTION}]), "max_tokens": REPLY_TOKENS, "temperature": 0}
    d = stream_turn(client, url, body, {})
    streamed = d.completion_tokens > 8 and d.ttft_first_token_s < 0.8 * d.total_s
    return {"decode_tps": (d.completion_tokens - 1) / (d.total_s - d.ttft_first_token_s) if streamed else None,
            "decoded": d.completion_tokens}


@contextlib.contextmanager
def mtplx_server(model: str, args: list[str], env: dict | None = None):
    """`mtplx serve` in a child process, as a user runs it (its own interpreter: the bench's client
    work never contends with the server's threads), with a fresh home."""
    import os
    import shutil
    import subprocess
    import tempfile

    from peer_server import free_port

    port, home = free_port(), tempfile.mkdtemp(prefix="mtplx-bench-home-")
    proc = subprocess.Popen([sys.executable, "-m", "mtplx.cli", "serve", "--model", model, "--port", str(port), *args],
                            env={**os.environ, "MTPLX_HOME": home, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"mtplx serve {' '.join(args)} exited")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        MTPLX_URLS.append(url)
        yield url
    finally:
        MTPLX_URLS.remove(url) if url in MTPLX_URLS else None
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(home, ignore_errors=True)  # its bank's files: ~0.7 GB a server (bench/scratch.py says why)


def tuned_depth(model: str) -> int | None:
    """The depth `mtplx tune` chooses for `model` on this machine now (None: AR), not stored."""
    from mtplx.tuning import tune_model

    return tune_model(model, save=False, echo=lambda line: print(f"  tune {model}: {line}", file=sys.stderr))["chosen"]


# The mtplx servers running. Before each server's turn every one of them is let finish its idle
# work: render-ahead left over from one server's strip conversation otherwise ran while the next
# server was measured (the same two cores).
MTPLX_URLS: list = []


def settle_all(timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for url in MTPLX_URLS:
        while time.monotonic() < deadline:
            health = httpx.get(url + "/health", timeout=10).json()
            if not health.get("idle_work") and not health.get("busy"):
                break
            time.sleep(0.2)


@contextlib.contextmanager
def servers(model: str, depth: int | None):
    mkl = fast_path.mkl_library()
    fast_env = {"LD_PRELOAD": str(mkl), "MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE", "KMP_BLOCKTIME": "0"} if mkl else None
    with contextlib.ExitStack() as stack:
        urls = {}
        for label, args in (("mtplx", ["--depth", str(depth)] if depth else ["--no-mtp"]), ("mtplx no-mtp", ["--no-mtp"])):
            urls[label] = (stack.enter_context(mtplx_server(model, args)), None)
        urls["mtplx fast path off"] = (stack.enter_context(mtplx_server(model, [], {"MTPLX_FAST_PATH": "off"})), None)
        if fast_env:
            urls["mlx-lm fast"] = (stack.enter_context(mlx_lm_server(model, model_dir=fp32_copy(model), env=fast_env)),
                                   "cpu fp32 + mkl")
        urls["mlx-lm as installed"] = (stack.enter_context(mlx_lm_server(model, env={"LD_PRELOAD": ""})),
                                       "cpu bf16 reference blas")
        for label, (url, compute) in urls.items():  # what each mtplx server says it runs on
            if compute is None:
                urls[label] = (url, httpx.get(url + "/health", timeout=10).json().get("compute"))
        yield urls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="tiny-dense and tiny-hybrid unless given")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pause", type=float, default=1.0, help="Seconds between a reply and the append turn.")
    parser.add_argument("--idle", type=float, nargs="*", default=[0.0, 1.0, 5.0],
                        help="Strip turn: seconds between the final reply of a tool chain and the new user message.")
    parser.add_argument("--decodes", type=int, default=5, help="Decode rounds per run (one answer from every server each).")
    parser.add_argument("--chart", type=Path, default=Path("build/bench/ttft_per_turn.png"),
                        help="PNG of TTFT per turn of the strip conversation (model name is added to the file name).")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    for model in args.model or ["tiny-dense", "tiny-hybrid"]:
        tok = AutoTokenizer.from_pretrained(str(resolve(model)))
        cold, agent = prompts(tok)
        depth = tuned_depth(model)
        print(f"{model}: tuned depth {depth or 'ar'}", file=sys.stderr, flush=True)
        with servers(model, depth) as urls, httpx.Client(timeout=900) as client:
            rows = {label: [] for label in urls}
            decodes = {label: [] for label in urls}
            strips = {label: {idle: [] for idle in args.idle} for label in STRIP_SERVERS if label in urls}
            for run in range(args.runs):
                order = list(urls) if run % 2 == 0 else list(reversed(urls))
                for label in order:
                    settle_all()
                    rows[label].append(measure(client, urls[label][0], cold, agent, args.pause))
                    if label in strips:
                        for idle in args.idle:
                            settle_all()
                            strips[label][idle].append(drive(client, urls[label][0], tok, idle))
                for _ in range(args.decodes):
                    for label in order:
                        settle_all()
                        decodes[label].append(decode(client, urls[label][0], agent[0][0]))
                print(f"{model}: run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
        report(model, urls, rows, decodes, depth)
        report_strip(model, strips, args.chart.with_name(f"{args.chart.stem}-{model}{args.chart.suffix}"))


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def report(model: str, urls: dict, rows: dict, decodes: dict, depth: int | None) -> None:
    med = {label: {k: _median([r[k] for r in rs]) for k in rs[0]} | {k: _median([d[k] for d in decodes[label]]) for k in decodes[label][0]}
           for label, rs in rows.items()}
    print(f"\n{model}: medians of {len(next(iter(rows.values())))} runs, decode of {len(next(iter(decodes.values())))} "
          "answers per server (client-side, streaming; noisy shared 2-core CPU)")
    print(f"{'server':<22} {'compute':<24} {'cold TTFT':>10} {'(tokens)':>8} {'append TTFT':>12} {'(new tok)':>9} "
          f"{'decode tok/s':>12} {'(tokens)':>8}")
    for label, m in med.items():
        print(f"{label:<22} {urls[label][1] or '?':<24} {m['cold_ttft']:10.3f} {m['cold_prompt']:8.0f} {m['append_ttft']:12.3f} "
              f"{m['append_new']:9.0f} {m['decode_tps']:12.1f} {m['decoded']:8.0f}")
    mine, ar = med["mtplx"], med["mtplx no-mtp"]
    for peer in ("mlx-lm fast", "mlx-lm as installed"):
        if peer in med:
            p = med[peer]
            print(f"  vs {peer:<19} cold TTFT mtplx/peer {mine['cold_ttft'] / p['cold_ttft']:.2f}   "
                  f"append TTFT mtplx/peer {mine['append_ttft'] / p['append_ttft']:.2f}   "
                  f"AR decode mtplx/peer {ar['decode_tps'] / p['decode_tps']:.2f}")
    paired = _median([m["decode_tps"] / a["decode_tps"] for m, a in zip(decodes["mtplx"], decodes["mtplx no-mtp"])
                      if m["decode_tps"] and a["decode_tps"]])
    print(f"  MTP/AR decode (mtplx, tuned depth {depth or 'ar'}) {mine['decode_tps'] / ar['decode_tps']:.2f} "
          f"(median of per-round ratios {paired:.2f})")
    for label in ("mtplx", "mtplx no-mtp"):  # every answer, in order: how much the machine swung
        print(f"    {label:<13} " + " ".join(f"{d['decode_tps']:.0f}" if d["decode_tps"] else "-" for d in decodes[label]))
    off = med.get("mtplx fast path off")
    if off:
        print(f"  fast path on/off (mtplx, MTP): cold TTFT {mine['cold_ttft'] / off['cold_ttft']:.2f}, "
              f"append TTFT {mine['append_ttft'] / off['append_ttft']:.2f}, decode {mine['decode_tps'] / off['decode_tps']:.2f}x")


STRIP_SERVERS = ("mtplx", "mlx-lm fast")


def report_strip(model: str, strips: dict, chart: Path) -> None:
    """Reuse ratio of the strip turn per idle time, both servers; the chart of TTFT per turn."""
    if not strips:
        return
    idles = list(next(iter(strips.values())))
    print(f"\n{model}: strip turn (new user message after a tool chain), cached / reuse ceiling, medians")
    print(f"{'server':<22} " + " ".join(f"{'idle ' + format(i, 'g') + ' s':>12}" for i in idles) + f" {'ceiling':>8}")
    for label, by_idle in strips.items():
        cells = [_median([d["strip"]["ratio"] for d in by_idle[i]]) for i in idles]
        ceiling = _median([d["strip"]["ceiling"] for i in idles for d in by_idle[i]])
        print(f"{label:<22} " + " ".join(f"{c:12.2f}" for c in cells) + f" {ceiling:8.0f}")
        print(f"{'  strip TTFT (s)':<22} " + " ".join(f"{_median([d['strip']['ttft'] for d in by_idle[i]]):12.3f}" for i in idles))
    # The chart: per turn, the median TTFT over runs, at the middle idle setting (1 s by default).
    idle = idles[len(idles) // 2]
    series, marks = {}, []
    for label, by_idle in strips.items():
        runs = [d["turns"] for d in by_idle[idle]]
        n = min(len(t) for t in runs)
        series[label] = [_median([t[k]["ttft"] for t in runs]) for k in range(n)]
        marks = [k for k in range(n) if runs[0][k]["strip"]]
    written = write_chart(chart, f"{model}: TTFT per turn, strip conversation, idle {idle:g} s before a new user message",
                          series, marks)
    if written:
        print(f"  chart: {written}")


if __name__ == "__main__":
    main()
