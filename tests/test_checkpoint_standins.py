"""The checkpoints users actually run, as small stand-ins in their real on-disk layouts (see
tests/standins.py): each row is listed by `models`, generates with MTP (greedy output equal to AR)
and without, serves a three-turn tool conversation, and opens in the TUI; its MTP head loads with
exactly the weights the file holds; its logits are the model's own. An unsupported architecture
exits 2 with one line.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import standins
from mtplx.bank.bank import BankConfig
from mtplx.catalog import cached, describe, resolve
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams

TINY_TOKENIZER = Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "models" / "tiny-dense"
HUB_ID = "mlx-community/Qwen3-standin-4bit"
# row -> (built from, speculates)
ROWS = {
    "qwen3-hf": False, "qwen3-mlx-4bit": False, "hub-id": False, "qwen3_5-hf": True, "qwen3_5-convert": True,
    "qwen3_next-hf": True, "qwen3_next-convert": True, "qwen3_5_moe-hf": True, "qwen3_5_moe-convert": True,
    "deepseek_v3": True, "deepseek_v32": True, "glm4_moe": True, "glm4_moe_lite": True, "glm_moe_dsa": True,
    "llama": False, "llama3-template": False, "gemma2": False, "gemma3": False,
}
NEEDS_SHARED = ("qwen3-hf", "qwen3-mlx-4bit", "hub-id")
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


def _mlx_lm_convert(src: Path, dst: Path) -> None:
    import importlib

    importlib.import_module("mlx_lm.convert").convert(str(src), str(dst), quantize=True, q_group_size=32, q_bits=4)


def _mtplx_convert(src: Path, dst: Path, group_size: int) -> None:
    from mtplx.convert import convert

    convert(src, dst, bits=4, group_size=group_size)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every stand-in, built once: row -> directory (or hub id)."""
    root = tmp_path_factory.mktemp("standins")
    out = {}
    if standins.SHARED.is_dir():
        out["qwen3-hf"] = standins.build("qwen3", root / "qwen3-hf", standins.SHARED)
        _mlx_lm_convert(out["qwen3-hf"], root / "qwen3-mlx-4bit")  # mlx-community's layout, by mlx-lm itself
        out["qwen3-mlx-4bit"] = root / "qwen3-mlx-4bit"
        standins.hub_cache(root / "hf-cache", HUB_ID, out["qwen3-mlx-4bit"])
        out["hub-id"] = HUB_ID
    out["qwen3_5-hf"] = standins.qwen3_5_from_tiny(root / "qwen3_5-hf")
    for kind in ("qwen3_next", "qwen3_5_moe"):
        out[f"{kind}-hf"] = standins.build(kind, root / f"{kind}-hf", TINY_TOKENIZER)
    for kind in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
        _mtplx_convert(out[f"{kind}-hf"], root / f"{kind}-convert", 64 if kind == "qwen3_5" else 32)
        out[f"{kind}-convert"] = root / f"{kind}-convert"
    for kind in ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa"):
        out[kind] = standins.build(kind, root / kind, TINY_TOKENIZER)
    out["llama"] = standins.build("llama", root / "llama", TINY_TOKENIZER,
                                  generation_config={"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9})
    for kind in ("gemma2", "gemma3"):
        out[kind] = standins.build(kind, root / kind, TINY_TOKENIZER)
    llama3 = standins.llama3_tokenizer(root / "llama3-tokenizer")
    specials = {t["content"]: t["id"] for t in json.loads((llama3 / "tokenizer.json").read_text())["added_tokens"]}
    out["llama3-template"] = standins.build("llama", root / "llama3-template", llama3, generation_config={
        "eos_token_id": [specials["<|end_of_text|>"], specials["<|eot_id|>"]]})
    yield out, root / "hf-cache"


@pytest.fixture(autouse=True)
def hf_cache(built, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(built[1]))


@pytest.fixture(scope="module")
def engines(built):
    live = {}

    def get(row):
        if row not in live:
            path = resolve(built[0][row]) if row in built[0] else pytest.skip(f"{row}: ../shared fixtures absent")
            live[row] = Engine(path, EngineConfig(chunk_size=64, depth=2), name=row, bank=BankConfig()).start()
        return live[row]

    yield get
    for engine in live.values():
        engine.stop()


@pytest.fixture(scope="module")
def packed_engines(built):
    """Engines whose quantized layers stay packed (MTPLX_CPU_DEQUANTIZE=off), as on Metal: on the
    CPU fast path they are unpacked at load (engine/compute.py), which `engines` gets."""
    import os

    from mtplx.engine.compute import DEQUANTIZE_ENV

    live = {}

    def get(row):
        if row not in live:
            path = resolve(built[0][row]) if row in built[0] else pytest.skip(f"{row}: ../shared fixtures absent")
            before = os.environ.get(DEQUANTIZE_ENV)
            os.environ[DEQUANTIZE_ENV] = "off"
            try:
                live[row] = Engine(path, EngineConfig(chunk_size=64, depth=2), name=row, bank=BankConfig()).start()
            finally:
                os.environ.pop(DEQUANTIZE_ENV) if before is None else os.environ.__setitem__(DEQUANTIZE_ENV, before)
        return live[row]

    yield get
    for engine in live.values():
        engine.stop()


def _row(built, row):
    if row not in built[0]:
        pytest.skip(f"{row} needs the real Qwen3 tokenizer in ../shared/fixtures/tokenizers/qwen3 (absent)")
    return built[0][row]


@pytest.mark.parametrize("row", ROWS)
def test_models_describes_the_row(built, row, monkeypatch):
    model = _row(built, row)
    info = describe(resolve(model))
    assert info["runs"] and info["mtp"] == ROWS[row]
    assert (info["mtp_notice"] is None) == ROWS[row]
    if row == "hub-id":
        assert info["name"] == HUB_ID and [r["name"] for r in cached()] == [HUB_ID]


@pytest.mark.parametrize("row", ROWS)
def test_generate_mtp_and_ar(built, engines, row):
    _row(built, row)
    engine = engines(row)
    prompt = tuple(engine.checkpoint.tokenizer.encode("def main():\n    return"))
    out = {}
    for mtp in (True, False):
        fin = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=12, ignore_eos=True), use_mtp=mtp,
                                              session=f"gen-{mtp}")).result()
        out[mtp] = fin.token_ids
        assert fin.stats.mode == ("mtp" if mtp and ROWS[row] else "ar")
    assert out[True] == out[False]
    assert (engine.checkpoint.mtp_notice is None) == ROWS[row]


