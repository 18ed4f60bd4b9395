"""The receipt store: migrations, concurrency, and never failing a request."""

from __future__ import annotations

import sqlite3
import threading

import sqlite_utils

from mtplx.receipts.store import MIGRATIONS, ReceiptStore, migrate
from mtplx.receipts.writer import ReceiptWriter, receipt_id


def row(**kw):
    return {"id": receipt_id(), "created_utc": "2026-12-01T00:00:00.000+00:00", "source": "api", "prompt_tokens": 10, **kw}


def test_fresh_database_gets_every_migration(tmp_path):
    store = ReceiptStore(tmp_path / "r.db")
    names = [r["name"] for r in store.db["_migrations"].rows]
    assert names == [name for name, _ in MIGRATIONS]
    assert store.db.journal_mode == "wal"
    assert store.add(row(replay_run="run1", turn_index=0, reasoning_tokens=3, predicted_drafted=32, predicted_accepted=30,
                         entry_origin="shared_prompt", queued_s=0.2, rounds=40, batched_rounds=30, rows_mean=2.5,
                         others_s=0.05))


def test_old_database_is_migrated_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite_utils.Database(path)
    db["_migrations"].create({"name": str, "applied_utc": str}, pk="name")
    MIGRATIONS[0][1](db)
    db["_migrations"].insert({"name": MIGRATIONS[0][0], "applied_utc": "then"})
    db["receipts"].insert(row(id="r-old"))
    db.conn.close()
    store = ReceiptStore(path)
    assert store.get("r-old")["prompt_tokens"] == 10
    assert "replay_run" in store.db["receipts"].columns_dict and "reasoning_tokens" in store.db["receipts"].columns_dict
    assert {"predicted_drafted", "predicted_accepted"} <= set(store.db["receipts"].columns_dict)
    assert {"queued_s", "rounds", "batched_rounds", "rows_mean", "others_s"} <= set(store.db["receipts"].columns_dict)
    assert migrate(store.db) == []  # idempotent


def test_concurrent_writers(tmp_path):
    path = tmp_path / "c.db"
    stores = [ReceiptStore(path) for _ in range(4)]
    def write(store):
        for _ in range(25):
            assert store.add(row())
    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ReceiptStore(path).rows()) == 100


def test_locked_database_holds_the_row_until_it_is_free(tmp_path):
    path = tmp_path / "l.db"
    store = ReceiptStore(path)
    blocker = sqlite3.connect(str(path), isolation_level=None)
    blocker.execute("begin exclusive")
    store.db.conn.execute("pragma busy_timeout = 50")
    held = row()
    assert store.add(held) is False  # no exception, no stall past the busy timeout
    blocker.execute("rollback")
    assert store.add(row()) is True
    assert [r["id"] for r in ReceiptStore(path).rows()][0] == held["id"]  # the held row went in first


def _fill(store: ReceiptStore) -> None:
    """The database file may not grow: sqlite answers exactly as on a full disk (SQLITE_FULL)."""
    pages = store.db.execute("pragma page_count").fetchone()[0]
    store.db.execute(f"pragma max_page_count = {pages}")


def test_a_full_disk_loses_no_receipt_once_space_is_freed(tmp_path):
    path = tmp_path / "full.db"
    store = ReceiptStore(path)
    _fill(store)
    rows = [row() | {"request_json": "x" * 5000} for _ in range(6)]
    assert [store.add(r) for r in rows] == [False] * 6
    assert len(store.backlog) == 6 and store.rows() == []
    store.db.execute("pragma max_page_count = 1000000")  # space freed
    assert store.add(row()) is True
    assert [r["id"] for r in ReceiptStore(path).rows()][:6] == [r["id"] for r in rows]
    assert len(ReceiptStore(path).rows()) == 7 and not store.backlog


def test_the_writer_flushes_held_receipts_when_the_engine_stops(tmp_path):
    path = tmp_path / "w.db"
    store = ReceiptStore(path)
    _fill(store)
    store.add(row() | {"request_json": "x" * 5000})
    writer = ReceiptWriter(store, "tiny-dense", "id")
    store.db.execute("pragma max_page_count = 1000000")
    writer.close()
    assert len(ReceiptStore(path).rows()) == 1 and not store.backlog


def test_a_damaged_database_is_set_aside_and_receipts_go_on(tmp_path):
    path = tmp_path / "receipts.db"
    path.write_bytes(b"\x07" * 5000)  # not a database
    store = ReceiptStore(path)
    assert store.writable and store.add(row()) is True
    assert len(ReceiptStore(path).rows()) == 1
    assert [p.read_bytes() for p in tmp_path.glob("receipts.db.damaged-*")] == [b"\x07" * 5000]  # kept, not deleted


def test_read_only_database_never_fails(tmp_path):
    path = tmp_path / "ro.db"
    ReceiptStore(path).add(row())
    store = ReceiptStore(path)
    store.db.conn.execute("pragma query_only = on")  # what a read-only file looks like to sqlite (we run as root)
    assert store.add(row()) is False
    assert len(store.rows()) == 1


