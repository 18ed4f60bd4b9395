"""Building a running engine from what a user types: a model name or path and decoding flags.

Decoding defaults come, in order, from the flags, from `mtplx tune`'s stored result for this
exact model identity, and from the built-in default (MTP at depth 2 when the model has a head).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mtplx.catalog import resolve
from mtplx.engine.checkpoint import model_identity, read_config
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.fast_path import activate, notice, predicted
from mtplx.settings import tuned_default

# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms), in the
# processes a user runs (serve, tui, generate). The engine thread builds MLX graphs in Python almost
# without pause while it decodes (an MTP round's draft chain and verify are built while the device
# computes the last), so the thread that streams its output (the server's event loop with an SSE
# delta to send, the TUI) waited up to the whole interval for the GIL, and the engine as long
# behind it. Through `mtplx serve` 0.5 ms measured better (bench/serve_ab.py: tiny-dense's
# client-side MTP/AR 1.45 -> 1.60 and 1.46 -> 1.56; four streams at once 1.03x). An engine alone
# in a process (the benches, the tests) keeps Python's default: with its events read by a plain
# thread, four sessions at once ran 5-18% slower at 0.5 ms in three in-process A/B runs.
SWITCH_INTERVAL_ENV = "MTPLX_SWITCH_INTERVAL_US"
SWITCH_INTERVAL_S = 0.0005


def switch_interval() -> float:
    """The GIL switch interval open_engine sets (seconds): MTPLX_SWITCH_INTERVAL_US, else 500 us."""
    try:
        value = float(os.environ[SWITCH_INTERVAL_ENV]) / 1e6
    except (KeyError, ValueError):
        return SWITCH_INTERVAL_S
    return min(max(value, 1e-6), 1.0) if value == value else SWITCH_INTERVAL_S  # NaN: the default


def engine_config(model_path, depth: int | None, no_mtp: bool, chunk_size: int = 256,
                  context_window: int | None = None, max_batch: int | None = None,
                  prefill_share: float | None = None) -> EngineConfig:
    # `mtplx tune` stores under the loaded checkpoint's identity, which names an fp32 cast,
    # whether quantized layers were unpacked and the SiLU (compute.ComputePath.salt). A tune
    # stored before the vector SiLU existed still gives the defaults, after one made with it.
    quantized = "quantization" in read_config(Path(model_path))
    compute = predicted()
    salts = (("fp32-unpacked",) if quantized else ()) + ("fp32", "") if compute.startswith("cpu fp32") else ("",)
    if " + vector silu" in compute:
        salts = tuple(s + "+silu" for s in salts) + salts
    tuned = next((found for salt in salts if (found := tuned_default(model_identity(model_path, salt)))), None) or {}
    use_mtp = False if no_mtp else tuned.get("mtp", True) if depth is None else True
    return EngineConfig(chunk_size=chunk_size, use_mtp=use_mtp, depth=depth or tuned.get("depth", 2),
                        context_window=context_window,
                        **({"max_batch": max_batch} if max_batch is not None else {}),
                        **({"prefill_share": prefill_share} if prefill_share is not None else {}))


def open_engine(model: str, depth: int | None = None, no_mtp: bool = False, bank: bool = True,
                receipts: bool = True, ssd: bool = True, bank_ram: int | None = None,
                bank_ssd: int | None = None, context_window: int | None = None,
                max_batch: int | None = None, prefill_share: float | None = None, group=None) -> Engine:
    """A started engine; with a session bank unless bank=False (RAM budget `bank_ram` bytes, else a
    quarter of free memory), persisted under $MTPLX_HOME/bank unless ssd=False (disk budget
    `bank_ssd` bytes, else a tenth of the free disk up to 20 GiB), and every turn written to the
    receipt store unless receipts=False. `group`: this process is one rank of a sharded run
    (mtplx/distributed); the engine then runs in lockstep with the other ranks."""
    from mtplx.bank.bank import BankConfig
    from mtplx.bank.ssd import SsdConfig

    sys.setswitchinterval(switch_interval())  # this process streams the engine's output: see above
    path = resolve(model)
    bank_config = (BankConfig(budget_bytes=bank_ram) if bank_ram else BankConfig()) if bank else None
    config = engine_config(path, depth, no_mtp, context_window=context_window, max_batch=max_batch,
                           prefill_share=prefill_share)
    ssd_config = SsdConfig.default(budget_bytes=bank_ssd) if bank and ssd else None
    name = model if "/" not in model else None
    if group is not None:
        from mtplx.distributed.lockstep import RankEngine

        engine = RankEngine(path, group, config, name=name, bank=bank_config, ssd=ssd_config).start()
    else:
        engine = Engine(path, config, name=name, bank=bank_config, ssd=ssd_config).start()
    if (line := notice(activate())) is not None:  # the one notice when the CPU fast path is missing
        print(line, file=sys.stderr)
    fit_helper(engine)
    if receipts:
        from mtplx.receipts.store import ReceiptStore
        from mtplx.receipts.writer import WAIT_S, ReceiptWriter

        engine.listeners.append(ReceiptWriter(ReceiptStore(busy_s=WAIT_S), model, engine.checkpoint.identity))
    return engine


def fit_helper(engine: Engine) -> bool | None:
    """The small-row kernel's helper thread in this process only where the model's step is big
    enough to pay for it beside the server's and the client's threads (small_gemm.fit_helper).
    Returns whether it is on (None: no kernel here)."""
    from mtplx import fast_path, small_gemm

    if fast_path.KERNEL is None or getattr(engine, "runner", None) is None:
        return None
    return small_gemm.fit_helper(fast_path.KERNEL, engine.runner.step_macs())


ARM_WORDS = {"bank": ("bank", True), "no-bank": ("bank", False), "mtp": ("mtp", True), "no-mtp": ("mtp", False),
             "render-ahead": ("render_ahead", True), "no-render-ahead": ("render_ahead", False)}


def parse_arm(spec: str) -> dict:
    """'bank+mtp+depth=3' -> settings; unknown words are an error naming them."""
    from mtplx.errors import MtplxError

    settings = {"bank": True, "mtp": True, "depth": None, "render_ahead": True}
    for word in filter(None, spec.split("+")):
        if word.startswith("depth="):
            settings["depth"] = int(word.split("=", 1)[1])
        elif word in ARM_WORDS:
            key, value = ARM_WORDS[word]
            settings[key] = value
        else:
            raise MtplxError(f"unknown arm setting {word!r} (use {', '.join(ARM_WORDS)}, depth=N)")
    return settings


def serve_in_process(model: str, arm: str = ""):
    """A fresh engine (and bank) for one replay arm, served on a free loopback port."""
    from mtplx.bank.bank import BankConfig
    from mtplx.server.app import create_app
    from mtplx.server.background import BackgroundServer

    settings = parse_arm(arm)
    path = resolve(model)
    config = engine_config(path, settings["depth"], not settings["mtp"])
    bank = BankConfig(render_ahead=settings["render_ahead"]) if settings["bank"] else None
    engine = Engine(path, config, name=model, bank=bank).start()
    return engine, BackgroundServer(create_app(engine, model)).start()
