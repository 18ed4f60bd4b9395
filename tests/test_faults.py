"""Faults a real user meets: restarts, damaged or failing disks, clients that leave, a dying engine
thread, signals, a busy port. Each is followed by a normal request that must succeed with the right
output. Requests carry no session header, as real agents send none."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from mtplx.bank.bank import BankConfig
from mtplx.bank.ssd import CorruptEntry, SsdConfig, SsdTier
from mtplx.catalog import resolve
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.events import Finished, PrefillProgress, Queued
from mtplx.server.app import create_app
from mtplx.server.background import BackgroundServer

MODEL = "tiny-hybrid"  # recurrent state is the hard part to persist and restore
SYSTEM = "You are a careful coding agent. " + " ".join(f"Rule {i}: keep changes small and tested." for i in range(30))
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Explain what src/ledger/events.py does."}]


class Served:
    """An engine (bank on an SSD root, or none) served on a free loopback port, events recorded."""

    def __init__(self, root: Path | None, bank: bool = True, chunk_size: int = 64, max_batch: int = 8):
        ssd = SsdConfig(root, budget_bytes=64 << 20, free_floor_bytes=0) if bank and root is not None else None
        self.engine = Engine(resolve(MODEL), EngineConfig(chunk_size=chunk_size, max_batch=max_batch), name=MODEL,
                             bank=BankConfig() if bank else None, ssd=ssd).start()
        self.events: list = []
        self.engine.listeners.append(self.events.append)
        from mtplx.receipts.store import ReceiptStore
        from mtplx.receipts.writer import ReceiptWriter

        self.receipts = ReceiptStore()  # under the test's MTPLX_HOME: every turn, even abandoned, gets its row
        self.engine.listeners.append(ReceiptWriter(self.receipts, MODEL, self.engine.checkpoint.identity))
        self.server = BackgroundServer(create_app(self.engine, MODEL)).start()
        self.url = self.server.url

    def chat(self, messages, **extra) -> httpx.Response:
        body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)

    def finished(self, request_id_of=None, timeout: float = 60) -> list[Finished]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [e for e in self.events if isinstance(e, Finished)]
            if request_id_of is None or any(e.request_id == request_id_of for e in done):
                return done
            time.sleep(0.05)
        raise AssertionError("no Finished event arrived")

    def close(self):
        self.server.stop()
        self.engine.stop()


def second_turn(first_reply: dict) -> list[dict]:
    message = first_reply["choices"][0]["message"]
    assistant = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        assistant["tool_calls"] = message["tool_calls"]
        follow = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "def append(event): ..."}
    else:
        follow = {"role": "user", "content": "Now list its public functions."}
    return FIRST + [assistant, follow]


def reply_of(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


@pytest.fixture(scope="module")
def cold():
    """What a bankless engine answers to both turns: the output every recovery must reproduce."""
    served = Served(None, bank=False)
    try:
        first = served.chat(FIRST).json()
        second = served.chat(second_turn(first)).json()
        return first, second
    finally:
        served.close()


def _one_entry_on_ssd(root: Path, cold) -> None:
    served = Served(root)
    try:
        assert reply_of(served.chat(FIRST)) == cold[0]["choices"][0]["message"]
    finally:
        served.close()  # a clean stop flushes the bank to SSD
    assert list(root.glob("*.safetensors"))


# -- restarts and damaged files ---------------------------------------------------------------
def test_restart_without_session_header_restores_from_ssd(tmp_path, cold):
    _one_entry_on_ssd(tmp_path, cold)
    served = Served(tmp_path)
    try:
        response = served.chat(second_turn(cold[0]))
        assert reply_of(response) == cold[1]["choices"][0]["message"]
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert [e.source for e in served.events if type(e).__name__ == "Restored"] == ["ssd"]
    finally:
        served.close()


def _damage(root: Path, how: str) -> None:
    files = sorted(root.glob("*.safetensors"))
    if how == "manifest_garbage":
        (root / "manifest.db").write_bytes(os.urandom(8192))
        for extra in root.glob("manifest.db-*"):
            extra.unlink()
        return
    for path in files:
        data = path.read_bytes()
        if how == "truncated":
            path.write_bytes(data[: len(data) // 2])
        elif how == "flipped":
            middle = len(data) // 2
            path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "header_garbage":
            path.write_bytes(os.urandom(64) + data[64:])
        elif how == "missing":
            path.unlink()


@pytest.mark.parametrize("how", ["truncated", "flipped", "empty", "header_garbage", "missing", "manifest_garbage"])
def test_damaged_ssd_entries_are_dropped_and_recomputed(tmp_path, cold, how):
    _one_entry_on_ssd(tmp_path, cold)
    _damage(tmp_path, how)
    served = Served(tmp_path)
    try:
        response = served.chat(second_turn(cold[0]))
        assert reply_of(response) == cold[1]["choices"][0]["message"]
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        served.engine.settle()
        again = served.chat(second_turn(cold[0]) + [{"role": "user", "content": "thanks"}])
        assert again.status_code == 200 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        served.close()
    tier = SsdTier(SsdConfig(tmp_path, budget_bytes=64 << 20, free_floor_bytes=0))
    for view in tier.views():  # every entry left either validates or is deleted when loaded, never served
        try:
            tier.load(view.entry_id, view.identity)
        except CorruptEntry:
            assert view.entry_id not in {v.entry_id for v in tier.views()}
    tier.close()


# -- a failing disk ---------------------------------------------------------------------------
def _fail_writes(monkeypatch, how: str) -> None:
    if how == "writer_error":  # the file writer itself fails (an I/O error on the bank's I/O thread)
        def broken(self, staged):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(SsdTier, "write_file", broken)
    else:  # a read-only or full disk refuses the rename into place
        import mtplx.bank.ssd as ssd_module

        def refuse(src, dst):
            raise OSError(30 if how == "read_only" else 28, "Read-only file system" if how == "read_only" else
                          "No space left on device")
        monkeypatch.setattr(ssd_module.os, "replace", refuse)


@pytest.mark.parametrize("how", ["writer_error", "read_only", "disk_full"])
def test_ssd_write_failure_degrades_to_ram_and_recovers(tmp_path, cold, monkeypatch, how):
    served = Served(tmp_path)
    try:
        with monkeypatch.context() as patch:
            _fail_writes(patch, how)
            assert reply_of(served.chat(FIRST)) == cold[0]["choices"][0]["message"]
            served.engine.settle()
            health = httpx.get(served.url + "/health")
            assert health.status_code == 200 and health.json()["bank"]["ssd"] == "degraded"
            response = served.chat(second_turn(cold[0]))  # the bank still serves from RAM
            assert reply_of(response) == cold[1]["choices"][0]["message"]
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert not list(tmp_path.glob("*.safetensors"))
            assert any(e.action == "ssd_failed" for e in served.events if type(e).__name__ == "BankDecision")
        served.engine.call(lambda: setattr(served.engine.bank.ssd_health, "retry_at", 0.0))  # skip the back-off
        served.engine.settle()
        assert httpx.get(served.url + "/health").json()["bank"]["ssd"] == "ok"
        assert list(tmp_path.glob("*.safetensors"))
    finally:
        served.close()


def test_unusable_bank_directory_serves_ram_only(tmp_path, cold):
    blocker = tmp_path / "bank"
    blocker.write_text("a file where the bank directory should be")
    served = Served(blocker)
    try:
        assert reply_of(served.chat(FIRST)) == cold[0]["choices"][0]["message"]
        bank = httpx.get(served.url + "/health").json()["bank"]
        assert bank["ssd"] == "degraded" and "bank" in bank["ssd_error"]
    finally:
        served.close()


# -- clients that leave -----------------------------------------------------------------------
LONG = [{"role": "system", "content": SYSTEM * 12}, {"role": "user", "content": "Summarise the rules."}]


def _request_id(served: Served, after: int) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        queued = [e for e in served.events[after:] if isinstance(e, Queued)]
        if queued:
            return queued[0].request_id
        time.sleep(0.02)
    raise AssertionError("the request was never queued")


def _follow_up_is_normal(served: Served, cold) -> None:
    reply = reply_of(served.chat(FIRST))
    assert reply == cold[0]["choices"][0]["message"]
    finishes = [row["finish_reason"] for row in served.receipts.rows()]
    assert "cancelled" in finishes and finishes.count("stop") + finishes.count("length") >= 1  # no lost receipt


def leave_in_prefill(served: Served, chunks: int = 1) -> str:
    """Stream LONG and close the connection after `chunks` prefill chunks; its request id."""
    mark = len(served.events)
    body = {"model": MODEL, "messages": LONG, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", served.url + "/v1/chat/completions", json=body):
        rid = _request_id(served, mark)
        while sum(isinstance(e, PrefillProgress) and e.request_id == rid for e in served.events) < chunks:
            time.sleep(0.005)
    return rid


def ended(served: Served, rid: str) -> tuple[Finished, PrefillProgress]:
    """A request's Finished event and its last prefill progress."""
    fin = next(e for e in served.finished(rid) if e.request_id == rid)
    return fin, [e for e in served.events if isinstance(e, PrefillProgress) and e.request_id == rid][-1]