def test_writer_folds_a_turn_from_engine_events(tmp_path, dense_engine):
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    store = ReceiptStore(tmp_path / "w.db")
    writer = ReceiptWriter(store, "tiny-dense", dense_engine.checkpoint.identity)
    dense_engine.listeners.append(writer)
    try:
        tok = dense_engine.checkpoint.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "Explain src/app/cli.py"}], add_generation_prompt=True)
        fin = dense_engine.submit(GenerationRequest(tuple(prompt), SamplingParams(max_tokens=30), session="s", source="tui",
                                                    raw='{"hello": 1}')).result()
    finally:
        dense_engine.listeners.remove(writer)
    (r,) = store.rows()
    assert r["session"] == "s" and r["source"] == "tui" and r["completion_tokens"] == fin.completion_tokens
    assert r["ttft_first_token_s"] > 0 and r["request_json"] == '{"hello": 1}' and len(r["output_sha256"]) == 64
    assert r["model_identity"] == dense_engine.checkpoint.identity and r["restore_source"] == "cold"
    # alone: every round its own, nothing waited for
    assert r["rounds"] == fin.stats.rounds > 0 and r["batched_rounds"] == 0 and r["rows_mean"] == 1.0
    assert r["others_s"] == 0.0 and 0 <= r["queued_s"] < r["ttft_first_token_s"]


def test_a_predicted_turns_receipt_says_how_much_of_the_prediction_was_kept(tmp_path, dense_engine):
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    store = ReceiptStore(tmp_path / "p.db")
    writer = ReceiptWriter(store, "tiny-dense", dense_engine.checkpoint.identity)
    prompt = tuple(dense_engine.checkpoint.tokenizer.encode("class Codec(codecs.Codec):\n"))
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    reply = dense_engine.submit(GenerationRequest(prompt, params, use_mtp=False)).result().token_ids
    dense_engine.listeners.append(writer)
    try:
        fin = dense_engine.submit(GenerationRequest(prompt, params, prediction=reply)).result()
    finally:
        dense_engine.listeners.remove(writer)
    (r,) = store.rows()
    assert r["predicted_accepted"] == fin.stats.predicted_accepted > 60
    assert r["predicted_drafted"] == fin.stats.predicted_drafted


def test_a_replay_completes_the_servers_row_instead_of_adding_one():
    """A replay against an mtplx server sharing the store: one row per turn, with the server's
    restore source, tau and acceptance and the replay's run, ceiling and client-side TTFT."""
    from mtplx.receipts.store import ReceiptStore

    store = ReceiptStore(":memory:")
    server_row = {"id": "r1", "created_utc": "2026-12-01T10:00:00.500+00:00", "session": "run-s1/abc123", "source": "api",
                  "ceiling": 40, "cached_tokens": 90, "restore_source": "ram", "anchor": "message", "tau": 2.5,
                  "drafted_by_depth": "[4]", "accepted_by_depth": "[3]", "ttft_first_token_s": 0.01}
    store.add(server_row)
    fields = {"source": "replay", "arm": None, "replay_run": "run", "turn_index": 1, "ceiling": 95,
              "ttft_first_token_s": 0.03, "ttft_first_visible_s": 0.05}
    assert store.claim("run-s1", "2026-12-01T10:00:00.000+00:00", fields) == "r1"
    rows = store.rows()
    assert len(rows) == 1 and rows[0]["source"] == "replay" and rows[0]["restore_source"] == "ram"
    assert rows[0]["tau"] == 2.5 and rows[0]["ceiling"] == 95 and rows[0]["ttft_first_token_s"] == 0.03
    # claimed once: a second turn of the same session finds no unclaimed row (its caller adds one)
    assert store.claim("run-s1", "2026-12-01T10:00:00.000+00:00", fields) is None
    assert store.claim("other-s1", "2026-12-01T09:00:00.000+00:00", fields) is None


def test_a_lock_on_the_store_never_holds_the_engine_and_the_row_goes_in_once_it_is_free(tmp_path):
    """Another process holding receipts.db (a shell, a second tool) used to keep the engine thread
    in the store's 2 s busy wait at every turn's end, freezing every stream. The engine's writer
    gives up after WAIT_S and holds the row; a retry thread puts it in once the lock is gone,
    without waiting for another turn to end."""
    from mtplx.engine.request import GenerationRequest
    from mtplx.events import Finished, Queued
    from mtplx.receipts.writer import WAIT_S

    path = tmp_path / "busy.db"
    store = ReceiptStore(path, busy_s=WAIT_S)
    writer = ReceiptWriter(store, "tiny-dense", "id")
    request = GenerationRequest((1, 2, 3), session="s")
    blocker = sqlite3.connect(str(path), isolation_level=None)
    blocker.execute("begin exclusive")
    ended = threading.Thread(target=lambda: (writer(Queued(request.request_id, 0, request)),
                                             writer(Finished(request.request_id, "stop", 3, 1, 0, "hi", (7,)))))
    ended.start()
    ended.join(1.5)  # the default busy wait alone is 2 s
    assert not ended.is_alive(), "the turn's end waited on the lock"
    assert store.backlog and ReceiptStore(path).rows() == []
    blocker.execute("rollback")
    for _ in range(100):  # the retry thread, every RETRY_S; no other turn ends
        if not store.backlog:
            break
        threading.Event().wait(0.05)
    assert [r["session"] for r in ReceiptStore(path).rows()] == ["s"]
    writer.close()
