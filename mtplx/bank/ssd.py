"""The bank's SSD tier: entries as safetensors files plus a SQLite manifest, under
$MTPLX_HOME/bank/ by default.

Writes are atomic: a temp file in the same directory, fsync, rename, then the manifest row; a
crash at any point leaves either a complete entry or debris that `open` removes (temp files,
files without a row, rows without a file). Every load is validated (format version, model
identity, token count, whole-file checksum); a file that fails is deleted, never served.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtplx.bank.anchors import Anchor
from mtplx.bank.plan import EntryView
from mtplx.errors import MtplxError

log = logging.getLogger("mtplx.bank.ssd")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class StagedWrite:
    """An entry ready to be written: the safetensors header and host views of its arrays, which
    stay valid while `entry` (which owns the arrays) is held here."""

    entry: object
    name: str
    header: bytes
    buffers: list

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(b.nbytes for b in self.buffers)


@functools.cache
def _safetensors_dtypes() -> dict:
    """MLX dtype -> safetensors dtype name (built on first use: this module imports no MLX at load)."""
    import mlx.core as mx

    return {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64", mx.int8: "I8",
            mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32",
            mx.uint64: "U64", mx.bool_: "BOOL"}


class CorruptEntry(Exception):
    """A persisted entry failed validation (the message says how); it has been deleted."""


class BankInUse(MtplxError):
    """Another live process owns this bank directory (its writes and crash clean-up are its own)."""


@dataclass(frozen=True)
class SsdConfig:
    root: Path
    budget_bytes: int
    free_floor_bytes: int = 1 << 30

    @classmethod
    def default(cls, root: Path | None = None, budget_bytes: int | None = None) -> "SsdConfig":
        """Under $MTPLX_HOME/bank; without a budget, a tenth of the free disk (256 MiB..20 GiB).
        Nothing is created here: a directory that cannot be made degrades the bank when opened."""
        from mtplx.home import mtplx_home

        root = Path(root) if root else mtplx_home() / "bank"
        if budget_bytes is None:
            probe = next((p for p in (root, *root.parents) if p.exists()), Path("/"))
            budget_bytes = max(256 << 20, min(20 << 30, shutil.disk_usage(probe).free // 10))
        return cls(root, budget_bytes=budget_bytes)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class SsdTier:
    def __init__(self, config: SsdConfig, owner: bool = True):
        """`owner`: this process writes the tier and cleans up crash debris, holding an exclusive
        lock on the directory for its lifetime (released by the kernel even on kill -9); a second
        owner is refused with BankInUse, since its start-up clean-up would delete the first one's
        files mid-write. `owner=False` only reads (`mtplx bank ls`, `stats` beside a running server)."""
        self.config = config
        self.root = config.root
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock() if owner else None
        try:
            self.db = self._open_manifest()
        except sqlite3.OperationalError:
            raise  # locked, read-only, I/O: the manifest may be fine, so never wipe it (the bank goes RAM-only)
        except sqlite3.DatabaseError as exc:  # a damaged manifest: the entries are only a cache, start over
            log.warning("bank manifest %s is unreadable (%s); discarding the SSD tier's entries", self.root, exc)
            for path in self.root.iterdir():
                if path.name.startswith("manifest.db") or path.suffix == ".safetensors" or path.name.startswith(".tmp-"):
                    path.unlink(missing_ok=True)
            self.db = self._open_manifest()
        if owner:
            self.reconcile()
            self.enforce_budget()  # a crash between a row and its eviction pass can leave the tier over budget

    def _take_lock(self):
        import fcntl

        handle = (self.root / ".lock").open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise BankInUse(f"bank directory {self.root} is in use by {holder}; give each server its own "
                            f"MTPLX_HOME, or stop the other one") from None
        handle.truncate(0)
        handle.write(f"mtplx pid {os.getpid()}")
        handle.flush()
        return handle

    def close(self) -> None:
        self.db.close()
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def _open_manifest(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.root / "manifest.db"), isolation_level=None, check_same_thread=False, timeout=5)
        try:
            self._create(db)
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    @staticmethod
    def _create(db: sqlite3.Connection) -> None:
        db.execute("pragma journal_mode = wal")
        db.execute("""create table if not exists entries (
            entry_id text primary key, file text, identity text, token_count integer, tokens blob, nbytes integer,
            checksum text, version integer, session text, created real, last_used real, anchors text,
            restorable text, mtp_len integer, has_last_hidden integer)""")
        db.execute("select count(*) from entries").fetchone()  # reads a page: a garbage file fails here

    # -- housekeeping -----------------------------------------------------------------------
    def reconcile(self) -> dict:
        """Remove what a crash can leave: temp files, files without a row, rows without a file."""
        removed = {"temp": 0, "orphan_files": 0, "orphan_rows": 0}
        files = {row[0] for row in self.db.execute("select file from entries")}
        for path in self.root.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)
                removed["temp"] += 1
            elif path.suffix == ".safetensors" and path.name not in files:
                path.unlink(missing_ok=True)
                removed["orphan_files"] += 1
        removed["invalid"] = 0
        for file, identity, count in list(self.db.execute("select file, identity, token_count from entries")):
            if not (self.root / file).is_file():
                self.db.execute("delete from entries where file = ?", (file,))
                removed["orphan_rows"] += 1
            elif not self._header_agrees(self.root / file, identity, count):
                self.db.execute("delete from entries where file = ?", (file,))
                (self.root / file).unlink(missing_ok=True)
                removed["invalid"] += 1
        return removed

    @staticmethod
    def _header_agrees(path: Path, identity: str, count: int) -> bool:
        """Cheap open-time check (header only): format version, identity and token count match the
        manifest. Full checksums are verified when an entry is loaded."""
        from mtplx.catalog import safetensors_header_metadata

        try:
            meta = safetensors_header_metadata(path)
        except Exception:  # unreadable header: the file is damaged
            return False
        return (meta.get("format_version") == str(FORMAT_VERSION) and meta.get("identity") == identity
                and meta.get("token_count") == str(count))

    def views(self, exclude: set[str] = frozenset()) -> list[EntryView]:
        out = []
        for row in self.db.execute("select entry_id, tokens, identity, restorable, mtp_len, has_last_hidden, session, "
                                   "last_used, nbytes, anchors from entries"):
            if row[0] in exclude:
                continue
            tokens = np.frombuffer(row[1], dtype=np.int32).astype(np.int64)
            restorable = json.loads(row[3])
            out.append(EntryView(row[0], tuple(tokens.tolist()), row[2], tuple(restorable) if restorable is not None else None,
                                 row[4], bool(row[5]), row[6], row[7], row[8],
                                 tuple(Anchor(p, k) for p, k in json.loads(row[9])), tokens))
        return out

    def stats(self) -> dict:
        count, total = self.db.execute("select count(*), coalesce(sum(nbytes), 0) from entries").fetchone()
        return {"entries": count, "bytes": total, "budget_bytes": self.config.budget_bytes,
                "free_bytes": shutil.disk_usage(self.root).free, "root": str(self.root)}

    def delete(self, entry_id: str) -> None:
        row = self.db.execute("select file from entries where entry_id = ?", (entry_id,)).fetchone()
        self.db.execute("delete from entries where entry_id = ?", (entry_id,))
        if row:
            (self.root / row[0]).unlink(missing_ok=True)

    def clear(self) -> int:
        ids = [r[0] for r in self.db.execute("select entry_id from entries")]
        for entry_id in ids:
            self.delete(entry_id)
        self.reconcile()
        return len(ids)

    def enforce_budget(self, keep: str | None = None) -> list[str]:
        """Drop least recently used entries while over the byte cap or under the free-disk floor."""
        dropped = []
        rows = list(self.db.execute("select entry_id, nbytes from entries order by last_used"))
        total = sum(n for _, n in rows)
        for entry_id, nbytes in rows:
            floor_ok = shutil.disk_usage(self.root).free >= self.config.free_floor_bytes
            if total <= self.config.budget_bytes and floor_ok:
                break
            if entry_id == keep:
                continue
            self.delete(entry_id)
            dropped.append(entry_id)
            total -= nbytes
        return dropped

    def make_room(self, size: int) -> list[str] | None:
        """Drop least recently used entries so a file of `size` bytes fits the budget and leaves
        the free floor (bank/plan.py's plan_room); the ids dropped, or None (nothing dropped)
        when it cannot fit. Engine thread, before a write."""
        from mtplx.bank.plan import plan_room

        stored = [(i, n) for i, n in self.db.execute("select entry_id, nbytes from entries order by last_used")]
        dropped = plan_room(stored, size, self.config.budget_bytes, shutil.disk_usage(self.root).free,
                            self.config.free_floor_bytes)
        for entry_id in dropped or ():
            self.delete(entry_id)
        return dropped

    # -- write ------------------------------------------------------------------------------
    # A write is three steps so the slow part leaves the engine thread: `stage` (engine thread:
    # the entry's arrays as host-memory views and the safetensors header), `write_file` (any
    # thread: the file itself, fsync, rename, its checksum; no MLX, no SQLite) and `record`
    # (engine thread: the manifest row, the budget). The order on disk is as before: a complete
    # file, then its row, so a crash between them leaves an orphan file that `reconcile` removes.
    def write(self, entry) -> None:
        """Persist one RAM entry, every step on this thread (shutdown flush, tests)."""
        staged = self.stage(entry)
        self.record(staged, *self.write_file(staged))

    def stage(self, entry) -> "StagedWrite":
        """The entry as bytes to write: host views of its (evaluated) arrays, no copy where they
        are contiguous. Engine thread."""
        import mlx.core as mx

        arrays, layers = {}, []
        for i, snap in enumerate(entry.trunk):
            layers.append([snap.kind, snap.offset, [a is not None for a in snap.arrays]])
            for j, a in enumerate(snap.arrays):
                if a is not None:
                    arrays[f"t{i}_{j}"] = a
        for pos, per_layer in entry.checkpoints.items():
            for i, layer in enumerate(per_layer):
                for j, a in enumerate(layer or ()):
                    if a is not None:
                        arrays[f"c{pos}_{i}_{j}"] = a
        if entry.mtp is not None:
            arrays["mtp_k"], arrays["mtp_v"] = entry.mtp.arrays
        if entry.last_hidden is not None:
            arrays["last_hidden"] = entry.last_hidden
        arrays["tokens"] = mx.array(np.asarray(entry.tokens, dtype=np.int32))
        meta = {"format_version": str(FORMAT_VERSION), "identity": entry.identity, "token_count": str(len(entry.tokens)),
                "layers": json.dumps(layers), "checkpoints": json.dumps(sorted(entry.checkpoints)),
                "mtp_len": str(entry.mtp_len if entry.mtp_len is not None else -1)}
        # numpy has no bfloat16: such arrays travel as their 16-bit patterns, named BF16 in the header
        host = {k: (a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for k, a in arrays.items()}
        mx.eval(list(host.values()))
        buffers, header, offset = [], {"__metadata__": meta}, 0
        for key, a in host.items():
            view = np.ascontiguousarray(np.asarray(a))
            header[key] = {"dtype": _safetensors_dtypes()[arrays[key].dtype], "shape": list(a.shape),
                           "data_offsets": [offset, offset + view.nbytes]}
            buffers.append(view)
            offset += view.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned (the format allows trailing spaces)
        return StagedWrite(entry, f"{entry.entry_id}.safetensors", len(text).to_bytes(8, "little") + text, buffers)

    def write_file(self, staged: "StagedWrite") -> tuple[int, str]:
        """Write, fsync and rename the file into place; (its size, its sha256). No MLX and no
        SQLite here: it may run on an I/O thread while the engine computes."""
        tmp = self.root / f".tmp-{staged.name}"
        digest, size = hashlib.sha256(), 0
        try:
            with tmp.open("wb") as fh:
                for part in (staged.header, *staged.buffers):
                    data = memoryview(part).cast("B")
                    fh.write(data)
                    digest.update(data)
                    size += data.nbytes
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.root / staged.name)
        except BaseException:  # a failed write (full or read-only disk) leaves no half file behind
            tmp.unlink(missing_ok=True)
            raise
        return size, digest.hexdigest()

    def discard(self, staged: "StagedWrite") -> None:
        """Remove a written file that will get no row (its entry was dropped meanwhile)."""
        (self.root / staged.name).unlink(missing_ok=True)

    def record(self, staged: "StagedWrite", size: int, checksum: str) -> None:
        """The manifest row of a written file, then the budget. Engine thread."""
        entry = staged.entry
        view = entry.view()
        self.db.execute("insert or replace into entries values (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", (
            entry.entry_id, staged.name, entry.identity, len(entry.tokens), np.asarray(entry.tokens, dtype=np.int32).tobytes(),
            size, checksum, FORMAT_VERSION, entry.session, entry.created,
            time.time(), json.dumps([[a.position, a.kind] for a in entry.anchors]),
            json.dumps(list(view.restorable) if view.restorable is not None else None),
            entry.mtp_len, int(entry.last_hidden is not None)))
        self.enforce_budget(keep=entry.entry_id)

    # -- read -------------------------------------------------------------------------------
    def load(self, entry_id: str, identity: str):
        """The entry, validated; on any failure the files are deleted and CorruptEntry raised."""
        import mlx.core as mx

        from mtplx.bank.entry import Entry
        from mtplx.state.snapshot import LayerSnapshot

        row = self.db.execute("select file, checksum, token_count, identity, tokens, session, created, anchors "
                              "from entries where entry_id = ?", (entry_id,)).fetchone()
        if row is None:
            raise CorruptEntry(f"{entry_id}: not in the manifest")
        file, checksum, count, row_identity, token_blob, session, created, anchors = row
        path = self.root / file
        try:
            if row_identity != identity:
                raise CorruptEntry(f"{file}: written for model {row_identity}, not {identity}")
            if not path.is_file() or path.stat().st_size == 0:
                raise CorruptEntry(f"{file}: missing or empty")
            if _sha256(path) != checksum:
                raise CorruptEntry(f"{file}: checksum mismatch (truncated or altered)")
            try:
                arrays, meta = mx.load(str(path), return_metadata=True)
            except Exception as exc:  # mlx reports unreadable files with several exception types
                raise CorruptEntry(f"{file}: unreadable ({type(exc).__name__})") from exc
            if meta.get("format_version") != str(FORMAT_VERSION):
                raise CorruptEntry(f"{file}: format version {meta.get('format_version')}, expected {FORMAT_VERSION}")
            if meta.get("identity") != identity or int(meta.get("token_count", -1)) != count:
                raise CorruptEntry(f"{file}: header does not match the manifest (identity or token count)")
            tokens = tuple(np.frombuffer(token_blob, dtype=np.int32).tolist())
            if tuple(np.array(arrays["tokens"]).tolist()) != tokens:
                raise CorruptEntry(f"{file}: tokens differ from the manifest")
            trunk = []
            for i, (kind, offset, present) in enumerate(json.loads(meta["layers"])):
                trunk.append(LayerSnapshot(kind, tuple(arrays.get(f"t{i}_{j}") if p else None for j, p in enumerate(present)), offset))
            checkpoints = {}
            for pos in json.loads(meta["checkpoints"]):
                checkpoints[pos] = [None if s.kind in ("kv", "list") else tuple(arrays.get(f"c{pos}_{i}_{j}") for j in range(len(s.arrays)))
                                    for i, s in enumerate(trunk)]
            mtp_len = int(meta["mtp_len"])
            mtp = LayerSnapshot("kv", (arrays["mtp_k"], arrays["mtp_v"]), mtp_len) if mtp_len >= 0 and "mtp_k" in arrays else None
        except CorruptEntry:
            self.delete(entry_id)
            raise
        except (KeyError, ValueError, TypeError, json.JSONDecodeError) as exc:
            self.delete(entry_id)
            raise CorruptEntry(f"{file}: malformed ({type(exc).__name__}: {exc})") from exc
        self.db.execute("update entries set last_used = ? where entry_id = ?", (time.time(), entry_id))
        return Entry(tokens, identity, trunk, checkpoints, mtp, arrays.get("last_hidden"),
                     [Anchor(p, k) for p, k in json.loads(anchors)], session, entry_id=entry_id, created=created)