def abandon_in_prefill(served: Served) -> tuple[Finished, PrefillProgress]:
    """Stream LONG and leave after its first prefill chunk: the turn's end and its last progress."""
    return ended(served, leave_in_prefill(served))


def resend_restored_and_equals_cold(retry: httpx.Response, done: PrefillProgress) -> None:
    """The resent LONG restored at least what the abandoned one computed, and answers as cold."""
    assert retry.status_code == 200
    assert retry.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= done.done
    reference = Served(None, bank=False)
    try:
        assert reply_of(retry) == reply_of(reference.chat(LONG, max_tokens=8))  # restored == cold
    finally:
        reference.close()


def test_abandoned_during_prefill_frees_the_engine(cold):
    served = Served(None, bank=False, chunk_size=32)
    try:
        fin, progress = abandon_in_prefill(served)
        assert fin.finish_reason == "cancelled" and fin.completion_tokens == 0
        assert progress.done < progress.total  # stopped between chunks, not after the whole prompt
        _follow_up_is_normal(served, cold)
    finally:
        served.close()


def test_abandoned_non_streaming_request_is_cancelled(cold):
    served = Served(None, bank=False)
    try:
        mark = len(served.events)
        # Most of the window: at ~1,000 tok/s the answer would take seconds more than the client waits.
        body = {"model": MODEL, "messages": FIRST, "max_tokens": 7000, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(120, read=2.0))
        rid = _request_id(served, mark)
        fin = next(e for e in served.finished(rid) if e.request_id == rid)
        assert fin.finish_reason == "cancelled" and fin.completion_tokens < 6000
        _follow_up_is_normal(served, cold)
    finally:
        served.close()