@pytest.mark.parametrize("row", ROWS)
def test_runner_logits_are_the_models_own(built, engines, row):
    """Softcaps and wrappers included (Gemma 2's final_logit_softcapping, Gemma 3's multimodal
    wrapper): the runner's hidden -> logits path equals the model's own forward."""
    import mlx.core as mx

    _row(built, row)
    engine = engines(row)

    def both():
        runner = engine.runner
        ids = [5, 9, 11, 3]
        ours = runner.logits(runner.hidden(ids, runner.new_trunk_cache()))
        theirs = runner.model(mx.array([ids]), cache=runner.new_trunk_cache()).astype(mx.float32)
        return mx.abs(ours - theirs).max().item()

    assert engine.call(both) < 1e-3


@pytest.mark.parametrize("row", ROWS)
def test_serve_three_turn_tool_conversation(built, engines, row):
    from fastapi.testclient import TestClient

    from mtplx.server.app import create_app

    _row(built, row)
    engine = engines(row)
    call = {"id": "call_0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    turns = [
        [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "What is in a.py?"}],
        [{"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_0", "content": "x = 1\n"}],
        [{"role": "assistant", "content": "It sets x."}, {"role": "user", "content": "Thanks. Now b.py?"}],
    ]
    messages = []
    with TestClient(create_app(engine, row)) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["mtp"] == ROWS[row] and (card["mtp_notice"] is None) == ROWS[row]
        for turn in turns:
            messages += turn
            r = client.post("/v1/chat/completions", headers={"x-session-id": f"tools-{row}"},
                            json={"model": row, "messages": messages, "tools": TOOLS, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("row", ["qwen3-hf", "qwen3_5-convert", "llama", "gemma3"])
def test_tui_opens_and_chats(built, engines, row):
    """The TUI on the row's engine: its header says when the model decodes autoregressively, and
    one chat turn lands in the turns table."""
    from tui.app import MtplxApp

    _row(built, row)
    engine = engines(row)
    engine.settle()  # earlier tests' render-ahead would otherwise post bank decisions into this app

    async def flow():
        app = MtplxApp(engine=engine, model_name=row, max_tokens=6)
        async with app.run_test(size=(140, 44)) as pilot:
            assert ("decoding autoregressively" in app.sub_title) == (not ROWS[row])
            await pilot.press(*"hi", "enter")
            for _ in range(200):
                await pilot.pause(0.05)
                if app.dashboard.query_one("#turns").row_count:
                    break
            assert app.dashboard.query_one("#turns").row_count == 1

    asyncio.run(flow())


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "deepseek_v32", "glm4_moe",
                                  "glm4_moe_lite", "glm_moe_dsa"])
