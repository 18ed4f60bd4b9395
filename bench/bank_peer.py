"""bench/bank.py's scenarios over HTTP, mtplx serve and mlx_lm.server side by side (`--peer mlx-lm`).

Both servers get byte-identical request bodies: the conversation is driven by mtplx's replies (an
agent sends back what its server answered), and the same body then goes to mlx_lm.server. Each
scenario gets a fresh server of each kind; the eviction scenario gives both the same RAM byte
budget (`--prompt-cache-bytes` for mlx-lm); mtplx runs as `mtplx serve` does, with its SSD tier
behind RAM (mlx-lm has none). Between turns mtplx is allowed to finish its idle work (as an
agent's tool time allows) and mlx-lm gets the same wall time, which it has no use for.

A turn's reuse ceiling is computed from the local tokenizer the same way for both: where the first
message the session had not sent before (excluding the server's own reply) starts.
"""

from __future__ import annotations

import shutil
import time

import httpx

from mtplx.bank.anchors import Markers
from mtplx.bank.spans import message_spans, reuse_ratio
from mtplx.chat import render
from mtplx.replay.client import stream_turn
from peer_server import mlx_lm_server
from scratch import scratch_dir

MAX_TOKENS = 160


def _ceiling(tokenizer, markers, messages, tools, known: int) -> tuple[int, int]:
    prompt = render(tokenizer, messages, tools)
    spans = message_spans(prompt, messages, markers)
    return len(prompt), next((s.start for s in spans if s.index >= known), len(prompt))


def run_scenario(name, sessions, order, bank_config, model, rows, arm: str = "") -> None:
    from mtplx.bank.bank import default_budget
    from mtplx.bank.ssd import SsdConfig
    from mtplx.catalog import resolve
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.server.app import create_app
    from mtplx.server.background import BackgroundServer

    from mtplx.launch import engine_config, parse_arm

    settings = parse_arm(arm)  # e.g. "no-mtp": the same comparison without speculation
    path = resolve(model)
    ssd_root = scratch_dir("mtplx-bench-ssd-")  # as `mtplx serve` runs: RAM + SSD tiers
    engine = Engine(path, engine_config(path, settings["depth"], not settings["mtp"]), name=model, bank=bank_config,
                    ssd=SsdConfig(ssd_root, budget_bytes=1 << 30, free_floor_bytes=0)).start()
    server = BackgroundServer(create_app(engine, model)).start()
    tok = engine.checkpoint.tokenizer
    markers = Markers.from_tokenizer(tok)
    known: dict[str, int] = {}  # per session: messages the server has seen or produced
    try:
        # A scenario that sets its own (small) budget gives mlx-lm the same; otherwise its default.
        own_budget = bank_config.budget_bytes if bank_config.budget_bytes < default_budget() // 2 else None
        with mlx_lm_server(model, cache_bytes=own_budget) as peer_url, httpx.Client(timeout=600) as client:
            for turn, idx in enumerate(order):
                s = sessions[idx]
                if s.next_request(tok) is None:
                    continue
                body = {"messages": list(s.sent), "tools": s.tools, "max_tokens": MAX_TOKENS, "temperature": 0}
                prompt_len, ceiling = _ceiling(tok, markers, s.sent, s.tools, known.get(s.name, 0))
                headers = {"x-session-id": s.name}
                t0 = time.perf_counter()
                mine = stream_turn(client, server.url, body, headers)
                outcome = engine.call(lambda: list(engine.bank.outcomes.values())[-1])
                engine.settle()
                idle = time.perf_counter() - t0 - mine.total_s
                peer = stream_turn(client, peer_url, body, headers)
                time.sleep(max(idle, 0.0))
                warm = s.name in known
                s.send_back(mine.message)  # as received, as an agent does
                known[s.name] = len(s.sent)
                if not warm or turn == 0:
                    continue
                ratio = lambda r: reuse_ratio(r.cached_tokens, ceiling)
                if not (mine.prompt_tokens == peer.prompt_tokens == prompt_len):
                    raise SystemExit(f"{name} turn {turn}: prompt tokens differ (local {prompt_len}, mtplx "
                                     f"{mine.prompt_tokens}, mlx-lm {peer.prompt_tokens}): not the same prompt")
                rows.append(dict(model=model + (f" {arm}" if arm else ""), scenario=name, session=s.name, prompt=prompt_len, ceiling=ceiling,
                                 mine=mine, peer=peer, source=outcome.source, cause=outcome.cause, ratio_mine=ratio(mine), ratio_peer=ratio(peer),
                                 parity=mine.output_sha256 == peer.output_sha256))
    finally:
        server.stop()
        engine.stop()
        shutil.rmtree(ssd_root, ignore_errors=True)


def print_table(rows) -> None:
    print("\nside by side over HTTP: mtplx serve vs mlx_lm.server, identical request bodies "
          "(TTFT = client-side, to the first generated delta)")
    print(f"{'model':<11} {'scenario':<34} {'sess':<4} {'prompt':>6} {'ceil':>6} | {'mtplx cached':>12} {'ratio':>6} "
          f"{'TTFT':>6} {'from':<4} | {'mlx-lm cached':>13} {'ratio':>6} {'TTFT':>6} | {'TTFT mtplx/mlx-lm':>17} parity  mtplx shortfall")
    for r in rows:
        m, p = r["mine"], r["peer"]
        print(f"{r['model']:<11} {r['scenario']:<34} {r['session']:<4} {r['prompt']:>6} {r['ceiling']:>6} | "
              f"{m.cached_tokens:>12} {r['ratio_mine']:6.3f} {m.ttft_first_token_s:6.3f} {r['source']:<4} | "
              f"{p.cached_tokens:>13} {r['ratio_peer']:6.3f} {p.ttft_first_token_s:6.3f} | "
              f"{m.ttft_first_token_s / p.ttft_first_token_s:17.2f} {str(r['parity']):<6}  {r['cause'] or ''}")
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        mean = lambda k: sum(r[k] for r in mine) / len(mine)
        ttft = sorted(r["mine"].ttft_first_token_s / r["peer"].ttft_first_token_s for r in mine)
        print(f"{model}: {len(mine)} warm turns; mean ratio mtplx {mean('ratio_mine'):.3f} vs mlx-lm "
              f"{mean('ratio_peer'):.3f}; min {min(r['ratio_mine'] for r in mine):.3f} vs "
              f"{min(r['ratio_peer'] for r in mine):.3f}; median TTFT mtplx/mlx-lm {ttft[len(ttft) // 2]:.2f}; "
              f"parity {sum(r['parity'] for r in mine)}/{len(mine)}")
