"""lm-evaluation-harness against `mtplx serve`, as its users run it: `--model local-completions`,
only the base URL and model name given. Not part of CI (it installs lm_eval and torch).

    python bench/eval_harness.py [--venv ~/.cache/mtplx-lm-eval] [--model NAME_OR_DIR]

lm_eval is installed (once) into its own virtual environment. Two small tasks are written from
local data (no data set hub is reachable): a multiple-choice one, scored by log-likelihood
(`/v1/completions` with echo + logprobs, batched prompts of token ids, and the server's tokenizer
through /tokenizer_info and /tokenize), and a generate_until one. Prints lm_eval's table, then
checks each choice's log-likelihood against the server's own scoring of the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agents  # noqa: E402
from agents import free_port, serve  # noqa: E402

QUESTIONS = [("What does print do in Python?", ["It writes text to the screen", "It deletes a file", "It opens a socket"], 0),
             ("Which keyword defines a function in Python?", ["class", "def", "lambda x"], 1),
             ("What does git commit do?", ["Records staged changes", "Deletes the branch", "Formats the disk"], 0),
             ("Which file lists a Python project's metadata?", ["pyproject.toml", "Makefile.lock", "index.html"], 0),
             ("What is 2 + 2?", ["3", "4", "5"], 1),
             ("Which command lists files in a directory?", ["ls", "rm -rf", "kill"], 0)]
COMPLETIONS = [("def add(a, b):\n    return", " a + b"), ("import", " os"), ("for i in", " range")]


def tasks(root: Path) -> None:
    (root / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                           for q, c, a in QUESTIONS))
    (root / "gen.jsonl").write_text("".join(json.dumps({"question": q, "target": t}) + "\n" for q, t in COMPLETIONS))
    data = lambda name: f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / name}\ntest_split: test\n"
    (root / "mc.yaml").write_text("task: mtplx_mc\n" + data("mc.jsonl") + 'output_type: multiple_choice\n'
                                  'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
                                  'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')
    (root / "gen.yaml").write_text("task: mtplx_gen\n" + data("gen.jsonl") + 'output_type: generate_until\n'
                                   'doc_to_text: "{{question}}"\ndoc_to_target: "{{target}}"\n'
                                   'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n'
                                   'metric_list:\n  - metric: exact_match\n')


def installed(venv: Path) -> Path:
    exe = venv / "bin" / "lm_eval"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "lm_eval[api]"], check=True)
    return exe


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=300).read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "mtplx-lm-eval")
    parser.add_argument("--model", default="tiny-dense")
    args = parser.parse_args()
    agents.SERVED = args.model  # what the server loads; the requests name it as `mtplx serve` does
    name = Path(args.model).name if Path(args.model).is_dir() else args.model
    exe = installed(args.venv)
    root = Path(tempfile.mkdtemp(prefix="mtplx-lm-eval-"))
    tasks(root)
    port = free_port()
    server = serve(port, root / "mtplx", 8192, None)
    url = f"http://127.0.0.1:{port}"
    try:
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        run = subprocess.run([str(exe), "--model", "local-completions", "--model_args",
                              f"model={name},base_url={url}/v1/completions,num_concurrent=1,max_retries=1",
                              "--tasks", "mtplx_mc,mtplx_gen", "--include_path", str(root), "--batch_size", "4",
                              "--log_samples", "--output_path", str(root / "out")],
                             cwd=root, env=env, capture_output=True, text=True)
        print("\n".join(line for line in run.stdout.splitlines() if line.startswith("|")))
        if run.returncode:
            raise SystemExit(f"lm_eval exit {run.returncode}: {run.stderr[-800:]}")
        used_remote = "Using remote tokenizer" in run.stderr
        worst, checked = 0.0, 0
        for line in next((root / "out").rglob("samples_mtplx_mc_*.jsonl")).read_text().splitlines():
            sample = json.loads(line)
            context = f"Question: {sample['doc']['question']}\nAnswer:"
            for choice, resp in zip(sample["doc"]["choices"], sample["resps"]):
                ctx = post(url + "/tokenize", {"prompt": context, "add_special_tokens": False})["tokens"]
                whole = ctx + post(url + "/tokenize", {"prompt": " " + choice, "add_special_tokens": False})["tokens"]
                scored = post(url + "/v1/completions", {"prompt": whole, "max_tokens": 1, "logprobs": 1, "echo": True,
                                                        "temperature": 0})["choices"][0]["logprobs"]["token_logprobs"]
                worst = max(worst, abs(sum(scored[len(ctx):-1]) - float(resp[0][0])))
                checked += 1
        print(f"\nremote tokenizer used: {used_remote}; {checked} choice log-likelihoods, largest difference from the "
              f"server's own scoring {worst:.2e}")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
