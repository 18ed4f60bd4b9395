"""Caches of several sequences decoded together: one buffer, one row per sequence.

Attention rows are *ragged*: row b holds its tokens at [0, lengths[b]), each forward writes a
row's new tokens at that row's own end, and an explicit mask hides every slot past it. So a row
is trimmed by lowering its length (a per-row rollback after a verify copies nothing) and rows of
different lengths need no padding shift. mlx-lm's BatchKVCache left-pads instead, which aligns
every row's end and turns a per-row trim into a roll of the whole buffer.

Recurrent (GatedDeltaNet) layers stay mlx-lm ArraysCaches: their state is naturally per row.

Moving between one-sequence caches and a batch copies each row once (`merge`, `split`): only when
a batch's membership changes, never per step. A change moves only the rows it concerns: a row
that joins is appended (`add_rows`), and rows that leave take copies of their own parts while
the batch's last rows move into the slots they free (`drop_rows`). The rows that stay are not
copied out and back in, which at agent context lengths is most of the bytes: re-merging four
rows of 16k tokens on tiny-dense moved ~7 rows' worth of KV for one leaving row.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

_STEP = 256  # buffer growth, in tokens (as KVCache grows)
# The ragged masks made lately, by id, with the rows' lengths they were made for: attention reads
# them (cpu_attention.attention) to run a long batch's rows one by one, each exactly as alone.
_MASKS: dict[int, tuple[mx.array, tuple[int, ...]]] = {}
_MASKS_KEPT = 8


def ragged_lengths(mask) -> tuple[int, ...] | None:
    """The rows' lengths before the forward's write, for a mask a RaggedKVCache made (else None):
    row b's queries sit at lengths[b] onwards and see its first lengths[b] + queries slots."""
    hit = _MASKS.get(id(mask))
    return hit[1] if hit is not None and hit[0] is mask else None


