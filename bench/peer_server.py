"""`mlx_lm.server` serving an embedded model, for side-by-side measurements.

    python bench/peer_server.py --model tiny-dense --port 8091     # runs it in the foreground

mlx-lm's qwen3 class loads weights strictly and knows nothing of `mtp.*` keys, so the server gets a
copy of the model directory with those keys removed (the trunk's weights, config, template and
tokenizer are byte-identical, so both servers compute the same model). The copy lives under
build/peer/ and is rebuilt when the source weights change.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtplx.catalog import resolve  # noqa: E402


def trunk_copy(model: str, root: Path = ROOT / "build" / "peer") -> Path:
    """A copy of the model without its MTP weights (what mlx-lm can load)."""
    import mlx.core as mx

    src = resolve(model)
    dst = root / src.name
    weights = src / "model.safetensors"
    stamp = dst / ".source-mtime"
    if stamp.exists() and stamp.read_text() == str(weights.stat().st_mtime_ns):
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = {k: v for k, v in mx.load(str(weights)).items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(dst / "model.safetensors"), tensors, metadata={"format": "mlx"})
    stamp.write_text(str(weights.stat().st_mtime_ns))
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(model_dir: Path, port: int, cache_bytes: int | None = None) -> list[str]:
    # temp 0 is greedy, as mtplx's default for these comparisons; one decode at a time, like mtplx.
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port),
           "--temp", "0", "--log-level", "WARNING", "--decode-concurrency", "1", "--prompt-concurrency", "1"]
    if cache_bytes is not None:
        cmd += ["--prompt-cache-bytes", str(cache_bytes)]
    return cmd


@contextlib.contextmanager
def mlx_lm_server(model: str, cache_bytes: int | None = None, timeout: float = 120, model_dir: Path | None = None,
                  env: dict | None = None):
    """Start a fresh mlx_lm.server on a free port (on `model_dir`, default the trunk copy, with
    `env` added to this process's environment); yield its base URL; stop it."""
    port = free_port()
    proc = subprocess.Popen(command(model_dir or trunk_copy(model), port, cache_bytes), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited: {proc.stderr.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("mlx_lm.server did not come up")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--prompt-cache-bytes", type=int)
    args = parser.parse_args()
    cmd = command(trunk_copy(args.model), args.port, args.prompt_cache_bytes)
    print(" ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
