"""The core never imports the UI, CLI or HTTP frameworks, and `mtplx --help` never imports MLX."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CORE = ["mtplx.engine.engine", "mtplx.engine.generation", "mtplx.engine.speculation", "mtplx.chat",
        "mtplx.events", "mtplx.catalog", "mtplx.synth.agent"]
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


def test_help_imports_no_mlx():
    code = ("import sys\nfrom mtplx.cli import app\nsys.argv=['mtplx','--help']\n"
            "try:\n    app()\nexcept SystemExit:\n    pass")
    loaded = _modules_after(code)
    assert "mlx" not in {m.split(".")[0] for m in loaded}
    assert "mlx_lm" not in {m.split(".")[0] for m in loaded}
