"""One request's step loop: restore -> prefill the rest -> decode (AR or MTP) -> finish.

Yields engine events. Prefill runs in chunks whose boundaries are absolute multiples of the
chunk size (plus any checkpoint positions the caller asks for), so a cold prefill and one that
starts from a restored state run the same forward boundaries.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from typing import Callable, Iterator

import mlx.core as mx

from mtplx.engine import cache_state, preemption
from mtplx.engine.logit_mask import LogitMask
from mtplx.engine.logprobs import of_positions
from mtplx.engine.request import GenerationRequest
from mtplx.engine.rule_set import rules_of
from mtplx.engine.runner import ModelRunner
from mtplx.engine.sampling import Sampler, apply_penalties
from mtplx.engine.segments import SegmentTracker
from mtplx.engine.prediction import DEPTH as PREDICTED_DEPTH, Prediction
from mtplx.engine.speculation import Speculator
from mtplx.engine.stats import GenerationStats
from mtplx.engine.text_stream import HIDDEN, TextStream
from mtplx.events import DraftVerified, FirstToken, Finished, PrefillProgress, Restored, Tokens
from mtplx.reply_stream import Piece, ReplyStream, message
from mtplx import harmony
from mtplx.state import snapshot
from mtplx.tool_formats import TAGGED
from mtplx.state.turn import CheckpointHook, StartPoint, TurnState  # noqa: F401  (StartPoint: callers import it here)


# A last prefill chunk at least this long runs its final token as a forward of its own (see
# _chunk_ends); on the tiny models one 22-token forward took 0.6x (dense) to 0.96x (hybrid) of 21 + 1.
SPLIT_LAST_FROM = 64
# A prefill chunk of at most this many tokens (a warm turn's appended tool result, a render-ahead
# chunk) runs MKL on one thread, as decode steps do (compute.blas_threads): on this 2-core CPU a
# 16-token chunk at 1k context took 12 ms on one thread vs 25-32 ms on two, 64 tokens 41-55 vs
# 59-67 ms; at 256 tokens the two were even. Bits do not change with the thread count.
ONE_THREAD_UP_TO = 64
# At most this many plain steps after a first token that shows the client nothing, before the MTP
# head's prompt KV is computed (first_token): enough for `<think>` + newline.
HIDDEN_LEAD = 2
# Prompt tokens of the MTP head's KV computed between two plain steps while it catches up. A count,
# not a time: every run, and every rank of a sharded model, must take the same steps.
CATCH_UP_TOKENS = 1024
CATCH_UP = True  # False: that KV in one go after the first token (bench/head_catch_up.py's other arm)
SCORE_BLOCK = 256  # prompt positions scored per logits block (request.prompt_logprobs)


class Generation:
    def __init__(self, runner: ModelRunner, request: GenerationRequest, *, use_mtp: bool, depth: int,
                 chunk_size: int, eos_ids: set[int], submitted_at: float):
        self.runner, self.request = runner, request
        self.params = request.sampling
        # A penalty changes each position's distribution with the drafts before it; such
        # requests decode autoregressively rather than verify against a moving target.
        self.use_mtp = use_mtp and runner.mtp is not None and not self.params.penalised
        self.depth = depth
        self.chunk_size = chunk_size
        self.eos_ids = set() if request.sampling.ignore_eos else eos_ids
        self.submitted_at = submitted_at
        self.sampler = Sampler(self.params)
        rule = rules_of(request)
        self.rule = rule
        # A history-free rule (no tools: the call token banned; a logit bias) as one vector added to
        # logits of any leading shape (logit_mask.py), so greedy drafts stay one lazy chain over the
        # draft vocabulary (see Speculator) and a batch's argmax rows need no per-row pick. A rule
        # that reads history shapes position by position.
        self.mask = LogitMask(rule) if rule is not None and rule.history_free else None
        self.shape = self._ruled if rule is not None and not rule.history_free else None
        tokenizer = runner.checkpoint.tokenizer
        in_reasoning = tokenizer.decode(list(request.prompt[-4:])).rstrip().endswith("<think>")
        call_format = getattr(runner.checkpoint, "tool_format", None) or TAGGED
        call_tags, tools = (call_format.start, call_format.end), (request.chat or {}).get("tools")
        # The reply is split once, here (reasoning, content, tool calls in the model's format, typed by
        # the request's tool schemas): events carry the pieces, no consumer parses the text again.
        if call_format.name == "harmony":  # gpt-oss: channels and recipients in message headers
            self.stream = TextStream(tokenizer, self.params.stop, in_reasoning, call_tags, call_format.markup,
                                     lambda text: harmony.visible_mask(text, HIDDEN))
            self.segments = harmony.HarmonySegments(tokenizer)
            self.reply = harmony.HarmonyReply(tools, calls=request.calls)
        else:
            self.stream = TextStream(tokenizer, self.params.stop, in_reasoning, call_tags, call_format.markup)
            self.segments = SegmentTracker(tokenizer, start_in_reasoning=in_reasoning, call_tags=call_tags)
            self.reply = ReplyStream(in_reasoning, call_format, tools, calls=request.calls)
        self.pieces: list[Piece] = []
        self.stats = GenerationStats(mode="mtp" if self.use_mtp else "ar", depth=depth if self.use_mtp else 0,
                                     prompt_tokens=len(request.prompt))
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.picked_logprobs: list = []  # drawn, not yet emitted (engine/logprobs.TokenLogprob)
        self.logprobs: list = []  # one per emitted token, when the request asked for them
        self.prompt_logprobs: list = []  # one per prompt token after the first (request.prompt_logprobs)
        self.state: TurnState | None = None
        self.speculator = None
        self.follower = None  # without MTP: a speculator that only verifies a prediction's drafts
        self.stop_token: int | None = None  # the end-of-sequence token that ended the turn
        self.last_hidden_at_end = None  # hidden at the cache's last position, after feed_tail
        self.prefill_cut: int | None = None  # where a cancelled prefill stopped (its state is kept)
        # The prefill's state after its latest chunk (what a request sharing this prompt's head
        # restores from while it goes on: engine/shared_prompt.py); its caches go on being written.
        self.partial: TurnState | None = None
        # The trunk's hidden just before each checkpoint the prefill captured (MTP only): with the
        # recurrent state there it makes that point a turn's end another request can restore, MTP
        # pair included, while this one decodes (bank_executor.share_running). Copied out of the
        # chunk's hiddens when the MTP head's prompt KV is computed, which computes them anyway.
        self.hidden_at: dict[int, mx.array] = {}
        self.eager_mtp = request.source == "render_ahead"  # the MTP head's KV with each prefill chunk
        # Otherwise that KV stays lazy until the first token is out; these are its keys and values
        # per prefill chunk, so first_token can compute them a chunk at a time.
        self.head_chunks: list[tuple[mx.array, mx.array]] = []
        self.last: int | None = None  # generated, not yet fed to the trunk (AR decoding)
        self._t0 = 0.0  # when decoding began (perf_counter)

    # -- prefill ----------------------------------------------------------------------------
    def _chunk_ends(self, start: int, end: int, checkpoints: tuple[int, ...]) -> list[int]:
        grid = range((start // self.chunk_size + 1) * self.chunk_size, end, self.chunk_size)
        cuts = {*grid, *(c for c in checkpoints if start < c < end)}
        # In a long last chunk the last prompt token runs alone: only its output is needed now, so
        # the chunk before it computes caches only (see prefill), which skips the last layer's MLP
        # over the chunk. In a short one (a warm turn's appended tool result) that saving is
        # smaller than a second forward's fixed cost, so it runs whole.
        if end - 1 - max(cuts, default=start) >= SPLIT_LAST_FROM:
            cuts.add(end - 1)
        return sorted({*cuts, end})

    def prefill(self, start: StartPoint, checkpoints: tuple[int, ...], on_checkpoint: CheckpointHook | None,
                cancelled: Callable[[], bool] = lambda: False, yield_to: Callable[[], bool] | None = None) -> Iterator:
        """The prompt's state, one chunk per step: yields Restored, then PrefillProgress per chunk.
        `yield_to` (background work only): asked between layers whether a request waits; if so
        the chunk is undone and None is yielded (the caller steps aside), then the chunk is retried."""
        prompt = list(self.request.prompt)
        if start.state is not None:
            state = start.state
        else:
            state = TurnState(self.runner.new_trunk_cache(), self.runner.new_mtp_cache() if self.use_mtp else None, [])
        cached = state.length
        self.stats.cached_tokens = cached
        yield Restored(self.request.request_id, len(prompt), cached, start.source, start.anchor, start.ceiling, start.shortfall,
                       entry_id=start.entry_id, render_ahead=start.render_ahead, entry_origin=start.entry_origin)
        if cached >= len(prompt):  # nothing to compute: back off one token so there is a last hidden
            raise ValueError(f"start state holds {cached} tokens, more than the {len(prompt) - 1} a restore may cover")
        t0 = time.perf_counter()
        last_hidden = None
        # Recurrent layers that can keep their state at a position inside a forward (and attention
        # KV, a prefix) let a checkpoint fall inside a chunk; others end a forward there.
        # A sliding-window layer's state exists at a chunk's end only.
        inside = self.runner.can_capture and not self.runner.has_window
        for end in self._chunk_ends(cached, len(prompt), () if inside else checkpoints):
            while True:
                if cancelled():  # an abandoned request frees the engine within one chunk
                    self.finish_reason = "cancelled"
                    self.stats.prefill_s = time.perf_counter() - t0
                    if state.length > cached:  # what the finished chunks computed: a retry restores it
                        self.state, self.last_hidden, self.prefill_cut = state, last_hidden, state.length
                    return
                begin = state.length
                stops = [c - begin for c in checkpoints if begin < c < end] if on_checkpoint else []
                cache_state.set_stops(state.trunk, stops)
                try:
                    hidden = self._chunk(prompt, begin, end, state, yield_to)
                    break
                except preemption.SteppedAside:
                    yield None
            last_hidden = hidden[:, -1:, :]
            state.tokens.extend(prompt[begin:end])
            state.length = end
            for stop, recurrent in cache_state.take_stopped(state.trunk, stops).items():
                on_checkpoint(begin + stop, recurrent)
                self._hidden_before(begin + stop, hidden[:, stop - 1 : stop, :])
            if on_checkpoint and end in checkpoints:
                on_checkpoint(end, snapshot.checkpoint_arrays(state.trunk))
                self._hidden_before(end, last_hidden)
            self.partial = state
            yield PrefillProgress(self.request.request_id, end - cached, len(prompt) - cached)
        self.stats.prefill_s = time.perf_counter() - t0
        self.state = state
        self.last_hidden = last_hidden
        if self.request.prefill_only:  # no first token: the state ends where the prompt does
            self.finish_reason, self.prefill_cut = "length", state.length

    def _hidden_before(self, position: int, hidden: mx.array) -> None:
        if self.use_mtp:
            self.hidden_at[position] = mx.array(hidden)  # a copy: the chunk's hiddens are not kept

    def _chunk(self, prompt: list[int], begin: int, end: int, state: TurnState, yield_to) -> mx.array:
        """One prefill chunk (its hiddens, lazy past the last position); stepped aside from
        (preemption.SteppedAside), its caches are as before it."""
        threads = self.runner.small_forwards() if end - begin <= ONE_THREAD_UP_TO else contextlib.nullcontext()
        background = preemption.preemptible(yield_to) if yield_to is not None else contextlib.nullcontext()
        marked = preemption.marks(state.trunk) if yield_to is not None else None
        try:
            with threads, background:
                return self._prefill_chunk(prompt, begin, end, state)
        except preemption.SteppedAside:
            preemption.roll_back(state.trunk, marked)
            raise

    def _prefill_chunk(self, prompt: list[int], begin: int, end: int, state: TurnState):
        """Feed prompt[begin:end] to the trunk (and its pairs to the MTP head); evaluate the caches."""
        hidden = self.runner.hidden(prompt[begin:end], state.trunk)
        if self.request.prompt_logprobs is not None:  # position j scores prompt token j + 1
            targets = prompt[begin + 1 : end + 1]
            rows = hidden[0, : len(targets)]  # the prompt's last position scores the reply, not the prompt
            # in blocks: a chunk's logits over a 150k vocabulary would be ~0.6 GB per 1k positions
            for at in range(0, len(targets), SCORE_BLOCK):
                self.prompt_logprobs += of_positions(self.runner.logits(rows[at : at + SCORE_BLOCK]),
                                                     targets[at : at + SCORE_BLOCK], self.request.prompt_logprobs,
                                                     self.runner.checkpoint.tokenizer)
        if self.use_mtp and state.mtp is not None:
            # Pair each hidden with the prompt token after it; the last prompt position
            # pairs with the first generated token later. A restore may hand over one
            # pending hidden (position begin-1) whose pair is completed here.
            pairs = hidden if end < len(prompt) else hidden[:, :-1]
            first = begin + 1
            if state.mtp_pending is not None:
                pairs, first, state.mtp_pending = mx.concatenate([state.mtp_pending, pairs], axis=1), begin, None
            if pairs.shape[1]:
                appended = self.runner.extend_head(pairs, prompt[first : first + pairs.shape[1]], state.mtp)
                if not self.eager_mtp:
                    self.head_chunks.append(appended)
        # Only the caches must exist now. The trunk's output over the chunk feeds the MTP head's
        # KV, which stays lazy until the first draft (after the first token is out); of the last
        # chunk, the final position samples that token. Not forcing the rest skips the last
        # layer's MLP over the prompt, as mlx-lm's prefill does (a fifth of it on 4 layers).
        # Background work (render-ahead) has no first token to hurry, and a preemption copies its
        # state at the next chunk boundary: there the lazy head KV over every chunk so far would
        # be computed all at once while the arriving request waits. So it evaluates per chunk.
        eager = [state.mtp.state] if self.eager_mtp and state.mtp is not None and state.mtp.offset else []
        mx.eval([c.state for c in state.trunk if c is not None] + eager
                + ([hidden[:, -1:, :]] if end == len(prompt) else []))
        return hidden

    # -- decode -----------------------------------------------------------------------------
    def _emit(self, tokens: list[int]) -> Iterator:
        """Hand out generated tokens until a stop; sets finish_reason when one is met."""
        out: list[int] = []
        text = ""
        segment = self.segments.peek(tokens[0]) if tokens else "content"
        drawn, self.picked_logprobs = self.picked_logprobs, []  # one per token handed in (a pick, or a verify row)
        logprobs = []
        for i, token in enumerate(tokens):
            if token in self.eos_ids:
                self.finish_reason, self.stop_token = "stop", token
                break
            out.append(token)
            self.generated.append(token)
            kind = self.segments.segment_of(token)
            self.stats.tokens_by_segment[kind] += 1
            if i < len(drawn):
                logprobs.append(dataclasses.replace(drawn[i], segment=kind))
            text += self.stream.add(token)
            if self.stream.stopped:
                self.finish_reason = "stop"
                break
            if len(self.generated) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        self.logprobs += logprobs
        if out or text:
            yield Tokens(self.request.request_id, tuple(out), text, segment, self._split(text), logprobs=tuple(logprobs))

    def decode(self, cancelled: Callable[[], bool]) -> Iterator:
        """The whole decode alone: the first token, then one round (or AR step) at a time."""
        yield from self.first_token()
        while self.finish_reason is None:
            if cancelled():
                self.finish_reason = "cancelled"
                break
            yield from self.step()
        self.end_decode()

    def first_token(self, shared: bool = False) -> Iterator:
        """Sample the first token from the prefill's last hidden, then ready the decode state
        (the speculator, or the last token for AR steps). `shared`: other sequences run on the
        engine now (the scheduler's), so plain steps of this one alone would hold them all up."""
        self._t0 = time.perf_counter()
        first = self.pick(self.runner.logits(self.last_hidden)[0, -1])
        self.stats.ttft_s = time.monotonic() - self.submitted_at
        yield FirstToken(self.request.request_id, self.stats.ttft_s)
        shown = yield from self._emit_shown([first])
        tokens, hiddens = [first], [self.last_hidden]
        lazy_head = self.use_mtp and self.state.mtp is not None and self.state.mtp.offset
        # The MTP head's KV over the prompt is still lazy (see _prefill_chunk) and costs about a
        # layer's share of the prefill. When the first token shows the client nothing (a hidden
        # `<think>`, a chat-format marker), a few plain steps come first, so the first delta the
        # client sees never waits for that KV. Their hiddens join the head's pending pairs.
        # With other sequences running, a short prompt's head KV (one prefill chunk) goes at once
        # instead: each plain step here is one step of this sequence alone, while every other row
        # waits (a burst of four ~20-token prompts spent 2 ms a row on it), and the batched round
        # after it yields the visible token about as soon. Greedy only: a sampled reply's draws
        # follow the steps it takes, and it must draw alone what it draws in a batch.
        lead = not (shared and self.params.greedy and len(self.head_chunks) <= 1)
        while lead and lazy_head and not shown and self.finish_reason is None and len(tokens) <= HIDDEN_LEAD:
            token, hidden = self._ar_step(tokens[-1])
            tokens.append(token)
            hiddens.append(hidden)
            shown = yield from self._emit_shown(tokens[-1:])
        # A long prompt's head KV computed in one go would stop the stream for all of it (~70 ms
        # after a 3k-token prompt on the embedded models; a real model's last layer over a long
        # prompt takes far longer). So it is computed in stretches of whole prefill chunks of about
        # CATCH_UP_TOKENS, with a plain step between: tokens keep coming while it catches up, and
        # the plain steps (slower per token than drafting) stay few. The last chunk goes with the
        # rest, straight into drafting.
        while CATCH_UP and lazy_head and len(self.head_chunks) > 1 and self.finish_reason is None:
            t, done = time.perf_counter(), 0
            while len(self.head_chunks) > 1 and done < CATCH_UP_TOKENS:
                keys, values = self.head_chunks.pop(0)
                mx.eval(keys, values)
                done += keys.shape[-2]
            self.stats.mtp_prefill_s += time.perf_counter() - t
            token, hidden = self._ar_step(tokens[-1])
            tokens.append(token)
            hiddens.append(hidden)
            yield from self._emit(tokens[-1:])
        if lazy_head and self.finish_reason is None:
            t = time.perf_counter()
            mx.eval(self.state.mtp.state, list(self.hidden_at.values()))
            self.stats.mtp_prefill_s += time.perf_counter() - t
        self._t0 += self.stats.mtp_prefill_s  # timed on its own, so decode speed means decoding
        self.head_chunks = []
        if self.use_mtp:
            pending = hiddens[0] if len(hiddens) == 1 else mx.concatenate(hiddens, axis=1)
            predicted = Prediction(self.request.prediction) if self.request.prediction else None
            self.speculator = Speculator(self.runner, self.sampler, self.state, pending, tokens, self.stats,
                                         self.eos_ids, self.shape, self.mask, predicted, self.generated)
        elif self.request.prediction and not self.params.penalised:  # (a penalised pick needs each step on its own)
            self.follower = Speculator(self.runner, self.sampler, self.state, None, tokens, self.stats, self.eos_ids,
                                       self.shape, self.mask, Prediction(self.request.prediction), self.generated,
                                       head=False)
        self.last = tokens[-1]

    def _emit_shown(self, tokens: list[int]):
        """_emit, returning whether the client was shown anything (a piece of reply)."""
        shown = False
        for event in self._emit(tokens):
            shown = shown or bool(getattr(event, "pieces", ()))
            yield event
        return shown

    def draft_budget(self) -> int:
        """How many tokens this row may draft in the next round (never past max_tokens)."""
        return min(self.depth, max(1, self.params.max_tokens - len(self.generated) - 1))

    def step(self) -> Iterator:
        """One decode step of this sequence alone: an MTP round or one AR token."""
        room = min(PREDICTED_DEPTH, max(1, self.params.max_tokens - len(self.generated) - 1))  # for a predicted round
        if self.speculator is not None:
            yield from self.take_round(*self.speculator.round(self.draft_budget(), room))
        elif self.follower is not None and (drafts := self.follower.predicted_drafts(room)):
            self.follower.last = self.last  # AR steps moved on since its last round
            yield from self.take_round(*self.follower.predicted_round(drafts), self.follower)
        else:
            yield from self.take_tokens([self._ar_step(self.last)[0]])

    def take_round(self, new: list[int], drafts: list[int], accepted: int, speculator=None) -> Iterator:
        """The events of one verify round (alone or as one row of a batch)."""
        speculator = speculator or self.speculator
        if speculator.predicted:  # counted apart: acceptance by depth is the MTP head's
            self.picked_logprobs = list(speculator.last_logprobs)
            self.stats.verify_calls += 1
            self.stats.predicted_drafted += len(drafts)
            self.stats.predicted_accepted += accepted
            yield from self.take_tokens(new)
            return
        segments = self._segments_of(drafts)
        self.picked_logprobs = list(self.speculator.last_logprobs)  # each kept token's, from its verify row
        yield DraftVerified(self.request.request_id, len(drafts), accepted, segments[0])
        self.stats.record_verify(segments, accepted)
        yield from self.take_tokens(new)

    def take_tokens(self, new: list[int]) -> Iterator:
        yield from self._emit(new)
        self.last = new[-1]

    def end_decode(self) -> None:
        self.stats.decode_s = time.perf_counter() - self._t0
        self.stats.completion_tokens = len(self.generated)

    def _segments_of(self, drafts: list[int]) -> list[str]:
        """The segment each draft token would fall in (the tracker itself is not advanced)."""
        probe = copy.copy(self.segments)
        return [probe.segment_of(token) for token in drafts]

    def pick(self, logits: mx.array) -> int:
        t = time.perf_counter()
        if self.params.penalised:
            logits = apply_penalties(logits, self.params, self.request.prompt, self.generated)
        logits = self._ruled(logits, [])
        token = self.sampler.pick(logits)
        if self.params.logprobs is not None:
            from mtplx.engine.logprobs import of

            self.picked_logprobs.append(of(logits, token, self.params.logprobs, self.runner.checkpoint.tokenizer))
        self.stats.sample_s += time.perf_counter() - t
        return token

    def _ruled(self, logits: mx.array, drafted: list[int]) -> mx.array:
        """A position's logits under the request's rules; `drafted`: tokens after the generated ones."""
        return logits if self.rule is None else self.rule.apply(logits, self.generated + drafted)

    def _ar_step(self, last: int) -> tuple[int, mx.array]:
        """Feed `last`; the next token, and the hidden at `last`'s position (an MTP pair's half)."""
        t = time.perf_counter()
        logits, hidden = self.runner.step_logits([last], self.state.trunk)
        self.stats.verify_s += time.perf_counter() - t
        self.state.tokens.append(last)
        self.state.length += 1
        return self.pick(logits), hidden

    def feed_tail(self, tokens: list[int]) -> None:
        """After decoding: feed tokens that were sampled but never fed (the last one, EOS), and
        complete the MTP history, so the cache ends exactly where the turn did."""
        hidden = self.runner.hidden(tokens, self.state.trunk)
        self.state.tokens.extend(tokens)
        self.state.length += len(tokens)
        sp = self.speculator
        if sp is not None:
            pairs = mx.concatenate([sp.pending_hidden, hidden[:, :-1]], axis=1)
            self.runner.draft_hidden(pairs, sp.pending_tokens + tokens[1:], self.state.mtp)
            sp.pending_hidden, sp.pending_tokens = hidden[:, -1:], []
        self.last_hidden_at_end = hidden[:, -1:, :]
        mx.eval(hidden)

    def _split(self, text: str, final: bool = False) -> tuple[Piece, ...]:
        pieces = tuple(self.reply.feed(text, final))
        self.pieces.extend(pieces)
        return pieces

    def finish(self) -> Finished:
        tail = "" if self.stream.stopped else self.stream.flush()
        self._split(tail, final=True)  # the held-back end: in Finished.pieces only
        return Finished(
            self.request.request_id, self.finish_reason or "stop", len(self.request.prompt), len(self.generated),
            self.stats.cached_tokens, self.stream.text, tuple(self.generated), self.stats.freeze(),
            tuple(self.pieces), message(self.pieces), logprobs=tuple(self.logprobs), stop_sequence=self.stream.matched,
            prompt_logprobs=tuple(self.prompt_logprobs),
        ), tail


def events(gen: Generation, start: StartPoint, cancelled: Callable[[], bool],
           checkpoints: tuple[int, ...] = (), on_checkpoint: CheckpointHook | None = None) -> Iterator:
    """The whole request as a stream of events (the engine thread drives this)."""
    yield from gen.prefill(start, checkpoints, on_checkpoint, cancelled)
    if gen.finish_reason is None:
        yield from gen.decode(cancelled)
    finished, tail = gen.finish()
    if tail:
        yield Tokens(gen.request.request_id, (), tail, gen.segments.current)
    yield finished

