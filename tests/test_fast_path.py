"""The CPU fast path: which path a process gets, what it reports, and the one notice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtplx import fast_path, native_build, small_gemm

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **env) -> dict:
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **env}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_off_means_reference_blas_and_weights_as_stored(monkeypatch):
    monkeypatch.setenv(fast_path.ENV, "off")
    assert not fast_path.wanted()
    assert not fast_path.use_fp32(True, 1)
    if sys.platform == "linux":
        assert fast_path._unavailable() == "MTPLX_FAST_PATH=off" and "reference" in fast_path.predicted()


def test_other_arches_fall_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(fast_path.sys, "platform", "linux")
    monkeypatch.setattr(fast_path.platform, "machine", lambda: "aarch64")
    assert fast_path._unavailable() == "no MKL wheel for aarch64"
    assert fast_path.predicted() == "cpu fp32 reference blas"
    blas = fast_path.Blas("reference", reason="no MKL wheel for aarch64")
    assert "aarch64" in fast_path.notice(blas) and fast_path.ENV in fast_path.notice(blas)
    assert fast_path.notice(fast_path.Blas("mkl", library="x")) is None


def test_labels_and_memory_guard():
    assert fast_path.label(True, "fp32", fast_path.Blas("mkl")) == "cpu fp32 + mkl"
    assert fast_path.label(True, "bf16", fast_path.Blas("reference")) == "cpu bf16 reference blas"
    assert not fast_path.use_fp32(False, 1)  # Metal keeps the stored dtype
    assert not fast_path.use_fp32(True, 1 << 60)  # an fp32 copy larger than half of RAM stays as stored
    with pytest.raises(ValueError):
        fast_path.Blas("openblas")


@pytest.mark.skipif(fast_path._unavailable() is not None, reason="no MKL here")
def test_a_loaded_model_reports_and_uses_the_fast_path():
    code = ("import json, mtplx, mlx.core as mx\nfrom mtplx.catalog import resolve\n"
            "from mtplx.engine.checkpoint import load_checkpoint, model_identity\n"
            "ck = load_checkpoint(resolve('tiny-dense'))\nmx.eval(ck.model(mx.array([[1, 2, 3, 4]])))\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(json.dumps({'compute': ck.extras['compute'], 'mkl_mapped': 'libmkl_core' in maps,\n"
            "  'dtype': str(ck.model.model.embed_tokens.weight.dtype), 'salted': ck.identity != model_identity(ck.path)}))")
    fast = _run(code)
    # libmkl_core is mapped only once MKL served a call: the model's matmuls reached it.
    kernel = f" + {small_gemm.name()}" if small_gemm.unavailable() is None else ""
    kernel += " + attention kernel" if native_build.attention_unavailable() is None else ""
    kernel += " + vector silu" if fast_path.vector_silu_wanted() else ""
    assert fast == {"compute": "cpu fp32 + mkl" + kernel, "mkl_mapped": True, "dtype": "mlx.core.float32", "salted": True}
    off = _run(code, MTPLX_FAST_PATH="off")
    assert off == {"compute": "cpu bf16 reference blas", "mkl_mapped": False, "dtype": "mlx.core.bfloat16", "salted": False}


def test_mlx_imported_first_keeps_the_reference_blas_and_says_why():
    blas = _run("import mlx.core, json\nfrom mtplx import fast_path\nprint(json.dumps(fast_path.activate().__dict__))")
    if sys.platform == "linux":
        assert blas["kind"] == "reference" and "imported before" in blas["reason"]


BITWISE = ["tests/test_mtp_exactness.py::test_rollback_equals_feeding_only_kept_tokens",
           "tests/test_bank_restore.py::test_restored_prefill_logits_are_bit_identical",
           "tests/test_compiled_steps.py::test_compiled_steps_equal_mlx_lm_forward",
           "tests/test_gdn_prefill.py::test_checkpoints_inside_one_forward_equal_forwards_that_end_there[False]"]


@pytest.mark.skipif(fast_path.rows_bitwise(fast_path.activate()), reason="this process already runs them bitwise")
def test_the_reference_path_stays_bit_exact():
    """This process runs on MKL, where those tests compare to fp32 rounding; on the reference path
    (MTPLX_FAST_PATH=off: weights as stored, reference BLAS) they must hold bit for bit."""
    import os

    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *BITWISE], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, fast_path.ENV: "off"}, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]


def test_models_and_health_report_the_compute_path(dense_engine):
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from mtplx.cli import app
    from mtplx.server.app import create_app

    rows = json.loads(CliRunner().invoke(app, ["models", "--json"]).stdout)
    assert rows and all(r["compute"] == fast_path.predicted() for r in rows)
    health = TestClient(create_app(dense_engine, "tiny-dense")).get("/health").json()
    assert health["compute"] == dense_engine.checkpoint.extras["compute"]
    if sys.platform == "linux" and fast_path.activate().kind == "mkl":
        assert health["compute"].startswith("cpu fp32 + mkl") and health["compute"] == fast_path.predicted()