class RaggedKVCache:
    def __init__(self, keys: mx.array | None, values: mx.array | None, lengths: list[int], masks: list | None = None):
        # (slots, heads, capacity, dim): rows 0 .. len(lengths) - 1 are the batch's; a row that
        # left leaves its slot spare for the next to join (drop, add)
        self.keys, self.values = keys, values
        self.lengths = list(lengths)
        self.offset = mx.array(self.lengths)  # each row's position of its next token (RoPE reads it)
        # [key, mask] shared by the layers of one batch: every layer sees the same lengths, so a
        # forward builds its mask once, not once per layer (a decode step is dispatch-bound).
        self.masks = masks if masks is not None else [None, None]

    @classmethod
    def from_rows(cls, rows: list[KVCache], masks: list | None = None) -> "RaggedKVCache":
        lengths = [r.offset for r in rows]
        ref = next((r for r in rows if r.keys is not None), None)
        if ref is None:
            return cls(None, None, lengths, masks)
        cap = (max(lengths) // _STEP + 1) * _STEP
        _, heads, _, dk = ref.keys.shape
        dv = ref.values.shape[3]
        keys = mx.zeros((len(rows), heads, cap, dk), ref.keys.dtype)
        values = mx.zeros((len(rows), heads, cap, dv), ref.values.dtype)
        for b, r in enumerate(rows):
            if r.offset:
                keys[b : b + 1, :, : r.offset] = r.keys[..., : r.offset, :]
                values[b : b + 1, :, : r.offset] = r.values[..., : r.offset, :]
        return cls(keys, values, lengths, masks)

    def add(self, rows: list[KVCache]) -> None:
        """Append one-sequence caches as new rows: into spare slots in place where there are enough
        (a row that left freed one: an agent's next request takes it), else one concatenation of the
        batch's rows and the new ones (the buffer grows to the longest row first, if it must)."""
        if self.keys is None:  # no row holds a token yet: the new rows make the buffer
            joined = RaggedKVCache.from_rows([KVCache() for _ in self.lengths] + list(rows))
            self.keys, self.values = joined.keys, joined.values
        elif rows and len(self.lengths) + len(rows) <= self.keys.shape[0] and \
                max(r.offset for r in rows) <= self.keys.shape[2]:
            # into the slots rows that left freed, in place: the batch's rows are not copied
            for at, r in enumerate(rows, start=len(self.lengths)):
                if r.keys is not None and r.offset:
                    self.keys[at : at + 1, :, : r.offset] = r.keys[..., : r.offset, :]
                    self.values[at : at + 1, :, : r.offset] = r.values[..., : r.offset, :]
            mx.eval(self.keys, self.values)  # the rows' own buffers can go now
        elif rows:
            live = len(self.lengths)
            lengths = [r.offset for r in rows]
            need = max(self.lengths + lengths)
            cap = self.keys.shape[2] if need <= self.keys.shape[2] else (need // _STEP + 1) * _STEP

            def part(buffer: mx.array, mine: mx.array | None, n: int) -> mx.array:  # a new row, padded to cap
                if mine is None or not n:
                    return mx.zeros((1, buffer.shape[1], cap, buffer.shape[3]), buffer.dtype)
                return _pad_slots(mine[..., :n, :], cap)

            self.keys = mx.concatenate([_pad_slots(self.keys[:live], cap)] + [part(self.keys, r.keys, r.offset) for r in rows])
            self.values = mx.concatenate([_pad_slots(self.values[:live], cap)] +
                                         [part(self.values, r.values, r.offset) for r in rows])
        self.lengths = self.lengths + [r.offset for r in rows]
        self.offset = mx.array(self.lengths)

    def drop(self, leaving: list[int], order: list[int]) -> list[KVCache]:
        """Rows `leaving` as one-sequence caches (copies); the batch keeps the rows `order` names
        (order[i]: the old row now at i), each moved row copied into the slot a leaving row freed.
        Slots past a moved row's length keep the old row's values: the mask hides them. The slots
        past the kept rows stay in the buffer, spare (add fills them in place)."""
        out = [self.row(b) for b in leaving]
        if self.keys is None:  # no row holds a token: nothing to move
            self.lengths = [self.lengths[o] for o in order]
            self.offset = mx.array(self.lengths)
            return out
        moved = {i: o for i, o in enumerate(order) if o != i}
        parts = {o: (mx.contiguous(self.keys[o : o + 1, :, : self.lengths[o]]),
                     mx.contiguous(self.values[o : o + 1, :, : self.lengths[o]])) for o in moved.values()}
        # Every copy taken before the buffer is written: one still reading it would make the writes
        # copy the whole buffer (MLX writes in place only into an array nothing else refers to).
        mx.eval([a for c in out for a in c.state] + [a for kv in parts.values() for a in kv])
        for i, o in moved.items():
            n = self.lengths[o]
            self.keys[i : i + 1, :, :n] = parts[o][0]
            self.values[i : i + 1, :, :n] = parts[o][1]
        mx.eval(self.keys, self.values)  # the slots past the rows kept stay allocated, spare for a join
        self.lengths = [self.lengths[o] for o in order]
        self.offset = mx.array(self.lengths)
        return out

    def view(self, b: int) -> KVCache:
        """Row b as a one-sequence KVCache over the batch's buffer (no copy): for a copy taken at
        once (state/snapshot.py), never kept, since a view held across a step makes the next
        write copy the whole buffer."""
        out = KVCache()
        if self.keys is not None and self.lengths[b]:
            out.keys, out.values, out.offset = self.keys[b : b + 1], self.values[b : b + 1], self.lengths[b]
        return out

    def row(self, b: int) -> KVCache:
        """Row b as a one-sequence KVCache (a copy)."""
        out = KVCache()
        n = self.lengths[b]
        if self.keys is not None and n:
            out.keys = mx.contiguous(self.keys[b : b + 1, :, :n])
            out.values = mx.contiguous(self.values[b : b + 1, :, :n])
            out.offset = n
        return out

    # -- the protocol mlx-lm's attention layers use -------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, heads, S, _ = keys.shape
        need = max(self.lengths) + S
        slots_held = B if self.keys is None else self.keys.shape[0]
        if self.keys is None or need > self.keys.shape[2]:
            grow = (need // _STEP + 1) * _STEP - (0 if self.keys is None else self.keys.shape[2])
            new_k = mx.zeros((slots_held, heads, grow, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((slots_held, heads, grow, values.shape[3]), values.dtype)
            self.keys = new_k if self.keys is None else mx.concatenate([self.keys, new_k], axis=2)
            self.values = new_v if self.values is None else mx.concatenate([self.values, new_v], axis=2)
        # One scatter per buffer, whatever the batch size: a decode step is dispatch-bound on the
        # CPU, and a slice write per row was 2B ops per layer (put_along_axis broadcasts the
        # (B, 1, S, 1) slot indices over heads and dims).
        slots = (self.offset[:, None] + mx.arange(S)[None, :])[:, None, :, None]
        if slots_held > B:
            # Spare slots take zeros at their first positions: a scatter writes every slot, and one
            # into a view of the buffer would copy it whole (the buffer has another holder then).
            spare = slots_held - B
            keys = mx.pad(keys, [(0, spare), (0, 0), (0, 0), (0, 0)])
            values = mx.pad(values, [(0, spare), (0, 0), (0, 0), (0, 0)])
            slots = mx.concatenate([slots, mx.broadcast_to(mx.arange(S)[None, None, :, None], (spare, 1, S, 1))])
        self.keys = mx.put_along_axis(self.keys, slots, keys, axis=2)
        self.values = mx.put_along_axis(self.values, slots, values, axis=2)
        self.lengths = [n + S for n in self.lengths]
        self.offset = mx.array(self.lengths)
        return self.keys[:B, :, :need], self.values[:B, :, :need]

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **_) -> mx.array:
        """(B, 1, N, K) booleans for N new tokens per row: query j of row b sits at lengths[b] + j
        and sees the slots up to itself; slots past a row's end (another row's tokens) never."""
        if window_size is not None:
            raise ValueError("a ragged batch cache has no sliding window")
        key = (tuple(self.lengths), N)
        if self.masks[0] != key:
            keys = mx.arange(max(self.lengths) + N)[None, None, None, :]
            queries = mx.arange(N)[None, None, :, None]
            self.masks[:] = [key, keys <= self.offset[:, None, None, None] + queries]
            while len(_MASKS) >= _MASKS_KEPT:
                _MASKS.pop(next(iter(_MASKS)))
            _MASKS[id(self.masks[1])] = (self.masks[1], key[0])
        return self.masks[1]

    @property
    def state(self):
        return [a for a in (self.keys, self.values) if a is not None]

    def trim_rows(self, drops: list[int]) -> None:
        """Forget the last drops[b] tokens of each row b."""
        self.lengths = [n - d for n, d in zip(self.lengths, drops)]
        self.offset = mx.array(self.lengths)

    def trim(self, n: int) -> int:
        self.trim_rows([n] * len(self.lengths))
        return n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def merge(layers: list[list]) -> list:
    """One batched cache from one-sequence caches (`layers[b]` is row b's list of layer caches)."""
    out, masks = [], [None, None]
    for per_row in zip(*layers):
        if all(type(c) is KVCache for c in per_row):
            out.append(RaggedKVCache.from_rows(list(per_row), masks))
        elif all(type(c) is ArraysCache for c in per_row):
            merged = ArraysCache(len(per_row[0].cache))
            for i in range(len(merged.cache)):
                parts = [c.cache[i] for c in per_row]
                if all(p is not None for p in parts):
                    merged.cache[i] = mx.concatenate(parts, axis=0)
                elif any(p is not None for p in parts):
                    raise ValueError("recurrent rows differ in which arrays they hold; cannot batch them")
            out.append(merged)
        else:
            raise TypeError(f"cannot batch cache layers of types {sorted({type(c).__name__ for c in per_row})}")
    return out


def split(batched: list, rows: int) -> list[list]:
    """The inverse of merge: each row's one-sequence caches (copies)."""
    out = [[] for _ in range(rows)]
    for layer in batched:
        for b in range(rows):
            if isinstance(layer, RaggedKVCache):
                out[b].append(layer.row(b))
            else:
                out[b].append(_recurrent_row(layer, b))
    return out


def row_views(batched: list, b: int) -> list:
    """Row b of a batched cache as one-sequence layer caches over the batch's buffers (no copy;
    see RaggedKVCache.view)."""
    out = []
    for layer in batched:
        if isinstance(layer, RaggedKVCache):
            out.append(layer.view(b))
        else:
            out.append(_recurrent_row(layer, b, copy=False))
    return out


def leaving_order(rows: int, leaving: list[int]) -> list[int]:
    """The rows that stay after `leaving` go: order[i] is the old row now at i. A row keeps its
    slot unless that slot is past the new end; those fill the freed slots below it."""
    gone = set(leaving)
    keep = rows - len(gone)
    holes = [b for b in sorted(gone) if b < keep]
    movers = [b for b in range(keep, rows) if b not in gone]
    order = list(range(keep))
    for hole, mover in zip(holes, movers):
        order[hole] = mover
    return order


def drop_rows(batched: list, leaving: list[int]) -> tuple[list[list], list[int]]:
    """Rows `leaving` out of a batched cache: their one-sequence caches (copies, in `leaving`'s
    order), and the order of the rows that stay (`leaving_order`). The batch is compacted in place."""
    rows = next(len(layer.lengths) if isinstance(layer, RaggedKVCache) else layer.cache[0].shape[0]
                for layer in batched)
    order = leaving_order(rows, leaving)
    out = [[] for _ in leaving]
    for layer in batched:
        if isinstance(layer, RaggedKVCache):
            for mine, cache in zip(out, layer.drop(leaving, order)):
                mine.append(cache)
            continue
        for mine, b in zip(out, leaving):
            mine.append(_recurrent_row(layer, b))
        picks = mx.array(order)
        layer.cache = [None if a is None else a[picks] for a in layer.cache]
    mx.eval([a for row in out for c in row for a in layer_arrays(c)] + [a for layer in batched for a in layer_arrays(layer)])
    return out, order


def add_rows(batched: list, layers: list[list]) -> None:
    """Append one-sequence caches (`layers[r]`: new row r's list of layer caches) to a batched
    cache, in place: the rows already in it are not copied out and back."""
    for at, (layer, per_row) in enumerate(zip(batched, zip(*layers))):
        if isinstance(layer, RaggedKVCache) and all(type(c) is KVCache for c in per_row):
            layer.add(list(per_row))
        elif type(layer) is ArraysCache and all(type(c) is ArraysCache for c in per_row):
            for i, a in enumerate(layer.cache):
                parts = [c.cache[i] for c in per_row]
                if len({a is None, *(p is None for p in parts)}) > 1:
                    raise ValueError("recurrent rows differ in which arrays they hold; cannot batch them")
                if a is not None:
                    layer.cache[i] = mx.concatenate([a, *parts], axis=0)
        else:
            raise TypeError(f"cannot add rows of types {sorted({type(c).__name__ for c in per_row})} to layer {at}")


def layer_arrays(layer) -> list:
    """The arrays one layer's cache holds (attention keys and values, or recurrent state)."""
    if layer is None:
        return []
    if hasattr(layer, "keys"):
        return [a for a in (layer.keys, layer.values) if a is not None]
    return [a for a in layer.cache if a is not None]


def _recurrent_row(layer: ArraysCache, b: int, copy: bool = True) -> ArraysCache:
    """Row b of a batched recurrent layer as a one-sequence cache: a copy, or views (`copy`
    False: for a copy taken at once, as RaggedKVCache.view)."""
    single = ArraysCache(len(layer.cache))
    single.cache = [None if a is None else (mx.contiguous(a[b : b + 1]) if copy else a[b : b + 1]) for a in layer.cache]
    return single


def _pad_slots(array: mx.array, cap: int) -> mx.array:
    """A (B, heads, slots, dim) buffer right-padded with zero slots to `cap`."""
    if array.shape[2] == cap:
        return array
    return mx.pad(array, [(0, 0), (0, 0), (0, cap - array.shape[2]), (0, 0)])


def batchable(cache: list) -> bool:
    """Whether a one-sequence cache list can join a batch (plain attention and recurrent layers)."""
    return all(type(c) in (KVCache, ArraysCache) for c in cache)


def keep_rows(cache: list, fed: int, kept: list[int]) -> None:
    """After a capturing verify of `fed` tokens per row, keep the first kept[b] of row b's."""
    for layer in cache:
        if isinstance(layer, RaggedKVCache):
            layer.trim_rows([fed - k for k in kept])
        elif isinstance(layer, ArraysCache):
            if any(k < fed for k in kept):
                conv = mx.concatenate([layer.positions[k - 1][0][b : b + 1] for b, k in enumerate(kept)])
                rec = mx.concatenate([layer.positions[k - 1][1][b : b + 1] for b, k in enumerate(kept)])
                layer.cache[0], layer.cache[1] = conv, rec
            layer.positions = None
            layer.capture = False
