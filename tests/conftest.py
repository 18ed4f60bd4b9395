"""Shared fixtures: a temporary MTPLX_HOME for every test, and the embedded models loaded once."""

from __future__ import annotations

import pytest

import mtplx  # noqa: F401  -- loads the CPU fast path's BLAS before any test module imports MLX


@pytest.fixture(autouse=True)
def mtplx_home(tmp_path, monkeypatch):
    home = tmp_path / "mtplx-home"
    monkeypatch.setenv("MTPLX_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from mtplx.catalog import resolve

    return AutoTokenizer.from_pretrained(str(resolve("tiny-dense")))


def _engine(name, **config):
    from mtplx.catalog import resolve
    from mtplx.engine.engine import Engine, EngineConfig

    return Engine(resolve(name), EngineConfig(**config), name=name).start()


@pytest.fixture(scope="session")
def dense_engine():
    engine = _engine("tiny-dense", chunk_size=64)
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def hybrid_engine():
    engine = _engine("tiny-hybrid", chunk_size=64)
    yield engine
    engine.stop()


@pytest.fixture(scope="session", params=["tiny-dense", "tiny-hybrid"])
def engine(request, dense_engine, hybrid_engine):
    return dense_engine if request.param == "tiny-dense" else hybrid_engine


def _served(**engine_args):
    """A server of its own (engine and app) on tiny-dense, for one module's HTTP tests."""
    from mtplx.catalog import resolve
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.server.app import create_app
    from mtplx.server.background import BackgroundServer

    engine = Engine(resolve("tiny-dense"), EngineConfig(chunk_size=64), name="tiny-dense", **engine_args).start()
    served = BackgroundServer(create_app(engine, "tiny-dense")).start()
    yield served.url
    served.stop()
    engine.stop()


@pytest.fixture(scope="module")
def tiny_dense_url():
    yield from _served()


@pytest.fixture(scope="module")
def tiny_dense_bank_url():
    """The same with a session bank (in RAM; the SSD tier is its own option)."""
    from mtplx.bank.bank import BankConfig

    yield from _served(bank=BankConfig())


def pytest_sessionfinish(session, exitstatus):
    # MLX streams made on this thread must be destroyed before interpreter teardown.
    import sys

    if "mlx.core" in sys.modules:
        sys.modules["mlx.core"].clear_streams()