def test_head_loads_exactly_the_files_weights(tmp_path, kind):
    """The head in HF layout (zero-centred norms, per-expert or fused experts, DeepSeek's
    model.layers.N with kv_b_proj; V3.2's indexer in the file, dropped) loads as the very
    parameters it was written from."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mtplx.engine.checkpoint import load_checkpoint

    mx.random.seed(1)
    config = standins.config_for(kind, standins.vocab_of(TINY_TOKENIZER))
    _, head, _ = standins._mlx_parameters(config)
    mx.random.seed(1)
    ck = load_checkpoint(standins.build(kind, tmp_path / kind, TINY_TOKENIZER, seed=1))
    loaded = dict(tree_flatten(ck.mtp.parameters()))
    assert set(loaded) == set(head)
    tol = 1e-6 if kind != "qwen3_5" else 1e-2  # the qwen3_5 stand-in is stored in bf16
    for k, v in head.items():
        assert mx.abs(loaded[k].astype(mx.float32) - v.astype(mx.float32)).max().item() <= tol, k


def test_quantized_head_loads_and_speculates(built, tmp_path, monkeypatch):
    """`convert --head-bits 8`: the head is quantized on disk and loads as quantized layers
    (kept packed here, as on Metal: the CPU fast path unpacks them, tests/test_dequantize.py)."""
    import mlx.nn as nn

    from mtplx.convert import convert
    from mtplx.engine.checkpoint import load_checkpoint
    from mtplx.engine.compute import DEQUANTIZE_ENV

    monkeypatch.setenv(DEQUANTIZE_ENV, "off")
    convert(built[0]["qwen3_5-hf"], tmp_path / "q", bits=4, group_size=64, head_bits=8)
    ck = load_checkpoint(tmp_path / "q")
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in ck.mtp.named_modules())
    engine = Engine(tmp_path / "q", EngineConfig(chunk_size=64, depth=1)).start()
    try:
        prompt = tuple(ck.tokenizer.apply_chat_template([{"role": "user", "content": "List the files in src."}],
                                                        add_generation_prompt=True))
        fin = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=24))).result()
        assert fin.stats.mode == "mtp" and fin.stats.acceptance_by_depth[0] > 0.5
    finally:
        engine.stop()


def test_generation_config_eos_list_and_sampling_defaults(built, engines):
    from mtplx.engine.checkpoint import load_checkpoint

    ck = load_checkpoint(built[0]["llama"])
    assert {2, 7} <= set(ck.tokenizer.eos_token_ids) and {2, 7} <= engines("llama").eos_ids
    params = ck.generation.defaults(SamplingParams(temperature=0.0, max_tokens=9))
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 9)


def test_hub_id_not_cached_names_where_it_looked(built):
    from mtplx.errors import ModelLoadError

    with pytest.raises(ModelLoadError) as info:
        resolve("someone/not-here")
    assert str(built[1] / "models--someone--not-here") in str(info.value)


def test_unsupported_architecture_exits_2_with_one_line(tmp_path):
    model = standins.build("llama", tmp_path / "odd", TINY_TOKENIZER)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "warp_drive"}))
    for _ in range(2):  # the abort it replaced came in most runs, not all
        run = subprocess.run([sys.executable, "-m", "mtplx.cli", "generate", "-m", str(model), "-p", "hi"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, run.stderr
        assert run.stderr.strip().count("\n") == 0 and "warp_drive" in run.stderr


@pytest.mark.parametrize("row", ["qwen3-hf", "llama3-template"])
def test_real_template_tool_conversation_restores_its_ceiling(built, engines, row):
    """On real templates (Qwen3's with its tokenizer; Llama 3's): system + tools, user, assistant
    tool call, tool result, new user — every warm turn restores at least 0.99 of its ceiling, which
    the bank computes from each template's own turn markers (non-zero on both)."""
    from fastapi.testclient import TestClient

    from mtplx.bank.spans import reuse_ratio
    from mtplx.events import Restored
    from mtplx.server.app import create_app

    _row(built, row)
    engine = engines(row)
    seen: list[Restored] = []
    listener = lambda e: seen.append(e) if isinstance(e, Restored) else None
    engine.listeners.append(listener)
    call = {"id": "call_0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'}}
    turns = [
        [{"role": "system", "content": "You are a careful coding agent working inside a repository. " * 8},
         {"role": "user", "content": "Read src/app.py and tell me what it does."}],
        [{"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_0", "content": "def main():\n    print('hello')\n" * 6}],
        [{"role": "assistant", "content": "It prints hello six times."},
         {"role": "user", "content": "Now make it print goodbye instead."}],
    ]
    from mtplx.chat import render

    messages, ratios, previous = [], [], None
    try:
        with TestClient(create_app(engine, row)) as client:
            for turn in turns:
                messages += turn
                r = client.post("/v1/chat/completions", headers={"x-session-id": "real-template"},
                                json={"messages": messages, "tools": TOOLS, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                restored, prompt = seen[-1], render(engine.checkpoint.tokenizer, messages, TOOLS)
                ceiling = restored.ceiling if previous else None
                assert previous is None or ceiling > 0
                ratios.append(reuse_ratio(restored.cached_tokens, ceiling))
                previous = prompt
                engine.settle()  # the agent runs its tool: idle time the bank may use
    finally:
        engine.listeners.remove(listener)
    assert seen[-3].cached_tokens == 0
    assert all(r is not None and r >= 0.99 for r in ratios[1:]), ratios


def test_converted_qwen35_keeps_its_acceptance(built, engines):
    """`mtplx convert` (4-bit trunk, group 64, bf16 head) of the Qwen3.5 stand-in made from the
    trained tiny weights: depth-1 acceptance within 0.05 of the bf16 original, and MTP greedy ==
    AR greedy on it (held-out prompts; bench/checkpoints.py runs more)."""
    from test_mtp_held_out import held_out_prompts

    prompts = held_out_prompts(engines("qwen3_5-hf").checkpoint.tokenizer, 3)
    rates = {}
    for row in ("qwen3_5-hf", "qwen3_5-convert"):
        engine, drafted, accepted = engines(row), 0, 0
        for prompt in prompts:
            params = SamplingParams(max_tokens=96, ignore_eos=True)
            mtp = engine.submit(GenerationRequest(prompt, params, use_mtp=True, depth=1)).result()
            drafted, accepted = drafted + mtp.stats.drafted_by_depth[0], accepted + mtp.stats.accepted_by_depth[0]
            if row == "qwen3_5-convert":
                ar = engine.submit(GenerationRequest(prompt, params, use_mtp=False)).result()
                assert mtp.token_ids == ar.token_ids
        rates[row] = accepted / drafted
    assert rates["qwen3_5-hf"] > 0.8 and rates["qwen3_5-convert"] >= rates["qwen3_5-hf"] - 0.05, rates


def test_server_defaults_come_from_generation_config(built, engines):
    """A request without sampling parameters samples with the checkpoint's generation_config.json
    values; explicit ones still win."""
    from fastapi.testclient import TestClient

    from mtplx.events import Queued
    from mtplx.server.app import create_app

    engine = engines("llama")
    seen = []
    listener = lambda e: seen.append(e.request.sampling) if isinstance(e, Queued) else None
    engine.listeners.append(listener)
    try:
        with TestClient(create_app(engine, "llama")) as client:
            for extra in ({}, {"temperature": 0.1}):
                r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 2, **extra})
                assert r.status_code == 200
    finally:
        engine.listeners.remove(listener)
    assert (seen[0].temperature, seen[0].top_p) == (0.6, 0.9) and (seen[1].temperature, seen[1].top_p) == (0.1, 0.9)


def test_models_lists_the_hub_cache_without_importing_mlx(built):
    """`mtplx models` reads files only: it lists the cached hub id (with its notice) and never
    imports MLX."""
    if "hub-id" not in built[0]:
        pytest.skip("needs the real Qwen3 tokenizer in ../shared/fixtures/tokenizers/qwen3 (absent)")
    code = ("import json, sys; from typer.testing import CliRunner; from mtplx.cli import app; "
            "r = CliRunner().invoke(app, ['models', '--json']); "
            "print(json.dumps([[x['name'], x['mtp_notice']] for x in json.loads(r.output)] + [any(m == 'mlx' or "
            "m.startswith('mlx.') for m in sys.modules)]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    *rows, imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert [HUB_ID, "no MTP head in this checkpoint: decoding autoregressively"] in rows and not imported


def test_bf16_moe_runs_in_float32_on_cpu_without_the_fast_path(tmp_path, monkeypatch):
    """MLX's CPU gather_mm runs float32 only: a bf16 Qwen3.5-MoE checkpoint still generates on
    CPU with the fp32 fast path off, because the MoE trunk (and head) are computed in float32."""
    import mlx.core as mx

    monkeypatch.setenv("MTPLX_FAST_PATH", "off")
    path = standins.build("qwen3_5_moe", tmp_path / "moe", TINY_TOKENIZER, dtype=mx.bfloat16)
    engine = Engine(path, EngineConfig(chunk_size=64, depth=2)).start()
    try:
        assert engine.checkpoint.extras["moe_float32"]
        fin = engine.submit(GenerationRequest((5, 9, 11, 3), SamplingParams(max_tokens=6, ignore_eos=True))).result()
        assert fin.stats.mode == "mtp" and len(fin.token_ids) == 6
    finally:
        engine.stop()


def test_hf_head_copied_into_a_converted_trunk_keeps_its_own_layout(built, tmp_path):
    """The common repair for an MLX quant without a head: copy `mtp.*` from the Hugging Face
    files next to the converted trunk. The head's zero-centred norms are recognised from its own
    tensors (the trunk around it is already converted) and it loads as the converted head does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mtplx.engine.checkpoint import load_checkpoint

    dest = tmp_path / "mixed"
    shutil.copytree(built[0]["qwen3_5-convert"], dest)
    (dest / "model-mtp.safetensors").unlink()
    hf = {}
    for shard in sorted(Path(built[0]["qwen3_5-hf"]).glob("model-*.safetensors")):
        hf.update({k: v for k, v in mx.load(str(shard)).items() if k.startswith("mtp.")})
    mx.save_safetensors(str(dest / "model-mtp.safetensors"), hf)
    mixed = dict(tree_flatten(load_checkpoint(dest).mtp.parameters()))
    converted = dict(tree_flatten(load_checkpoint(built[0]["qwen3_5-convert"]).mtp.parameters()))
    assert set(mixed) == set(converted)
    for k in converted:
        assert mx.abs(mixed[k].astype(mx.float32) - converted[k].astype(mx.float32)).max().item() < 1e-2, k


def test_unusable_head_runs_autoregressively_with_a_notice(built, tmp_path):
    """A head whose weights do not fit one decoder layer costs speculation, not the model."""
    import mlx.core as mx

    from mtplx.engine.checkpoint import load_checkpoint

    dest = tmp_path / "bad-head"
    shutil.copytree(built[0]["qwen3_5-convert"], dest)
    head = mx.load(str(dest / "model-mtp.safetensors"))
    head["mtp.fc.weight"] = head["mtp.fc.weight"][:, :8]
    mx.save_safetensors(str(dest / "model-mtp.safetensors"), head)
    ck = load_checkpoint(dest)
    assert not ck.has_mtp and "MTP weights could not be used" in ck.mtp_notice and "decoding autoregressively" in ck.mtp_notice


def test_llama3_end_of_turn_is_an_end_of_sequence_id(built, engines):
    """Llama 3's `<|eot_id|>` and `<|end_of_text|>` (generation_config.json's list) both end a
    turn, so generation stops at the end of turn instead of running past it."""
    engine = engines("llama3-template")
    tok = engine.checkpoint.tokenizer
    eot, eos = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|end_of_text|>")
    assert {eot, eos} <= engine.eos_ids


def test_gemma3_real_template_refuses_tool_turns_with_a_clean_400(tmp_path):
    """Gemma 3's own template has no tool role: a conversation with one is a 400 carrying the
    template's message, never a 500; a plain chat on it is served."""
    from fastapi.testclient import TestClient

    from mtplx.server.app import create_app

    path = standins.build("gemma3", tmp_path / "g3", standins.family_tokenizer("gemma3", tmp_path / "tok"))
    engine = Engine(path, EngineConfig(chunk_size=64)).start()
    call = {"id": "c0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read a.py."}]
    try:
        with TestClient(create_app(engine, "g3")) as client:
            r = client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 4})
            assert r.status_code == 200, r.text
            r = client.post("/v1/chat/completions", json={"max_tokens": 4, "tools": TOOLS, "messages": chat + [
                {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c0", "content": "x"}]})
            assert r.status_code == 400 and "alternate" in r.json()["error"]["message"]
        assert engine.checkpoint.tokenizer.convert_tokens_to_ids("<end_of_turn>") in engine.eos_ids
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-hybrid", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "deepseek_v32",
                                  "glm4_moe", "glm4_moe_lite", "glm_moe_dsa"])
def test_head_cache_over_a_prompt_is_keys_only_and_exact(tmp_path, kind):
    """Over prompt pairs the head runs only as far as its keys and values (MTPHead.extend); the
    cache it leaves equals a full forward's bit for bit, so every later draft is the same. MLA
    (DeepSeek) caches its latent and rope key instead, through the same call."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mtplx.engine.checkpoint import load_checkpoint

    path = resolve(kind) if kind.startswith("tiny-") else standins.build(kind, tmp_path / kind, TINY_TOKENIZER, seed=2)
    ck = load_checkpoint(path)
    mx.random.seed(3)
    hidden = mx.random.normal((1, 40, ck.mtp.fc.weight.shape[0]))
    embeds = mx.random.normal((1, 40, ck.mtp.fc.weight.shape[0]))
    full, keys_only = KVCache(), KVCache()
    for a, b in ((0, 24), (24, 40)):  # two chunks: the second attends to the first's keys
        ck.mtp(hidden[:, a:b], embeds[:, a:b], full)
        ck.mtp.extend(hidden[:, a:b], embeds[:, a:b], keys_only)
    assert full.offset == keys_only.offset == 40
    for x, y in ((full.keys, keys_only.keys), (full.values, keys_only.values)):
        x, y = x[..., :40, :], y[..., :40, :]
        assert x.shape == y.shape and mx.array_equal(x, y).item()


@pytest.mark.parametrize("row", ["qwen3-mlx-4bit", "qwen3_5-convert", "qwen3_next-convert"])
def test_a_draft_vocabulary_over_a_quantized_lm_head(packed_engines, row):
    """A draft vocabulary's rows sliced from a quantized LM head (mlx-lm's tied 4-bit embedding,
    mtplx convert's 4-bit lm_head) score those tokens as the whole head does; where the model
    speculates, MTP greedy over the set still equals AR greedy."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    engine = packed_engines(row)
    assert any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in engine.checkpoint.model.named_modules())
    ids = [t for t in range(1536) if t % 3]

    def compare():
        runner = engine.runner
        saved, engine.draft_vocab = engine.draft_vocab, None
        assert runner.use_draft_ids(ids)
        hidden = runner.hidden(list(range(5, 21)), runner.new_trunk_cache())
        full, part = runner.logits(hidden)[..., runner.draft_ids], runner.draft_logits(hidden)
        return saved, np.array(full), np.array(part)

    saved, full, part = engine.call(compare)
    try:
        assert part.shape[-1] == len(ids) and np.allclose(full, part, rtol=1e-4, atol=1e-4)
        if ROWS[row]:
            prompt = tuple(engine.checkpoint.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Explain the cache module."}], add_generation_prompt=True))
            params = SamplingParams(max_tokens=32, ignore_eos=True)
            ar = engine.submit(GenerationRequest(prompt, params, use_mtp=False)).result()
            mtp = engine.submit(GenerationRequest(prompt, params, use_mtp=True, depth=2)).result()
            assert mtp.token_ids == ar.token_ids and mtp.stats.verify_calls > 0
    finally:
        engine.call(lambda: (setattr(engine, "draft_vocab", saved), engine.runner.use_draft_ids(saved and saved.ids())))
