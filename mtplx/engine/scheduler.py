"""The scheduler: which work each engine step runs, in the spirit of nano-vllm's step().

One step = up to `chunk_size` prompt tokens of prefill (round-robin among the admitted requests
prefilling, so a short request arriving while a long one streams gets its first token after a
chunk, not after the other's reply; requests after the first in line join the step only if
their whole remaining prompt fits what is left, so a burst of short ones, an agent's parallel
subagents, starts together and joins the batch in one merge), then one decode step for every running
sequence: sequences of one mode (MTP or AR) that can share a batch run as ONE batched forward
(batch.DecodeBatch), any other runs alone. Each request still gets exactly its events of today:
Restored, PrefillProgress, FirstToken, Tokens, DraftVerified, Finished.

A batch's caches are merged once, when its first rows start together; after that a sequence
that joins (after its first token) is added into the batch's buffers, and one that leaves (it
finished or was cancelled) takes its own caches while the others stay in place (DecodeBatch.add,
drop). Never per step.

The scheduler knows sequences, batches and a memory estimate; the engine owns queues, the bank
and listeners and hands the scheduler admitted sequences and two callbacks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from mtplx.engine.batch import DecodeBatch, can_batch
from mtplx.engine.generation import Generation
from mtplx.errors import RequestError
from mtplx.events import PrefillProgress

log = logging.getLogger("mtplx.engine")


@dataclass(eq=False)
class Sequence:
    """One admitted request: its submission, its generation, and what the engine keeps for it."""

    sub: object  # engine.Submission
    gen: Generation
    prefill: object  # the generation's prefill iterator (None once the prompt is in)
    reserved: int  # KV bytes reserved at admission (scheduler.kv_bytes)
    bank_turn: object = None  # the engine's: the bank's side of this request (BankedTurn), if banked
    prefilled: int = 0  # prompt tokens computed so far (PrefillProgress.done)
    todo: int | None = None  # prompt tokens left to compute (set at admission from the restore, then per chunk)
    decoding: bool = False
    restored: int = 0  # prompt tokens its start state held (from the bank)
    shared_to: int = 0  # where its prompt prefix last kept for other requests ends (engine._share_running)

    @property
    def request_id(self) -> str:
        return self.sub.request.request_id

    def cancelled(self) -> bool:
        return self.sub.cancelled.is_set()


def kv_bytes_per_token(model_config: dict, itemsize: int, with_mtp: bool) -> int:
    """Attention KV bytes one token costs: 2 (keys, values) x KV heads x head dim x itemsize per
    full-attention layer (recurrent layers keep a fixed state, not per token), plus the MTP layer."""
    heads = int(model_config.get("num_key_value_heads") or model_config.get("num_attention_heads", 1))
    head_dim = int(model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"])
    types = model_config.get("layer_types")
    layers = sum(t != "linear_attention" for t in types) if types else int(model_config["num_hidden_layers"])
    return 2 * heads * head_dim * itemsize * (layers + (1 if with_mtp else 0))


class Scheduler:
    def __init__(self, runner, chunk_size: int, max_batch: int, memory_budget: int,
                 publish: Callable, finish: Callable, prefill_share: float = 1.0):
        """`publish(seq, event)` hands an event out; `finish(seq, error)` ends a sequence: with
        error None its final events and the bank's commit (its caches are its own again by then),
        else its Failed event. `prefill_share`: see step."""
        self.runner, self.chunk_size, self.prefill_share = runner, chunk_size, prefill_share
        self.contended = [0.0, 0.0]  # seconds of prompt chunks and of decode rounds while both had work
        self.max_batch, self.memory_budget = max_batch, memory_budget
        self.publish, self.finish = publish, finish
        self.prefilling: deque[Sequence] = deque()
        self.groups: dict[object, list[Sequence]] = {}  # decode groups by batch key
        self.batches: dict[object, DecodeBatch] = {}  # the merged ones (two rows or more)
        self.current: str | None = None  # the request whose work runs now (bank decisions name it)

    # -- admission --------------------------------------------------------------------------
    @property
    def sequences(self) -> list[Sequence]:
        return list(self.prefilling) + [s for rows in self.groups.values() for s in rows]

    @property
    def has_work(self) -> bool:
        return bool(self.prefilling or self.groups)

    def can_admit(self, cost: int) -> bool:
        """Room for one more: under max_batch, and its KV estimate within the memory budget (a
        request alone is always admitted, whatever its estimate). A batch's attention rows share
        one buffer as long as its longest row (batch_cache.RaggedKVCache), so admitted rows count
        at the largest estimate among them, not at their own: a long agent turn beside short
        subagents' rows holds that length for each of them."""
        running = self.sequences
        if not running:
            return True
        rows = len(running) + 1
        return rows <= self.max_batch and rows * max(cost, *(s.reserved for s in running)) <= self.memory_budget

    def state_of(self, seq: Sequence):
        """seq's caches as they stand (its TurnState): a batched row's viewed in its batch's
        buffers (DecodeBatch.row_state), a prefill's partial state before its prompt is in."""
        for key, rows in self.groups.items():
            if key in self.batches and any(s is seq for s in rows):
                return self.batches[key].row_state(seq.gen)
        return seq.gen.state if seq.gen.state is not None else seq.gen.partial

    def admit(self, seq: Sequence) -> None:
        self.prefilling.append(seq)

    def reap_cancelled(self) -> None:
        """End every cancelled prefill now, before the next admission plans its restore: a
        cancelled prefill's computed prefix goes to the bank as it ends, and an agent that gave up
        on a long prompt resends it at once (Claude Code after 300 s), so its resend must find it."""
        for seq in [s for s in self.prefilling if s.cancelled()]:
            self.prefilling.remove(seq)
            self.current = seq.request_id
            try:
                for event in seq.prefill:  # returns at once: it checks the cancel before each chunk
                    self.publish(seq, event)
            except Exception as exc:
                self._fail(seq, exc)
                continue
            seq.prefill = None
            self._end(seq)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> None:
        """Prompt chunks (up to chunk_size tokens), then one round of every decoding row. While
        both have work, the prompts get `prefill_share` of the time: a prompt chunk at agent
        context costs many decode rounds on a CPU, so a chunk every step left a streaming reply
        under a tenth of the engine while another agent's long prompt went in (bench/concurrency.py:
        63-72 of its ~1,000 tok/s beside a 3k prompt); past its share, a step runs the rounds alone."""
        budget, joining, prefilled = self.chunk_size, [], False
        contended = bool(self.prefilling and self.groups)
        if not contended:
            self.contended = [0.0, 0.0]
        prompts_s, rounds_s = self.contended
        owed = contended and prompts_s * (1 - self.prefill_share) > rounds_s * self.prefill_share
        started = time.perf_counter()
        for _ in range(0 if owed else len(self.prefilling)):  # each sequence at most once a step
            seq = self.prefilling[0]
            if budget < self.chunk_size and (seq.todo is None or seq.todo > budget):
                break  # the decoding rows wait for one chunk's worth of prompt, never more
            self.prefilling.popleft()
            prefilled = True
            spent = self._prefill(seq, budget, shared=bool(self.prefilling or self.groups or joining))
            budget -= spent
            if seq.decoding:
                joining.append(seq)
            if budget <= 0:
                break
        prefill_s = time.perf_counter() - started
        if prefilled:  # the rows already decoding waited for these prompt chunks
            self._waited(prefill_s)
        for key in dict.fromkeys(self._key(s) for s in joining):  # one merge per batch, however many join
            rows = [s for s in joining if self._key(s) == key]
            try:
                self._join(key, rows)
            except Exception as exc:  # joining its batch failed: those requests fail, the rest goes on
                self._drop_group(key, exc, also=rows)
        # Several decode groups (a batch beside a row that cannot join it) wait on each other: a
        # group's rows for the groups before it, charged before its rows may finish, then for those after.
        order, took = list(self.groups), []
        for key in order:
            if took:
                self._waited(sum(took), only=key)
            started = time.perf_counter()
            try:
                self._decode(key)
            except Exception as exc:  # a merge or hand-back failed: that batch's rows fail
                self._drop_group(key, exc)
            took.append(time.perf_counter() - started)
        for i, key in enumerate(order[:-1]):
            self._waited(sum(took[i + 1:]), only=key)
        if contended:
            self.contended = [prompts_s + prefill_s, rounds_s + sum(took)]
        self.current = None

    def _waited(self, seconds: float, only=None) -> None:
        """Charge `seconds` of other requests' work to the decoding rows (of group `only`, else
        of every group): a turn that decoded beside others shows what it waited for."""
        for key, rows in self.groups.items():
            if only is None or key == only:
                for seq in rows:
                    seq.gen.stats.others_s += seconds

    def _drop_group(self, key, exc: Exception, also: tuple = ()) -> None:
        log.exception("batch %s failed", key)
        self.batches.pop(key, None)  # its caches are in an unknown state: dropped, never handed back
        rows = self.groups.pop(key, [])
        for seq in rows + [s for s in also if s not in rows]:
            self._fail(seq, exc)

    def _prefill(self, seq: Sequence, budget: int, shared: bool = False) -> int:
        """Up to `budget` prompt tokens of `seq` (a chunk may overshoot it); once its prompt is in,
        its first token, and it is marked decoding for the caller to join. Returns tokens spent.
        `shared`: other sequences run now (Generation.first_token)."""
        self.current = seq.request_id
        spent = 0
        try:
            while spent < budget:
                event = next(seq.prefill, None)
                if event is None:
                    seq.prefill = None
                    break
                self.publish(seq, event)
                if isinstance(event, PrefillProgress):
                    spent += event.done - seq.prefilled
                    seq.prefilled, seq.todo = event.done, event.total - event.done
            if seq.prefill is not None:
                self.prefilling.append(seq)  # more chunks: back of the line
                return spent
            if seq.gen.finish_reason is None:  # the prompt is in: the first token now, alone
                for event in seq.gen.first_token(shared):
                    self.publish(seq, event)
        except Exception as exc:  # its own prefill failed: only this request
            self._fail(seq, exc)
            return spent
        if seq.gen.finish_reason is not None:
            self._end(seq)
            return spent
        seq.decoding = True
        return spent

    def _decode(self, key) -> None:
        rows = self.groups[key]
        gone = [s for s in rows if s.cancelled()]
        for seq in gone:
            seq.gen.finish_reason = "cancelled"
        if gone:
            self._leave(key, gone)
            if key not in self.groups:
                return
            rows = self.groups[key]
        try:
            if key in self.batches:
                self.current = rows[0].request_id
                results = self.batches[key].step()
                for seq, (new, drafts, accepted) in zip(rows, results):
                    self.current = seq.request_id
                    stats = seq.gen.stats
                    stats.rounds += 1
                    stats.batched_rounds += 1
                    stats.batch_rows += len(rows)
                    events = seq.gen.take_round(new, drafts, accepted) if drafts else seq.gen.take_tokens(new)
                    for event in events:
                        self.publish(seq, event)
            else:
                seq = rows[0]
                self.current = seq.request_id
                seq.gen.stats.rounds += 1
                for event in seq.gen.step():
                    self.publish(seq, event)
        except Exception as exc:  # a batched forward failing fails its rows, never the others
            return self._drop_group(key, exc)
        done = [s for s in rows if s.gen.finish_reason is not None]
        if done:
            self._leave(key, done)

    # -- membership -------------------------------------------------------------------------
    def _key(self, seq: Sequence):
        if not can_batch(seq.gen):
            return ("alone", seq.request_id)
        return "mtp" if seq.gen.speculator is not None else "ar"

    def _join(self, key, rows: list[Sequence]) -> None:
        """Rows join their batch: appended to a merged batch (its rows stay put), else merged with
        the one row decoding alone, if any."""
        if key in self.batches:
            self.batches[key].add([s.gen for s in rows])
            self.groups[key] = self.groups[key] + rows
        else:
            self._regroup(key, self.groups.get(key, []) + rows)

    def _leave(self, key, leaving: list[Sequence]) -> None:
        staying = [s for s in self.groups[key] if s not in leaving]
        if key in self.batches and len(staying) > 1:
            # the leaving rows take their caches; the batch keeps the others in place
            batch = self.batches[key]
            batch.drop([s.gen for s in leaving])
            by_gen = {id(s.gen): s for s in staying}
            self.groups[key] = [by_gen[id(g)] for g in batch.gens]
        else:
            self._regroup(key, staying)
        for seq in leaving:
            self._end(seq)

    def _regroup(self, key, rows: list[Sequence]) -> None:
        """Hand the old batch's caches back to its rows, then merge the new membership (a batch
        of one decodes on its own caches, exactly as a request alone)."""
        if key in self.batches:
            self.batches.pop(key).release()
        if not rows:
            self.groups.pop(key, None)
            return
        self.groups[key] = rows
        if len(rows) > 1:
            self.batches[key] = DecodeBatch(self.runner, [s.gen for s in rows])

    def _end(self, seq: Sequence) -> None:
        self.current = seq.request_id
        try:
            if seq.decoding:
                seq.gen.end_decode()
            self.finish(seq, None)
        except Exception as exc:
            self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        self.current = seq.request_id
        if not isinstance(exc, RequestError):
            log.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc)
        self.finish(seq, exc)

    def drop_all(self) -> list[Sequence]:
        """Forget every sequence (the engine is failing them all); returns them."""
        out = self.sequences
        self.prefilling.clear()
        self.groups.clear()
        self.batches.clear()
        return out

