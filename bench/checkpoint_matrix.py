"""The checkpoint-kind table of docs/models.md, by running the real commands on each stand-in
(tests/standins.py builds them): `mtplx models`, `mtplx generate` with MTP and `--no-mtp`
(greedy; the two outputs must be equal), `mtplx serve` with a three-turn tool conversation over
HTTP, and `mtplx tui` in tmux (header, one chat turn). Prints a markdown table; a cell is ✔ only
when its command ran and its check held.

    python bench/checkpoint_matrix.py [--rows qwen3-hf,llama] [--keep DIR]   (needs tmux; ~5 min)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
MTPLX = [sys.executable, "-m", "mtplx.cli"]
HUB_ID = "mlx-community/Qwen3-standin-4bit"
COLUMNS = ("models", "generate MTP", "generate --no-mtp", "serve 3-turn tools", "tui")


def build(root: Path) -> dict:
    """row -> (model argument, speculates)."""
    import importlib

    import standins

    from mtplx.convert import convert

    tiny = ROOT / "mtplx" / "assets" / "models" / "tiny-dense"
    rows = {}
    if standins.SHARED.is_dir():
        hf = standins.build("qwen3", root / "qwen3-hf", standins.SHARED)
        importlib.import_module("mlx_lm.convert").convert(str(hf), str(root / "qwen3-mlx-4bit"), quantize=True,
                                                          q_group_size=32, q_bits=4)
        standins.hub_cache(root / "hf-cache", HUB_ID, root / "qwen3-mlx-4bit")
        rows |= {"Qwen3 HF (real tokenizer)": (str(hf), False),
                 "Qwen3 MLX 4-bit (mlx_lm.convert)": (str(root / "qwen3-mlx-4bit"), False),
                 f"hub id {HUB_ID} (HF cache)": (HUB_ID, False)}
    q35 = standins.qwen3_5_from_tiny(root / "qwen3_5-hf")
    rows["Qwen3.5 HF (trained tiny weights)"] = (str(q35), True)
    convert(q35, root / "qwen3_5-convert", bits=4, group_size=64)
    rows["Qwen3.5 `mtplx convert` 4-bit + head"] = (str(root / "qwen3_5-convert"), True)
    for kind, label in (("qwen3_next", "Qwen3-Next"), ("qwen3_5_moe", "Qwen3.5-MoE")):
        hf = standins.build(kind, root / f"{kind}-hf", tiny)
        convert(hf, root / f"{kind}-convert", bits=4, group_size=32)
        rows[f"{label} HF"] = (str(hf), True)
        rows[f"{label} `mtplx convert` 4-bit + head"] = (str(root / f"{kind}-convert"), True)
    rows["DeepSeek-V3-style MTP (model.layers.N)"] = (str(standins.build("deepseek_v3", root / "deepseek_v3", tiny)), True)
    rows["GLM-4.5-style MTP (GQA + partial RoPE, MoE, model.layers.N)"] = (
        str(standins.build("glm4_moe", root / "glm4_moe", tiny)), True)
    rows["GLM-4.7-Flash-style MTP (MLA, MoE, model.layers.N)"] = (
        str(standins.build("glm4_moe_lite", root / "glm4_moe_lite", tiny)), True)
    rows["GLM-5-style MTP (glm_moe_dsa: V3.2's MLA + indexer, CacheList caches)"] = (
        str(standins.build("glm_moe_dsa", root / "glm_moe_dsa", tiny)), True)
    rows["Llama (eos list in generation_config)"] = (str(standins.build(
        "llama", root / "llama", tiny, generation_config={"eos_token_id": [2, 7]})), False)
    llama3 = standins.llama3_tokenizer(root / "llama3-tokenizer")
    specials = {t["content"]: t["id"] for t in json.loads((llama3 / "tokenizer.json").read_text())["added_tokens"]}
    rows["Llama (Llama 3's real chat template and special tokens)"] = (str(standins.build(
        "llama", root / "llama3-template", llama3,
        generation_config={"eos_token_id": [specials["<|end_of_text|>"], specials["<|eot_id|>"]]})), False)
    rows["Gemma 3 (Gemma 3's real chat template and turn tokens)"] = (str(standins.build(
        "gemma3", root / "gemma3-template", standins.family_tokenizer("gemma3", root / "gemma3-tokenizer"))), False)
    rows["DeepSeek-V3-style MTP with a V3.1-layout template (DeepSeek's call tokens; tools described by mtplx)"] = (
        str(standins.build("deepseek_v3", root / "deepseek_v3_1", standins.family_tokenizer("deepseek_v3_1",
                                                                                             root / "ds31-tokenizer"))), True)
    rows["DeepSeek-V3.2-style MTP (indexer, CacheList caches; mlx-lm's Python encoder, DSML calls)"] = (
        str(standins.build("deepseek_v32", root / "deepseek_v32", standins.family_tokenizer("deepseek_v32",
                                                                                             root / "ds32-tokenizer"))), True)
    gptoss = standins.family_tokenizer("gptoss", root / "gptoss-tokenizer")
    harmony = {t["content"]: t["id"] for t in json.loads((gptoss / "tokenizer.json").read_text())["added_tokens"]}
    rows["gpt-oss (MLX layout, harmony template and tokens, sliding window + sinks)"] = (str(standins.build(
        "gpt_oss", root / "gpt_oss", gptoss,
        generation_config={"eos_token_id": [harmony["<|return|>"], harmony["<|call|>"]]})), False)
    rows["Gemma 2 (final logit softcap)"] = (str(standins.build("gemma2", root / "gemma2", tiny)), False)
    rows["Gemma 3 (multimodal wrapper)"] = (str(standins.build("gemma3", root / "gemma3", tiny)), False)
    return rows


def run(args, timeout=180):
    return subprocess.run(MTPLX + args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def check_models(model, mtp) -> bool:
    r = run(["models", model, "--json"])
    if r.returncode:
        return False
    row = json.loads(r.stdout)[-1]
    return row["runs"] and row["mtp"] == mtp


def check_generate(model, mtp) -> tuple[bool, bool]:
    prompt = ["-p", "Read src/app.py and tell me what it does.", "-n", "24", "-t", "0"]
    a, b = run(["generate", "-m", model, *prompt]), run(["generate", "-m", model, *prompt, "--no-mtp"])
    ok_a = a.returncode == 0 and (("[mtp depth" in a.stderr) if mtp else ("notice:" in a.stderr and "[ar]" in a.stderr))
    ok_b = b.returncode == 0 and "[ar]" in b.stderr
    return ok_a and ok_b and a.stdout == b.stdout, ok_b


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def check_serve(model) -> bool:
    import httpx

    port = free_port()
    proc = subprocess.Popen(MTPLX + ["serve", "-m", model, "--port", str(port), "--no-ssd"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None or time.time() > deadline:
                print(f"serve {model} did not come up: {proc.stderr.read() if proc.poll() is not None else 'timeout'}",
                      file=sys.stderr)
                return False
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
        call = {"id": "c0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
        turns = [[{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "What is in a.py?"}],
                 [{"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "c0", "content": "x = 1\n"}],
                 [{"role": "assistant", "content": "It sets x."}, {"role": "user", "content": "And b.py?"}]]
        messages = []
        for turn in turns:
            messages += turn
            r = httpx.post(url + "/v1/chat/completions", headers={"x-session-id": "matrix"}, timeout=120,
                           json={"messages": messages, "tools": tools, "max_tokens": 16, "temperature": 0})
            if r.status_code != 200 or r.json()["choices"][0]["message"]["role"] != "assistant":
                return False
        return True
    finally:
        proc.terminate()
        proc.wait(30)


def check_tui(model, mtp) -> bool:
    session = f"mtplx-matrix-{os.getpid()}"
    cmd = " ".join(MTPLX + ["tui", "-m", f"'{model}'", "--no-serve", "--no-ssd", "-n", "8"])
    subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "42", "-c", str(ROOT), cmd], check=True)

    def screen():
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_for(text, seconds):
        for _ in range(seconds * 2):
            if text in screen():
                return True
            time.sleep(0.5)
        return False

    try:
        if not wait_for("no turns yet", 240):
            return False
        header_ok = mtp or "decoding autoregressively" in screen()
        subprocess.run(["tmux", "send-keys", "-t", session, "hello there", "Enter"])
        return header_ok and wait_for("done:", 240)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="", help="comma-separated substrings of row names to run")
    ap.add_argument("--keep", default=None, help="build the stand-ins here and keep them")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp())
    os.environ["HF_HUB_CACHE"] = str(root / "hf-cache")
    os.environ.setdefault("MTPLX_HOME", str(root / "mtplx-home"))
    try:
        rows = build(root) if not (root / "rows.json").is_file() else json.loads((root / "rows.json").read_text())
        (root / "rows.json").write_text(json.dumps(rows))
        wanted = [w for w in args.rows.split(",") if w]
        print("| checkpoint kind | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |")
        print("|---" * (len(COLUMNS) + 1) + "|")
        for name, (model, mtp) in rows.items():
            if wanted and not any(w in name for w in wanted):
                continue
            gen_mtp, gen_ar = check_generate(model, mtp)
            cells = [check_models(model, mtp), gen_mtp, gen_ar, check_serve(model), check_tui(model, mtp)]
            print(f"| {name} | " + " | ".join("✔" if c else "✘" for c in cells) + " |", flush=True)
        bad = root / "unsupported"
        shutil.copytree(rows[next(n for n in rows if n.startswith("Llama"))][0], bad, dirs_exist_ok=True)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(config | {"model_type": "warp_drive"}))
        codes = [run(["generate", "-m", str(bad), "-p", "hi"]) for _ in range(3)]
        print(f"\nunsupported architecture: exit codes {[c.returncode for c in codes]}, "
              f"stderr lines {[len(c.stderr.strip().splitlines()) for c in codes]}: {codes[0].stderr.strip()}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
