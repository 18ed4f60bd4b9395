"""Real agent CLIs against a fresh `mtplx serve`, each with its default settings (only base URL,
API key and model name configured), two non-interactive turns each, the second continuing the
first's session. Prints one row per client: version, requests, statuses, cached tokens per
later turn against the bank's reuse ceiling, errors. Not part of CI (slow; needs npm).

    python bench/agents.py [--clients claude,codex,opencode,pi,qwen] [--context-window 65536]
                           [--cache ~/.cache/mtplx-agents] [--record DIR] [--model NAME_OR_DIR] [--ssd] [--together]
                           [--keep]

--together runs every client against one server, each turn started by all of them at once (the
scheduler batches their decodes; the bank keeps each one's session): one row for all.

The CLIs are installed from npm into --cache. Every client runs in a scratch git repository and
a scratch HOME, pointed at 127.0.0.1 only. --record keeps each request (MTPLX_RECORD_DIR) per
client, the material of tests/fixtures/clients/. A row with errors (or every row, with --keep)
names its scratch directory, where mtplx/serve.log holds the server's stderr and
mtplx/events.jsonl the engine's restores, finishes and bank decisions (what explains a later
turn's shortfall, also listed in the row); the others' scratch is removed (with --ssd its bank
alone is ~0.7 GB).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

PACKAGES = {"opencode": "opencode-ai", "pi": "@mariozechner/pi-coding-agent", "claude": "@anthropic-ai/claude-code",
            "qwen": "@qwen-code/qwen-code", "codex": "@openai/codex"}
TURNS = ("What does app.py do? Answer in one sentence.", "Now suggest one improvement to it.")
MODEL = "tiny-dense"  # the model id the clients send: the served model's name
SERVED = MODEL  # what `mtplx serve -m` loads (--model)
SSD = False  # the bank's SSD tier (--ssd; off by default here: each client starts from a fresh home anyway)


def install(cache: Path) -> dict[str, str]:
    bin_dir = cache / "node_modules" / ".bin"
    missing = [pkg for name, pkg in PACKAGES.items() if not (bin_dir / name).exists()]
    if missing:
        subprocess.run(["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund", *missing], check=True)
    versions = {}
    for name, pkg in PACKAGES.items():  # the installed package's own record (some CLIs print no newline)
        versions[name] = json.loads((cache / "node_modules" / pkg / "package.json").read_text())["version"]
    return versions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scratch_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True)
    (repo / "app.py").write_text("def main():\n    print('hello')\n\n\nif __name__ == '__main__':\n    main()\n")
    git = ["git", "-C", str(repo), "-c", "user.email=bench@mtplx", "-c", "user.name=bench"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    return repo


def client_setup(name: str, home: Path, url: str) -> tuple[dict, list[list[str]]]:
    """Environment and the two turns' argv: only base URL, key and model are configured."""
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share")}
    v1 = url + "/v1"
    if name == "claude":
        env |= {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "x"}
        return env, [["claude", "-p", TURNS[0], "--model", MODEL], ["claude", "-c", "-p", TURNS[1], "--model", MODEL]]
    if name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True)
        (codex_home / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "mtplx"\n\n[model_providers.mtplx]\nname = "mtplx"\n'
            f'base_url = "{v1}"\nenv_key = "MTPLX_KEY"\nwire_api = "responses"\n')
        env |= {"CODEX_HOME": str(codex_home), "MTPLX_KEY": "x"}
        return env, [["codex", "exec", "--skip-git-repo-check", TURNS[0]],
                     ["codex", "exec", "--skip-git-repo-check", "resume", "--last", TURNS[1]]]
    if name == "qwen":
        env |= {"OPENAI_BASE_URL": v1, "OPENAI_API_KEY": "x", "OPENAI_MODEL": MODEL}
        return env, [["qwen", TURNS[0]], ["qwen", "-c", TURNS[1]]]
    if name == "pi":
        agent = home / ".pi" / "agent"
        agent.mkdir(parents=True)
        (agent / "models.json").write_text(json.dumps({"providers": {"mtplx": {
            "baseUrl": v1, "api": "openai-completions", "apiKey": "x", "models": [{"id": MODEL}]}}}))
        return env, [["pi", "--provider", "mtplx", "--model", MODEL, "-p", TURNS[0]],
                     ["pi", "--provider", "mtplx", "--model", MODEL, "-c", "-p", TURNS[1]]]
    if name == "opencode":
        config = home / ".config" / "opencode"
        config.mkdir(parents=True)
        (config / "opencode.json").write_text(json.dumps({"$schema": "https://opencode.ai/config.json", "provider": {"mtplx": {
            "npm": "@ai-sdk/openai-compatible", "name": "mtplx", "options": {"baseURL": v1, "apiKey": "x"},
            "models": {MODEL: {"name": MODEL}}}}}))
        model = f"mtplx/{MODEL}"
        return env, [["opencode", "run", "-m", model, TURNS[0]], ["opencode", "run", "-c", "-m", model, TURNS[1]]]
    raise SystemExit(f"unknown client {name}")


