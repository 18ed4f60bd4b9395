"""A replay session as the CLI runs it: arms in balanced order, receipts written per run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from mtplx.errors import MtplxError
from mtplx.replay.run import compare, replay, write_receipt
from mtplx.replay.transcript import load


def arm_order(arms: list[str], pairs: int) -> list[str]:
    """Balanced: AB, BA, AB, ... so drift over time hits both arms alike."""
    if len(arms) < 2:
        return (arms or [""]) * pairs
    if len(arms) != 2:
        raise MtplxError("give one or two --arm settings")
    return [a for i in range(pairs) for a in (arms if i % 2 == 0 else arms[::-1])]


def run_replay(path: Path, base_url: str | None, model: str, arms: list[str], pairs: int, out: Path | None,
               echo: Callable[[str], None] = print, pause_s: float = 0.0) -> list[Path]:
    from transformers import AutoTokenizer

    from mtplx.catalog import resolve
    from mtplx.home import home_path
    from mtplx.receipts.store import ReceiptStore

    transcript = load(path)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve(model)))
    if base_url and arms:
        raise MtplxError("--arm runs in-process; it cannot be combined with --base-url")
    store, written = ReceiptStore(), []
    for k, arm in enumerate(arm_order(arms, pairs)):
        run_id = f"{transcript.name}-{os.urandom(3).hex()}"
        echo(f"== run {run_id}" + (f" arm {arm}" if arm else "") + (f" against {base_url}" if base_url else " in-process"))
        engine = server = None
        try:
            url = base_url
            if url is None:
                from mtplx.launch import serve_in_process

                from mtplx.receipts.writer import ReceiptWriter

                engine, server = serve_in_process(model, arm)
                # the server's rows carry the bank's side (restore source, anchor, tau, acceptance,
                # speed); replay() completes each with the run's fields: one row per turn
                engine.listeners.append(ReceiptWriter(store, model, engine.checkpoint.identity))
                url = server.url
            receipt = replay(transcript, url, run_id=run_id, arm=arm or None, tokenizer=tokenizer, model=model,
                             store=store, echo=echo, pause_s=pause_s)
        finally:
            if server is not None:
                server.stop()
            if engine is not None:
                engine.stop()
        target = out if out is not None and k == 0 else (out.with_name(f"{out.stem}-{k}{out.suffix}") if out else
                                                           home_path("replays", f"{run_id}.json"))
        write_receipt(target, receipt)
        written.append(target)
    return written


def compare_files(a: Path, b: Path) -> tuple[str, bool]:
    try:
        ra, rb = (json.loads(p.read_text()) for p in (a, b))
    except (OSError, json.JSONDecodeError) as exc:
        raise MtplxError(f"cannot read receipt: {exc}") from exc
    return compare(ra, rb)
