"""The SSD tier: restores after a restart, and never serves a damaged file."""

from __future__ import annotations

import json
import sqlite3

import pytest

from mtplx.bank.bank import BankConfig
from mtplx.bank.ssd import SsdConfig
from mtplx.catalog import resolve
from mtplx.chat import render
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.synth.agent import Sizes, conversation
from mtplx.synth.corpus import Corpus

MODEL = "tiny-hybrid"  # recurrent state is the hard part to persist


def engine_on(root, bank=True):
    return Engine(resolve(MODEL), EngineConfig(chunk_size=64), name=MODEL,
                  bank=BankConfig() if bank else None,
                  ssd=SsdConfig(root, budget_bytes=64 << 20, free_floor_bytes=0) if bank else None).start()


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve(MODEL)))
    convo = conversation(515, Corpus(), Sizes(20, 40), max_user_turns=1)
    first = render(tok, convo["messages"][:2], convo["tools"])
    second = render(tok, convo["messages"][:4], convo["tools"])  # a later turn over the same base
    return tuple(first), tuple(second)


def run(engine, prompt):
    return engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=16), session="s")).result()


@pytest.fixture(scope="module")
def cold_output(prompts):
    engine = engine_on(None, bank=False)
    try:
        return run(engine, prompts[1]).token_ids
    finally:
        engine.stop()


def test_restart_restores_from_ssd(tmp_path, prompts, cold_output):
    first = engine_on(tmp_path)
    run(first, prompts[0])
    first.stop()  # clean shutdown flushes pending writes
    assert list(tmp_path.glob("*.safetensors"))
    second = engine_on(tmp_path)
    try:
        restored = []
        second.listeners.append(lambda e: restored.append(e) if type(e).__name__ == "Restored" else None)
        fin = run(second, prompts[1])
        assert fin.cached_tokens > 0 and restored[-1].source == "ssd"
        assert fin.token_ids == cold_output
    finally:
        second.stop()


def _corrupt(root, how):
    (path,) = sorted(root.glob("*.safetensors"))[:1]
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        db = sqlite3.connect(str(root / "manifest.db"))
        column, value = ("version", 99) if how == "bumped_version" else ("identity", "another-model:mtp")
        db.execute(f"update entries set {column} = ?", (value,))
        db.commit()
        db.close()
        if how == "bumped_version":  # the header is what load checks: rewrite it with a new version
            import mlx.core as mx

            arrays, meta = mx.load(str(path), return_metadata=True)
            mx.save_safetensors(str(path), arrays, metadata=dict(meta, format_version="99"))
            from mtplx.bank.ssd import _sha256

            db = sqlite3.connect(str(root / "manifest.db"))
            db.execute("update entries set checksum = ?", (_sha256(path),))
            db.commit()
            db.close()
    return path


@pytest.mark.parametrize("how", ["truncated", "flipped", "empty", "bumped_version", "wrong_model"])
def test_damaged_files_are_discarded_and_computed_cold(tmp_path, prompts, cold_output, how):
    first = engine_on(tmp_path)
    run(first, prompts[0])
    first.stop()
    for extra in sorted(tmp_path.glob("*.safetensors"))[1:]:  # keep one entry: the damaged one
        extra.unlink()
    first_file = _corrupt(tmp_path, how)
    second = engine_on(tmp_path)
    try:
        fin = run(second, prompts[1])
        assert fin.cached_tokens == 0 and fin.token_ids == cold_output
        assert not first_file.exists()  # found invalid at open or at load, and removed
        assert second.submit(GenerationRequest(prompts[0], SamplingParams(max_tokens=4))).result().completion_tokens == 4
    finally:
        second.stop()
    assert not list(tmp_path.glob(".tmp-*"))


def test_entries_evicted_from_ram_restore_from_ssd(tmp_path, prompts, cold_output):
    engine = Engine(resolve(MODEL), EngineConfig(chunk_size=64), name=MODEL, bank=BankConfig(budget_bytes=1),
                    ssd=SsdConfig(tmp_path, budget_bytes=64 << 20, free_floor_bytes=0)).start()
    try:
        decisions = []
        engine.listeners.append(lambda e: decisions.append(e) if type(e).__name__ == "BankDecision" else None)
        run(engine, prompts[0])
        engine.settle()
        run(engine, tuple(range(40, 140)))  # another entry pushes the first out of RAM
        engine.settle()
        assert any(d.action == "evicted" and "still on SSD" in d.detail for d in decisions)
        fin = run(engine, prompts[1])
        assert fin.cached_tokens > 0 and fin.token_ids == cold_output
        assert not [d for d in decisions if d.action in ("discarded", "ssd_failed")]
    finally:
        engine.stop()