def serve(port: int, home: Path, window: int, record: Path | None) -> subprocess.Popen:
    """The server's stderr goes to MTPLX_HOME/serve.log (warnings such as a failed render-ahead)."""
    env = dict(os.environ, MTPLX_HOME=str(home))
    home.mkdir(parents=True, exist_ok=True)
    if record:
        env["MTPLX_RECORD_DIR"] = str(record)
    proc = subprocess.Popen([sys.executable, "-m", "mtplx.cli", "serve", "--port", str(port), "--context-window", str(window),
                             *([] if SSD else ["--no-ssd"]), "-m", SERVED], env=env, stderr=(home / "serve.log").open("ab"), stdout=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("mtplx serve did not start")


def watch(port: int, out: Path):
    """The engine's events (bank decisions, restores, finishes) as JSON lines in `out`: what to
    read when a later turn misses its ceiling. Returns the call that stops watching (an open
    event stream would hold the server's graceful shutdown)."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("GET", "/v1/mtplx/events")
    sock, stream = conn.sock, conn.getresponse()  # the response may take the socket over

    def follow():
        try:
            with out.open("a") as log:
                name = None
                for line in stream:
                    line = line.decode().rstrip("\n")
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: ") and name in ("Restored", "Finished", "BankDecision"):
                        log.write(json.dumps({"event": name, **json.loads(line[6:])}) + "\n")
                        log.flush()
        except (OSError, ValueError, http.client.HTTPException):
            return

    threading.Thread(target=follow, daemon=True).start()
    return lambda: sock.shutdown(socket.SHUT_RDWR)


def statuses(url: str) -> dict[str, int]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out = {}
    for route, status, n in re.findall(r'mtplx_requests_total\{route="([^"]+)",status="(\d+)"\} (\d+)', text):
        if route.startswith("/v1/") and route != "/v1/models":
            out[status] = out.get(status, 0) + int(n)
    return out


def receipts(home: Path) -> list[dict]:
    db = home / "receipts.db"
    if not db.exists():
        return []
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    rows = [dict(r) for r in con.execute("select session, prompt_tokens, ceiling, cached_tokens, shortfall, created_utc from receipts "
                                          "where source = 'api' order by created_utc")]
    con.close()
    return rows


def run_clients(names: list[str], versions: dict, cache: Path, window: int, timeout: float, record: Path | None,
                keep: bool = False) -> dict:
    """The clients' two turns against one fresh server: alone (one name), or together (each turn
    of every client started at once, as agents and their subagents share one local server). The
    row's counts and turn-2 figures are over all of them."""
    label = names[0] if len(names) == 1 else "+".join(names)
    root = Path(tempfile.mkdtemp(prefix=f"mtplx-agent-{label}-"))
    mtplx_home = root / "mtplx"
    port = free_port()
    server = serve(port, mtplx_home, window, record / label if record else None)
    url = f"http://127.0.0.1:{port}"
    unwatch = watch(port, mtplx_home / "events.jsonl")
    path = f"{cache / 'node_modules' / '.bin'}{os.pathsep}{os.environ['PATH']}"
    setups = {}
    for name in names:
        base = root if len(names) == 1 else root / name
        (base / "home").mkdir(parents=True)
        env, turns = client_setup(name, base / "home", url)
        setups[name] = (scratch_repo(base), dict(os.environ, **env, PATH=path), turns)
    errors, turn_rows = [], []

    def turn(name: str, i: int) -> None:
        repo, env, turns = setups[name]
        who = "" if len(names) == 1 else f"{name} "
        try:
            done = subprocess.run(turns[i], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
            if done.returncode:
                errors.append(f"{who}turn {i + 1} exit {done.returncode}: {(done.stderr or done.stdout).strip()[-160:]}")
        except subprocess.TimeoutExpired:
            errors.append(f"{who}turn {i + 1} timed out after {timeout:.0f}s")

    try:
        for i in range(len(TURNS)):
            before = len(receipts(mtplx_home))
            threads = [threading.Thread(target=turn, args=(name, i)) for name in names]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            turn_rows.append(receipts(mtplx_home)[before:])
        codes = statuses(url)
    finally:
        unwatch()
        server.terminate()
        server.wait(30)
    if not errors and not keep:  # a row with errors keeps its scratch to look into; the bank alone is ~0.7 GB
        shutil.rmtree(root, ignore_errors=True)
    later = [r for rows in turn_rows[1:] for r in rows]
    cached, ceiling = sum(r["cached_tokens"] or 0 for r in later), sum(r["ceiling"] or 0 for r in later)
    return {"client": label, "version": "+".join(versions[n] for n in names), "requests": sum(codes.values()),
            "statuses": codes, "turn2": f"{cached}/{ceiling}" + (f" ({cached / ceiling:.3f})" if ceiling else ""),
            "turn2_requests": len(later), "shortfalls": [r["shortfall"] for r in later if r["shortfall"]],
            "scratch": str(root) if root.exists() else "(removed)", "errors": errors}


def main() -> None:
    global MODEL, SERVED, SSD
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default=",".join(PACKAGES))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "mtplx-agents")
    parser.add_argument("--context-window", type=int, default=65536)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per turn")
    parser.add_argument("--record", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep every row's scratch directory (rows with errors keep theirs anyway)")
    parser.add_argument("--model", default=MODEL,
                        help="what the server loads: an embedded name or a model directory (e.g. a 4-bit `mtplx convert` output)")
    parser.add_argument("--ssd", action="store_true", help="serve with the bank's SSD tier on, as `mtplx serve` defaults to")
    parser.add_argument("--together", action="store_true",
                        help="one server for all the clients, each turn started by every client at once")
    args = parser.parse_args()
    SSD = args.ssd
    SERVED = args.model
    MODEL = Path(args.model).name if Path(args.model).is_dir() else args.model  # the name `mtplx serve` gives it
    versions = install(args.cache)
    names = args.clients.split(",")
    rows = []
    for group in ([names] if args.together else [[n] for n in names]):
        rows.append(run_clients(group, versions, args.cache, args.context_window, args.timeout, args.record,
                                args.keep))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'client':<9} {'version':<9} {'requests':>8}  {'statuses':<16} {'turn 2 cached/ceiling':<24} errors")
    for r in rows:
        codes = " ".join(f"{k}x{v}" for k, v in sorted(r["statuses"].items()))
        print(f"{r['client']:<9} {r['version']:<9} {r['requests']:>8}  {codes:<16} {r['turn2']:<24} {'; '.join(r['errors']) or '-'}")


if __name__ == "__main__":
    main()