def stream_until(url: str, body: dict, stop: threading.Event) -> None:
    """Stream `body`'s chat reply until `stop` is set: a running request that outlasts whatever
    the caller does meanwhile, however fast this machine decodes."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), timeout=120) as response:
        for _ in response.iter_lines():
            if stop.is_set():
                return


def test_abandoned_while_queued_never_runs(cold):
    served = Served(None, bank=False, max_batch=1)  # a request waits in the queue only while the scheduler is full
    try:
        mark = len(served.events)
        # The running request streams until the queued one has been abandoned, however fast this
        # machine decodes (a fixed 300 tokens once ended before the queued request's client gave up).
        long_body = {"model": MODEL, "messages": FIRST, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        abandoned = threading.Event()
        first = threading.Thread(target=stream_until, args=(served.url, long_body, abandoned))
        first.start()
        running = _request_id(served, mark)
        mark = len(served.events)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/chat/completions", json=dict(long_body, max_tokens=8),
                       timeout=httpx.Timeout(120, read=0.5))
        queued = _request_id(served, mark)
        abandoned.set()
        first.join(120)
        fin = next(e for e in served.finished(queued) if e.request_id == queued)
        assert fin.finish_reason == "cancelled" and fin.completion_tokens == 0
        assert not any(isinstance(e, PrefillProgress) and e.request_id == queued for e in served.events)
        assert running != queued
        _follow_up_is_normal(served, cold)
    finally:
        served.close()


# -- the engine thread itself -----------------------------------------------------------------
def test_a_dead_engine_thread_answers_503_instead_of_hanging():
    served = Served(None, bank=False)
    try:
        def die(sub):
            raise SystemExit("simulated crash of the engine thread")

        served.engine._begin = die  # where the engine thread takes a request on
        response = served.chat(FIRST)
        assert response.status_code == 500 and "engine stopped" in response.json()["error"]["message"]
        health = httpx.get(served.url + "/health")
        assert health.status_code == 503 and health.json()["engine"] == "dead"
        after = served.chat(FIRST)
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_unavailable"
    finally:
        served.close()


def test_idle_work_failure_drops_that_job_only(tmp_path, cold):
    served = Served(tmp_path)
    try:
        executor = served.engine.bank_executor

        def broken_step():
            raise RuntimeError("a bug in idle work")

        original, executor.idle_step = executor.idle_step, broken_step
        assert reply_of(served.chat(FIRST)) == cold[0]["choices"][0]["message"]
        served.engine.call(lambda: setattr(executor, "idle_step", original))
        assert reply_of(served.chat(second_turn(cold[0]))) == cold[1]["choices"][0]["message"]
        assert served.engine.alive
    finally:
        served.close()


def test_kill_9_during_ssd_writes_leaves_no_half_entry(tmp_path, cold):
    import random

    from bench.ssd_kill import CHILD  # a child that persists real entries as fast as the disk takes them

    rng = random.Random(7)
    for _ in range(2):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), MODEL, str(6 << 20)],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 cwd=Path(__file__).resolve().parents[1])
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.2, 0.8))
        child.kill()
        child.wait()
    tier = SsdTier(SsdConfig(tmp_path, budget_bytes=6 << 20, free_floor_bytes=0))  # what a restart opens
    assert not list(tmp_path.glob(".tmp-*"))
    for view in tier.views():
        tier.load(view.entry_id, view.identity)  # every entry left is whole: none raises
    tier.close()
    served = Served(tmp_path)
    try:
        assert reply_of(served.chat(FIRST)) == cold[0]["choices"][0]["message"]
    finally:
        served.close()


# -- the process: signals and ports -----------------------------------------------------------
def _serve_process(home: Path, *args: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, MTPLX_HOME=str(home))
    proc = subprocess.Popen([sys.executable, "-m", "mtplx.cli", "serve", "-m", MODEL, "--port", "0", *args],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 180
    for line in proc.stderr:
        if "serving" in line:
            return proc, line.split(" on ", 1)[1].strip()
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError("mtplx serve did not start")


def sigterm_mid_stream(proc: subprocess.Popen, url: str) -> list[str]:
    """Stream a long reply from `proc`, SIGTERM it after a few chunks; the SSE lines received."""
    body = {"model": MODEL, "messages": FIRST, "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as response:
        for line in filter(None, response.iter_lines()):
            lines.append(line)
            if len(lines) == 10:
                proc.send_signal(signal.SIGTERM)
    return lines


def serve_on_busy_port(home: Path) -> tuple[int, list[str]]:
    """`mtplx serve` on a port another socket listens on: its exit code and stderr lines."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "mtplx.cli", "serve", "--port", str(port)], capture_output=True,
                              text=True, env=dict(os.environ, MTPLX_HOME=str(home)), timeout=120,
                              cwd=Path(__file__).resolve().parents[1])
    return done.returncode, [line for line in done.stderr.splitlines() if line.strip()]


