"""The core never imports the UI, CLI or HTTP frameworks, the layers point one way
(state <- bank <- engine: no bank module imports the engine), and `mtplx --help` never imports MLX."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CORE = ["mtplx.engine.engine", "mtplx.engine.generation", "mtplx.engine.speculation", "mtplx.engine.bank_executor",
        "mtplx.bank.bank", "mtplx.receipts.writer", "mtplx.replay.run", "mtplx.chat",
        "mtplx.events", "mtplx.catalog", "mtplx.synth.agent", "mtplx.distributed.lockstep",
        "mtplx.distributed.launch"]
FRAMEWORKS = ["textual", "typer", "fastapi", "starlette", "uvicorn"]


def _modules_after(code: str) -> set[str]:
    # An explicit working directory: transformers resolves a relative path at import, which fails
    # if the inherited one no longer exists (seen once in CI).
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, f"the import itself failed:\n{out.stderr[-3000:]}"
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_core_imports_no_framework():
    loaded = _modules_after("\n".join(f"import {m}" for m in CORE))
    assert not {m for m in loaded if m.split(".")[0] in FRAMEWORKS}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (lazy imports count too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _files(*parts: str) -> list[Path]:
    files = []
    for part in parts:
        path = ROOT / part
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def _violations(files: list[Path], forbidden: list[str]) -> list[str]:
    return [f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f} imports {m}" for f in files for m in sorted(_imports(f))
            if any(m == p or m.startswith(p + ".") for p in forbidden)]


# (what, the files, the packages they must never import)
LAYERS = [
    ("the bank plans and stores; the engine runs it", ["mtplx/bank"], ["mtplx.engine"]),
    ("shared state imports neither side", ["mtplx/state"], ["mtplx.engine", "mtplx.bank"]),
    ("the core never imports a framework or an edge",
     ["mtplx/engine", "mtplx/bank", "mtplx/state", "mtplx/receipts", "mtplx/replay", "mtplx/events.py",
      "mtplx/chat.py", "mtplx/reply_stream.py", "mtplx/tool_formats.py"],
     FRAMEWORKS + ["tui", "mtplx.server", "mtplx.cli"]),
]


@pytest.mark.parametrize("rule, parts, forbidden", LAYERS, ids=[rule for rule, _, _ in LAYERS])
def test_layering_contract(rule, parts, forbidden):
    files = _files(*parts)
    assert files, f"no files under {parts}"
    assert _violations(files, forbidden) == []


def test_layering_contract_sees_lazy_imports(tmp_path):
    """The scan is not vacuous: an import inside a function, or of a submodule, is a violation;
    a module that merely shares the prefix is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("import mtplx.engineering\ndef f():\n    from mtplx.engine.generation import Generation\n")
    assert _violations([probe], ["mtplx.engine"]) == [f"{probe} imports mtplx.engine.generation",
                                                      f"{probe} imports mtplx.engine.generation.Generation"]


def test_help_imports_no_mlx():
    code = ("import sys\nfrom mtplx.cli import app\nsys.argv=['mtplx','--help']\n"
            "try:\n    app()\nexcept SystemExit:\n    pass")
    loaded = _modules_after(code)
    assert "mlx" not in {m.split(".")[0] for m in loaded}
    assert "mlx_lm" not in {m.split(".")[0] for m in loaded}
