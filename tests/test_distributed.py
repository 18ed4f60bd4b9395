"""Sharded runs on MLX's ring backend: ranks over loopback on this machine (tests/rank_worker.py).

Each test starts its own short-lived ring (a few seconds). Skipped, with the reason, where this
MLX has no distributed backend.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import mlx.core as mx

from mtplx.catalog import resolve
from mtplx.distributed.launch import LocalRing
from mtplx.distributed.layout import Layout, LayoutError, check, refusal
from mtplx.engine.checkpoint import read_config

WORKER = Path(__file__).with_name("rank_worker.py")

needs_ring = pytest.mark.skipif(not mx.distributed.is_available(), reason="this MLX build has no distributed backend")


def ring(tmp_path, n, job, *args, env=None, grace_s=20.0, timeout_s=120.0):
    """Run `job` on n ranks; (exit codes, seconds to each exit, rank 0's findings or None)."""
    out = tmp_path / f"{job}-{n}.json"
    with LocalRing([sys.executable, str(WORKER), job, str(out), *args], n, env=env) as r:
        codes = r.wait(grace_s, timeout_s)
        ended = list(r.ended)
    return codes, ended, json.loads(out.read_text()) if out.exists() else None


# -- pure: the layout and what is refused before loading ----------------------------------------
def test_layout_tag_names_mode_world_rank_and_split():
    assert Layout("tp", 2, 1).tag == "tp2r1"
    assert Layout("pp", 4, 0, (1, 1, 1, 1)).tag == "pp4r0s1-1-1-1"
    with pytest.raises(ValueError, match="world size"):
        Layout("tp", 1, 0)
    with pytest.raises(ValueError, match="split"):
        Layout("tp", 2, 0, (2, 2))


def test_unsupported_combinations_are_refused_from_the_config():
    dense, hybrid = read_config(resolve("tiny-dense")), read_config(resolve("tiny-hybrid"))
    assert refusal(dense, Layout("tp", 2, 0)) is None and refusal(hybrid, Layout("pp", 4, 0)) is None
    assert "num_key_value_heads divisible by 4" in refusal(dense, Layout("tp", 4, 0))
    assert "at least 8 layers" in refusal(hybrid, Layout("pp", 8, 0))
    assert "adds up to 5" in refusal(hybrid, Layout("pp", 2, 0, (3, 2)))
    with pytest.raises(LayoutError, match="cannot run sharded"):
        check(dense, Layout("tp", 4, 1))


# -- rings ---------------------------------------------------------------------------------------
def _smoke_found(found, n):
    assert found["sum"] == n * (n + 1) / 2 and found["gathered"] == [[r, 7] for r in range(n)]
    assert found["bytes"] == "hello ring" and found["rank0"] == 10.0
    assert found["everyone"] == [[n * (n + 1) // 2, 10, 1]] * n  # every rank saw the same


@needs_ring
def test_ring_smoke(tmp_path):
    """all_sum, all_gather, a broadcast of bytes and rank 0's array, at 2 ranks (4: the next test)."""
    codes, _, found = ring(tmp_path, 2, "smoke")
    assert codes == [0, 0]
    _smoke_found(found, 2)


@needs_ring
@pytest.mark.parametrize("model,mode", [("tiny-dense", "tp"), ("tiny-hybrid", "tp"), ("tiny-hybrid", "pp")])
def test_sharded_logits_equal_one_process(tmp_path, model, mode):
    """A 40-token prompt and three decode steps: tensor parallel within 1e-4 (the sum over ranks
    rounds differently), pipeline parallel bit-exact (each layer's arithmetic is unchanged)."""
    codes, _, found = ring(tmp_path, 2, "logits", model, mode)
    assert codes == [0, 0]
    assert found["layout"] == f"{mode}2r0" and found["identity"].endswith(f"@{mode}2r0")
    assert found["argmax_equal"]
    if model == "tiny-dense":  # qwen3 has no pipeline(): refused on the lazily built model, before any weight is read
        assert "qwen3 has no pipeline()" in found["pp_refused"]
    if mode == "pp":
        assert found["exact"], found
    else:
        assert found["max_abs"] < 1e-4, found


def _untied_hybrid(dest: Path) -> Path:
    """tiny-hybrid with its own (untied) LM head, as real Qwen3.5 checkpoints have: mlx-lm's shard()
    then splits the head by vocabulary, and each rank's logits must be gathered before sampling."""
    import shutil

    src = resolve("tiny-hybrid")
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dest / f.name)
    weights = dict(mx.load(str(src / "model.safetensors")))
    embed = weights["model.language_model.embed_tokens.weight"]
    # A head that is not the embedding: each row scaled differently, so a wrong gather shows.
    weights["lm_head.weight"] = embed * (1.0 + mx.arange(embed.shape[0], dtype=embed.dtype)[:, None] / embed.shape[0])
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = False
    config.get("text_config", {})["tie_word_embeddings"] = False
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@needs_ring
def test_a_vocab_sharded_untied_head_is_gathered_before_sampling(tmp_path):
    """tp 2 on an untied head: each rank projects half the vocabulary; the gathered logits equal one
    process's within 1e-4 (and argmax equal) over the prompt and three decode steps."""
    model = _untied_hybrid(tmp_path / "untied-hybrid")
    codes, _, found = ring(tmp_path, 2, "logits", str(model), "tp")
    assert codes == [0, 0], found
    assert found["argmax_equal"] and found["max_abs"] < 1e-4, found
    assert found["head_sharded"], found


@needs_ring
@pytest.mark.parametrize("n", [2, 4])
def test_a_lost_or_hung_peer_ends_every_other_rank_within_the_watchdog_time(tmp_path, n):
    """After the smoke checks, the last rank exits between two collectives; with 4 ranks rank 1 also
    hangs (alive, silent). Every other rank exits 3 with its one line within the watchdog's 2 s
    (plus start-up)."""
    codes, ended, found = ring(tmp_path, n, "kill", env={"MTPLX_TEST_WATCHDOG_S": "2"}, grace_s=3.0)
    _smoke_found(found, n)  # written before the peer left; nothing after it
    waiting = [r for r in range(n - 1) if not (n > 2 and r == 1)]
    assert all(codes[r] == 3 for r in waiting), codes
    assert max(ended[r] for r in waiting) < 2 + 8, ended


def test_watchdog_reports_a_stalled_block_before_its_deadline():
    """/health's `layout.status`: "stalled" once a watched block passed half the deadline, with
    what it waits on; the rank still exits only at the deadline."""
    from mtplx.distributed.watchdog import Watchdog

    dog = Watchdog(0, 12.0)
    assert dog.state() == {"status": "ok", "watchdog_s": 12.0}
    with dog.watch("decision 41"):
        assert dog.state()["status"] == "ok"  # just armed
        with dog._cond:
            dog._deadline -= 7  # as if 7 s had passed in the block: past half the deadline, 5 s before it
        state = dog.state()
        assert state["status"] == "stalled" and state["stalled"].startswith("decision 41: 7 s of the 12 s watchdog"), state
    assert dog.state()["status"] == "ok"


# -- the engine on every rank ----------------------------------------------------------------
def _turn_facts(turns):
    return [(t["tokens"], t["cached"], t["tau"]) for t in turns]


@needs_ring
@pytest.mark.parametrize("model,mode,n,extras", [
    ("tiny-dense", "tp", 2, ""),
    ("tiny-hybrid", "tp", 2, "restart"),
    ("tiny-hybrid", "pp", 2, "concurrent"),
    ("tiny-hybrid", "pp", 4, "concurrent"),
])
def test_engine_on_every_rank_equals_one_process(tmp_path, model, mode, n, extras):
    """Greedy, MTP depth 2, bank on, two agent turns with render-ahead between them: generated
    tokens, cached tokens and tau equal one process's. With "concurrent": four requests at once (a
    batched decode; one sampled with a seed) give one process's tokens. With "restart": a request cancelled mid-decode
    ends as cancelled and the ranks go on together; the ring restarted restores
    turn 2's prompt from each rank's SSD, and an unsharded engine reading rank 0's SSD directory
    misses cleanly (another layout's identity) and still answers the same."""
    codes, _, found = ring(tmp_path, n, "engine", model, mode, str(tmp_path / "home"), extras, grace_s=10)
    assert codes == [0] * n
    assert _turn_facts(found["sharded"]) == _turn_facts(found["alone"])
    assert found["sharded"][0]["cached"] == 0 and found["sharded"][1]["cached"] > 0
    assert found["health"]["layout"]["mode"] == mode and found["health"]["layout"]["ranks"] == n
    banks = found["health"]["layout"]["banks"]  # every rank's bank, sent with each pass
    assert [b["rank"] for b in banks] == list(range(n)) and all(b["ram_entries"] > 0 for b in banks), banks
    if mode == "tp":  # every rank holds an equal share of each entry's state
        assert len({(b["ram_entries"], b["ram_kib"]) for b in banks}) == 1, banks
    if extras == "concurrent":
        assert found["concurrent"] == found["concurrent_alone"]
    if extras == "restart":
        reason, generated = found["cancelled"]
        assert reason == "cancelled" and generated < 400
        assert found["after_cancel"]["tokens"] == found["sharded"][1]["tokens"]
        assert found["restarted"]["cached"] > 0
        assert found["restarted"]["tokens"] == found["sharded"][1]["tokens"]
        assert found["other_layout"]["cached"] == 0
        assert found["other_layout"]["tokens"] == found["sharded"][1]["tokens"]


@needs_ring
def test_a_rank_that_forks_ends_every_rank(tmp_path):
    """The last rank emits one token that differs from rank 0's: the next decision's digest shows
    it, and every rank exits 3 at that decision, well within the watchdog time."""
    codes, ended, found = ring(tmp_path, 2, "diverge", "tiny-dense", "tp", env={"MTPLX_TEST_WATCHDOG_S": "5"},
                               grace_s=6.0)
    assert found is None and codes == [3, 3]




def _serve(tmp_path, name, *flags):
    import subprocess

    log = open(tmp_path / f"{name}.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mtplx.cli", "serve", "--port", "0", *flags], stderr=log,
                            env={**__import__("os").environ, "MTPLX_HOME": str(tmp_path / name)})
    return proc, log


def _url(log, proc, timeout_s=120):
    import re
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        log.seek(0)
        if found := re.search(r"serving \S+ on (http://\S+)/v1", log.read()):
            return found.group(1)
        time.sleep(0.2)
    log.seek(0)
    raise AssertionError(f"no server URL: {log.read()[-2000:]}")


def _attached_header(url: str) -> str:
    """The header of `mtplx tui --attach URL` once it has read the server's /health."""
    import asyncio

    from tui.app import MtplxApp

    async def flow():
        app = MtplxApp(None, url, attach_url=url, reconnect_s=0.2)
        async with app.run_test(size=(150, 40)) as pilot:
            for _ in range(200):
                if "·" in app.sub_title:
                    break
                await pilot.pause(0.05)
            return app.sub_title

    return asyncio.run(flow())


@needs_ring
def test_serve_shard_tp_answers_like_serve(tmp_path):
    """`mtplx serve --shard tp --ranks 2` answers OpenAI chat and Anthropic messages (greedy) as
    `mtplx serve` does; /health and /metrics show the layout, and so does `mtplx tui --attach`'s
    header; SIGTERM stops every rank, exit 0."""
    import httpx

    sharded, sharded_log = _serve(tmp_path, "sharded", "--shard", "tp", "--ranks", "2")
    plain, plain_log = _serve(tmp_path, "plain")
    try:
        answers, urls = [], []
        for proc, log in ((sharded, sharded_log), (plain, plain_log)):
            url = _url(log, proc)
            urls.append(url)
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "tiny-dense", "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "user", "content": "List three files in a repo."}]}).json()
            messages = httpx.post(f"{url}/v1/messages", timeout=120, json={
                "model": "tiny-dense", "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "user", "content": "What is a bank?"}]}).json()
            health, metrics = httpx.get(f"{url}/health").json(), httpx.get(f"{url}/metrics").text
            answers.append((chat["choices"][0]["message"], chat["usage"],
                            [(b["type"], b.get("text") or b.get("thinking")) for b in messages["content"]],
                            messages["usage"], health.get("layout"), "mtplx_ranks" in metrics))
        (s_chat, s_usage, s_msg, s_musage, s_layout, s_gauge), (p_chat, p_usage, p_msg, p_musage, p_layout, p_gauge) = answers
        assert (s_chat, s_usage, s_msg, s_musage) == (p_chat, p_usage, p_msg, p_musage)
        assert s_layout["mode"] == "tp" and s_layout["ranks"] == 2 and p_layout is None
        assert s_gauge and not p_gauge
        assert _attached_header(urls[0]) == f"{urls[0]} · tiny-dense · tp × 2 ranks"  # `mtplx tui --attach` shows it
        sharded.terminate()
        assert sharded.wait(timeout=60) == 0
    finally:
        for proc in (sharded, plain):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