def test_sigterm_during_a_stream_flushes_and_exits_0(tmp_path):
    proc, url = _serve_process(tmp_path)
    try:
        lines = sigterm_mid_stream(proc, url)
        assert lines[-1] == "data: [DONE]"  # the stream was ended, not cut
        assert len([line for line in lines if line.startswith("data:")]) < 3000
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert list((tmp_path / "bank").glob("*.safetensors")), "the bank was not flushed to SSD"
    rows = sqlite3.connect(str(tmp_path / "receipts.db")).execute("select finish_reason from receipts").fetchall()
    assert rows == [("cancelled",)]


def test_a_home_that_cannot_be_created_still_serves(tmp_path):
    """MTPLX_HOME on a read-only disk (here: under a file, which no one can make a folder in):
    `mtplx serve` serves every API with its stores in memory, and says why once."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc, url = _serve_process(blocker / "home")
    try:
        assert httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": FIRST, "max_tokens": 4},
                          timeout=120).status_code == 200
        first = httpx.post(url + "/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4}, timeout=120)
        assert first.status_code == 200, first.text
        follow = httpx.post(url + "/responses", json={"model": MODEL, "input": "and?", "max_output_tokens": 4,
                                                      "previous_response_id": first.json()["id"]}, timeout=120)
        assert first.status_code == follow.status_code == 200
        assert httpx.get(url.removesuffix("/v1") + "/health").json()["bank"]["ssd"] == "degraded"
        proc.terminate()
        assert proc.wait(60) == 0  # a clean stop: the flush found nothing it could write, and said so
    finally:
        proc.kill()


def test_receipts_stay_readable_when_the_store_cannot_be_written(tmp_path, monkeypatch):
    import mtplx.receipts.store as store_module
    from mtplx.receipts.store import ReceiptStore
    from mtplx.receipts.writer import receipt_id

    path = tmp_path / "receipts.db"
    ReceiptStore(path).add({"id": receipt_id(), "created_utc": "2026-12-01T00:00:00.000+00:00", "source": "api"})

    def refuse(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(store_module, "opened", refuse)  # what a read-only disk answers
    store = ReceiptStore(path)
    assert not store.writable and len(store.rows()) == 1  # `mtplx receipts ls` still lists them
    assert ReceiptStore(tmp_path / "absent.db").rows() == []


def test_busy_port_fails_fast_with_one_line(tmp_path):
    code, lines = serve_on_busy_port(tmp_path)
    assert code == 2 and len(lines) == 1 and "in use" in lines[0]


def test_a_second_server_on_the_same_bank_directory_stays_ram_only(tmp_path, cold):
    """Its start-up clean-up would delete the first server's files mid-write: it is refused the
    SSD tier (with the reason in /health) and serves from RAM; `bank ls` still reads beside it."""
    first, second = Served(tmp_path), Served(tmp_path)
    try:
        bank = httpx.get(second.url + "/health").json()["bank"]
        assert bank["ssd"] == "degraded" and "in use" in bank["ssd_error"]
        assert reply_of(second.chat(FIRST)) == cold[0]["choices"][0]["message"]
        assert reply_of(first.chat(FIRST)) == cold[0]["choices"][0]["message"]
        first.engine.settle()
        assert SsdTier(SsdConfig(tmp_path, budget_bytes=64 << 20), owner=False).views()
    finally:
        second.close()
        first.close()
    SsdTier(SsdConfig(tmp_path, budget_bytes=64 << 20)).close()  # both stopped: the directory is free again


def test_abandoned_prefill_with_a_bank_frees_the_engine_and_keeps_its_prefix(tmp_path, cold):
    """The default server has a bank: an abandoned prefill still stops at its next chunk, the
    prefix it computed is banked, and the same request resent restores it with the cold output."""
    served = Served(tmp_path, chunk_size=32)
    try:
        fin, done = abandon_in_prefill(served)
        assert fin.finish_reason == "cancelled" and done.done < done.total
        served.engine.settle()
        retry = served.chat(LONG, max_tokens=8)
    finally:
        served.close()
    resend_restored_and_equals_cold(retry, done)


def test_a_resend_right_after_an_abandon_restores_the_abandoned_prefix(tmp_path, cold):
    """An agent that gives up on a long prompt closes the stream and resends it at once (Claude
    Code after 300 s). The scheduler admits the resend while the abandoned prefill still runs, so
    the cancel must land first (the server waits for the disconnect, it does not poll) and the
    engine must end the cancelled prefill, banking its prefix, before it plans the resend."""
    served = Served(tmp_path, chunk_size=32)
    try:
        rid = leave_in_prefill(served, chunks=2)
        retry = served.chat(LONG, max_tokens=8)  # at once: no settle, no wait for the abandoned turn's end
        fin, done = ended(served, rid)
        assert fin.finish_reason == "cancelled" and done.done < done.total
    finally:
        served.close()
    resend_restored_and_equals_cold(retry, done)