def test_a_request_never_waits_for_an_ssd_file_write(tmp_path, prompts, monkeypatch):
    """The file of an entry is written on the bank's I/O thread: while it is held up, the next
    request (an agent's, sent as soon as a quick tool returns) is served; once the file is done,
    its manifest row is recorded and the entry restores after a restart."""
    import threading

    from mtplx.bank.ssd import SsdTier

    release, started = threading.Event(), threading.Event()
    write_file = SsdTier.write_file

    def held(self, staged):
        started.set()
        assert release.wait(60)
        return write_file(self, staged)

    monkeypatch.setattr(SsdTier, "write_file", held)
    engine = engine_on(tmp_path)
    try:
        run(engine, prompts[0])
        assert started.wait(30)  # the turn's entry is being written
        assert run(engine, tuple(range(40, 90))).completion_tokens == 16  # served meanwhile
        assert not list(tmp_path.glob("*.safetensors"))  # the held write has not finished
        assert engine.call(lambda: engine.bank.health()["pending_writes"]) >= 1  # the engine thread answers too
        release.set()
        engine.settle()  # idle work includes the write in flight
        assert engine.call(lambda: engine.bank.health()["pending_writes"]) == 0
    finally:
        release.set()
        engine.stop()
    rows = sqlite3.connect(str(tmp_path / "manifest.db")).execute("select count(*) from entries").fetchone()[0]
    assert rows == len(list(tmp_path.glob("*.safetensors"))) >= 2 and not list(tmp_path.glob(".tmp-*"))


def test_an_entry_superseded_while_its_file_is_written_gets_no_row(tmp_path, prompts, monkeypatch):
    import threading

    from mtplx.bank.ssd import SsdTier

    release, started = threading.Event(), threading.Event()
    write_file = SsdTier.write_file
    first_name = []

    def held(self, staged):
        if not first_name:
            first_name.append(staged.name)
            started.set()
            assert release.wait(60)
        return write_file(self, staged)

    monkeypatch.setattr(SsdTier, "write_file", held)
    # tiny-dense: an attention-only entry is superseded by any longer one it prefixes
    engine = Engine(resolve("tiny-dense"), EngineConfig(chunk_size=64), name="tiny-dense", bank=BankConfig(),
                    ssd=SsdConfig(tmp_path, budget_bytes=64 << 20, free_floor_bytes=0)).start()
    try:
        first = run(engine, prompts[0])
        assert started.wait(30)
        decisions = []
        engine.listeners.append(lambda e: decisions.append(e) if type(e).__name__ == "BankDecision" else None)
        run(engine, prompts[0] + first.token_ids + tuple(range(300, 320)))  # extends the first turn's entry
        engine.call(lambda: None)  # its commit (which supersedes the first entry) is done
        assert any(d.action == "superseded" for d in decisions), [(d.action, d.detail) for d in decisions]
        assert not (tmp_path / first_name[0]).exists()  # still held: the file is not in place yet
        release.set()
        engine.settle()
    finally:
        release.set()
        engine.stop()
    assert not (tmp_path / first_name[0]).exists()
    files = {p.name for p in tmp_path.glob("*.safetensors")}
    rows = {r[0] for r in sqlite3.connect(str(tmp_path / "manifest.db")).execute("select file from entries")}
    assert files == rows and first_name[0] not in rows and rows


def test_a_nearly_full_disk_makes_room_or_skips_the_write(tmp_path, monkeypatch):
    """Before a file is written, older entries go (least recently used) so the disk keeps its
    free floor; a file that cannot fit even then is not written, and nothing is dropped for it.
    The disk works, so the tier is not degraded and nothing is retried."""
    import shutil
    import types

    from transformers import AutoTokenizer

    floor, capacity = 1 << 20, [float("inf")]

    def disk_usage(path):  # a disk of `capacity` bytes holding only the tier's files
        used = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
        return types.SimpleNamespace(total=capacity[0], used=used, free=capacity[0] - used)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    tok = AutoTokenizer.from_pretrained(str(resolve(MODEL)))
    a, b, c = (tuple(render(tok, convo["messages"][:2], convo["tools"]))
               for convo in (conversation(seed, Corpus(), Sizes(20, 40), max_user_turns=1) for seed in (11, 12, 13)))
    decisions = []
    engine = Engine(resolve(MODEL), EngineConfig(chunk_size=64), name=MODEL, bank=BankConfig(render_ahead=False),
                    ssd=SsdConfig(tmp_path, budget_bytes=64 << 20, free_floor_bytes=floor)).start()
    engine.listeners.append(lambda e: decisions.append(e) if type(e).__name__ == "BankDecision" else None)
    try:
        def stored():
            engine.settle()
            return {r[0]: r[1] for r in sqlite3.connect(str(tmp_path / "manifest.db")).execute(
                "select entry_id, nbytes from entries")}

        run(engine, a)
        (first, size), = stored().items()
        capacity[0] = floor + 1.6 * size  # b fits only where a was
        run(engine, b)
        now = stored()
        assert first not in now and len(now) == 1
        assert any(d.action == "evicted" and first in d.detail and "room" in d.detail for d in decisions)
        assert len(c) > 1.5 * len(b)  # so c's file is larger than b's
        capacity[0] = floor + sum(now.values())  # c cannot fit, not even where b is
        run(engine, c)
        assert stored() == now  # b was not dropped for a file that would not fit anyway
        health = engine.call(engine.bank.health)
        assert health["ssd"] == "ok" and health["ssd_skipped"] == 1 and health["pending_writes"] == 0
        assert [d.action for d in decisions].count("ssd_skipped") == 1
        assert not [d for d in decisions if d.action == "ssd_failed"]
        assert not list(tmp_path.glob(".tmp-*"))
    finally:
        engine.stop()
