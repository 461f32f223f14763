"""Prompt-prefix caches on disk, so a restart does not lose an agent's warm prefix.

Each rank keeps its own caches (MLA latents, KDA recurrent and conv states: mlx-lm's
``save_prompt_cache`` of the rank's ``make_cache()`` list) in
``<folder>/<identity>/rank<r>-of-<n>/``: one ``<key>.safetensors`` per prefix and a
``<key>.json`` beside it holding the prefix's tokens, the deployment identity, the
file's size and SHA-256, the bytes the entry is accounted at and its last use. The
key hashes the tokens with the identity (build hash, placement hash, attention mode,
dtype, rank, size); a folder of another build or placement is another ``identity``
subfolder and is never read, and so is one made by another k3dist, mlx or mlx-lm version
(an upgrade may change the cache's layout or numbers). Every file is written as
``.partial`` then renamed; the sidecar is renamed last, so an entry exists only once both
are whole.

Writes run off the lockstep loop: a real K3 entry of 20K tokens is 0.79 GB a rank, which
written in the loop would pause every request decoding beside it. ``save`` takes a
snapshot of the cache's arrays (evaluated there: MLX arrays are immutable once evaluated,
and the reference held keeps mlx-lm's later in-place updates from reusing their buffers),
settles the entry's bytes and the eviction with the other ranks, and hands the snapshot to
this rank's writer thread (a bounded queue; when it is full on any rank, no rank keeps the
entry). An entry is served only once its writer has renamed it into place: a lookup that
meets an entry still being written on some rank is a miss on every rank (the lengths the
ranks verified differ).

Lockstep: a prompt-cache hit decides what each rank prefills, so all ranks must hit
the same prefix or none does (a hit on one rank and a miss on another would
desynchronise every later collective). ``lookup`` therefore loads and checks this
rank's longest matching entry (size, SHA-256, identity, token count in the file), then
``all_gather``s its length: only when every rank holds the same verified length is it
used, else no rank uses any (a corrupt or missing entry on one rank is a miss on all).
``save`` runs at the same request and token on every rank (the prompt cache calls it
from the lockstep loop) and ``all_gather``s (bytes, queued, held): the entry is accounted
at the largest rank's in-memory bytes, so the byte bound (LRU by a use counter that every
rank advances alike) evicts the same entries everywhere; an entry some rank could not
queue is kept by none. A write that fails later (a full disk) leaves the entry accounted
but unreadable on that rank: its lookups are misses on all ranks, and the next save of
the same prefix writes it again there.

A stop (``drain``: the watchdog's SIGTERM stop on every rank, and the server's clean
stop) takes no new entry and waits at most ``drain_s`` for this rank's writer to finish
the queued ones; what is not on disk by then is abandoned (its ``.partial`` file is
swept at the next start) and the process exits anyway. Every rank applies the same rule
with the same bound; an entry that one rank finished and another abandoned is whole on
one rank only, which the next start's ``lookup`` treats as a miss on every rank (the
verified lengths differ), and the next save of that prefix writes it again where it is
missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from queue import Full, Queue
from typing import Any

import k3dist

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

FORMAT = 2  # sidecar format (2: SHA-256 over 64 MiB pieces): another version is stale
# Snapshots waiting for this rank's writer: each holds a whole entry in memory (0.79 GB a
# rank for a real K3 20K-token prefix); past this, a new entry is not kept (on any rank).
WRITE_QUEUE = 2
# How long a stop waits for the writer by default (deployment ``prefix_cache_drain_s``):
# two queued real K3 entries (2 x 0.79 GB) written at 5 GB/s and hashed take ~0.5 s.
DRAIN_S = 3.0


def software() -> str:
    """The versions that make a cache's tensors: another one reads another subfolder."""
    return f"k3dist {k3dist.__version__}, mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}"


@dataclass(frozen=True)
class Identity:
    """What a cached prefix is valid for: the same tokens under another build, placement,
    attention layout, dtype or rank give other tensors."""

    build_hash: str
    placement_hash: str
    attention: str
    dtype: str
    rank: int
    size: int
    software: str = field(default_factory=software)

    def folder(self) -> str:
        shared = {k: v for k, v in asdict(self).items() if k != "rank"}
        digest = hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]
        return f"{digest}/rank{self.rank}-of-{self.size}"


def prefix_key(tokens: list[int] | tuple[int, ...], ident: Identity) -> str:
    """The entry's name: SHA-256 of the identity (rank aside) and the token ids."""
    shared = {k: v for k, v in asdict(ident).items() if k != "rank"}
    h = hashlib.sha256(json.dumps(shared, sort_keys=True).encode())
    h.update(b"\0")
    h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return h.hexdigest()[:32]


# The check of an entry: SHA-256 of each 64 MiB piece, on HASH_THREADS threads (hashlib
# releases the GIL), then SHA-256 of those digests; one core's SHA-256 would be most of
# a real 0.79 GB restore.
HASH_PIECE = 64 << 20
HASH_THREADS = 8


def _piece_sha256(path: Path, start: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return hashlib.sha256(f.read(HASH_PIECE)).digest()


def file_sha256(path: Path, threads: int = HASH_THREADS) -> str:
    """The entry's digest: SHA-256 over its pieces' SHA-256s, pieces hashed in parallel."""
    starts = range(0, max(Path(path).stat().st_size, 1), HASH_PIECE)
    with ThreadPoolExecutor(min(threads, len(starts))) as pool:
        digests = pool.map(lambda s: _piece_sha256(path, s), starts)
        return hashlib.sha256(b"".join(digests)).hexdigest()


@dataclass
class Entry:
    key: str
    tokens: tuple[int, ...]
    file_bytes: int
    sha256: str
    bytes: int  # accounted (the largest rank's): what the bound counts
    used: int  # use counter: the same on every rank
    state: str = "ready"  # or "writing" (queued, not yet renamed), "failed" (this rank)


def snapshot(cache: list[Any]) -> list[Any]:
    """A copy of ``cache`` that shares its evaluated, contiguous arrays (nothing the
    lockstep loop does later changes them): what the writer thread saves."""
    out = []
    for c in cache:
        frozen = type(c).__new__(type(c))
        frozen.state = tree_map(
            lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x, c.state
        )
        out.append(frozen)
    mx.eval([c.state for c in out])
    return out


def _nbytes(cache: list[Any]) -> int:
    return sum(
        x.nbytes for _, x in tree_flatten([c.state for c in cache]) if isinstance(x, mx.array)
    )


def _write_json(path: Path, obj: dict) -> None:
    part = path.with_name(path.name + ".partial")
    part.write_text(json.dumps(obj))
    os.replace(part, path)


class PrefixStore:
    """One rank's bounded folder of prefix caches (see the module's docstring)."""

    def __init__(
        self,
        root: str | Path,
        ident: Identity,
        max_bytes: int,
        min_tokens: int = 1024,
        group: mx.distributed.Group | None = None,
        drain_s: float = DRAIN_S,
    ):
        if max_bytes <= 0:
            raise ValueError(f"prefix cache bound must be positive, not {max_bytes} bytes")
        if drain_s < 0:
            raise ValueError(f"prefix cache drain bound must be >= 0 s, not {drain_s}")
        self.root = Path(root)
        self.ident, self.max_bytes, self.min_tokens = ident, max_bytes, min_tokens
        self.drain_s = drain_s
        self.group = group
        self.dir = self.root / ident.folder()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, Entry] = {}
        self.skipped: dict[str, str] = {}  # key -> why (stale, corrupt) at scan
        self.swept: list[str] = []  # files of interrupted writes removed at scan
        self.stats = {
            "hits": 0,
            "misses": 0,
            "disagreed": 0,
            "saved": 0,
            "evicted": 0,
            "corrupt": 0,
            "dropped": 0,
            "write_failed": 0,
            "restore_s": [],
            "save_s": [],
            "write_s": [],
            "writes": [],  # [wall-clock start, seconds] of each write (the last 64)
        }
        # entries and their files are changed by the lockstep loop and the writer thread
        self._lock = threading.Lock()
        self._jobs: Queue[Callable[[], None] | None] = Queue(WRITE_QUEUE)
        self._pending = 0  # entries queued and not yet written (or failed)
        self._idle = threading.Condition()  # notified as _pending falls
        self._closing = False  # a stop began: no new entry is queued
        self._writer = threading.Thread(
            target=self._write_loop, daemon=True, name=f"prefix-writer-rank{ident.rank}"
        )
        self._scan()
        self._writer.start()

    # ---------------------------------------------------------------- index

    def _scan(self) -> None:
        for part in sorted(self.dir.glob("*.partial*")):  # an interrupted write
            part.unlink(missing_ok=True)
            self.swept.append(part.name)
        for side in sorted(self.dir.glob("*.json")):
            key = side.stem
            try:
                meta = json.loads(side.read_text())
                why = self._stale(meta, key)
            except (OSError, ValueError) as e:
                why = f"unreadable sidecar ({e})"
            if why:
                self.skipped[key] = why
                logging.warning("prefix cache %s: skipped (%s)", side, why)
                continue
            self.entries[key] = Entry(
                key,
                tuple(meta["tokens"]),
                meta["file_bytes"],
                meta["sha256"],
                meta["bytes"],
                meta["used"],
            )
        for f in self.dir.glob("*.safetensors"):  # data without a sidecar: never whole
            if f.stem not in self.entries and f.stem not in self.skipped:
                f.unlink(missing_ok=True)
                self.swept.append(f.name)

    def _stale(self, meta: dict, key: str) -> str | None:
        if meta.get("format") != FORMAT:
            return f"format {meta.get('format')} is not {FORMAT}"
        if meta.get("identity") != asdict(self.ident):
            return f"made for {meta.get('identity')}, not {asdict(self.ident)}"
        if prefix_key(meta["tokens"], self.ident) != key:
            return "its tokens do not hash to its name"
        data = self.dir / f"{key}.safetensors"
        if not data.exists() or data.stat().st_size != meta["file_bytes"]:
            return f"{data.name} is missing or not {meta['file_bytes']} bytes"
        return None

    def total_bytes(self) -> int:
        return sum(e.bytes for e in list(self.entries.values()))  # read by the HTTP thread

    def key(self, tokens: list[int]) -> str:
        return prefix_key(tokens, self.ident)

    def has(self, tokens: list[int]) -> bool:
        return self.key(tokens) in self.entries

    def _clock(self) -> int:
        return max((e.used for e in self.entries.values()), default=0) + 1

    def _remove(self, key: str) -> None:
        with self._lock:  # a write in flight finds its entry gone and drops its file
            self.entries.pop(key, None)
            (self.dir / f"{key}.json").unlink(missing_ok=True)
            (self.dir / f"{key}.safetensors").unlink(missing_ok=True)

    def _touch(self, e: Entry) -> None:
        e.used = self._clock()
        with self._lock:
            if e.state == "ready":  # else the writer writes the sidecar with this use
                self._write_sidecar(e)

    # ---------------------------------------------------------------- the writer

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            finally:
                job = None  # the snapshot's memory goes now, not at the next entry
                self._jobs.task_done()

    def _write_queued(self, e: Entry, frozen: list[Any]) -> None:
        """The writer thread's job for one entry ``save`` queued (counted in _pending)."""
        try:
            self._write(e, frozen)
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _write(self, e: Entry, frozen: list[Any]) -> None:
        """The writer thread: ``frozen`` (a snapshot) to ``<key>.partial``, renamed into
        place, then the sidecar; an entry evicted meanwhile leaves no file."""
        t0, wall = time.perf_counter(), time.time()
        data = self.dir / f"{e.key}.safetensors"
        part = self.dir / f"{e.key}.partial.safetensors"
        try:
            save_prompt_cache(str(part), frozen, {"tokens": str(len(e.tokens)), "key": e.key})
            size, digest = part.stat().st_size, file_sha256(part)
        except Exception as ex:  # noqa: BLE001 - a full disk must not stop serving
            logging.warning("prefix cache: could not write %s (%s)", data, ex)
            part.unlink(missing_ok=True)
            with self._lock:
                e.state = "failed"
                self.stats["write_failed"] += 1
            return
        with self._lock:
            if self.entries.get(e.key) is not e:  # evicted while it was written
                part.unlink(missing_ok=True)
                return
            os.replace(part, data)
            e.file_bytes, e.sha256, e.state = size, digest, "ready"
            self._write_sidecar(e)
            took = time.perf_counter() - t0
            self.stats["write_s"].append(round(took, 4))
            self.stats["writes"] = [*self.stats["writes"][-63:], [round(wall, 4), round(took, 4)]]

    def flush(self) -> None:
        """Wait until every queued entry is on disk (or failed)."""
        self._jobs.join()

    def drain(self, timeout_s: float | None = None) -> dict:
        """A stop: queue no new entry, then wait at most ``timeout_s`` (default
        ``drain_s``) for the writer to finish the queued ones. Returns (and logs) how
        many were written and how many abandoned; an abandoned write leaves only a
        ``.partial`` file, which the next start sweeps. Never waits past the bound."""
        bound = self.drain_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        self._closing = True
        with self._idle:
            before = self._pending
            while self._pending and (left := t0 + bound - time.monotonic()) > 0:
                self._idle.wait(left)
            left_over = self._pending
        took = time.monotonic() - t0
        out = {"queued": before, "written": before - left_over, "abandoned": left_over}
        out["s"] = round(took, 3)
        if before:
            what = (
                f"abandoned {left_over} of {before} queued entries after {bound:g} s "
                "(their partial files are swept at the next start)"
                if left_over
                else f"{before} queued entries written in {took:.3f} s"
            )
            print(
                f"k3dist: prefix cache stop (rank {self.ident.rank}): {what}",
                file=sys.stderr,
                flush=True,
            )
        return out

    def close(self, timeout_s: float | None = None) -> dict:
        """Finish the queued writes (within the drain bound) and stop the writer (the
        server's clean shutdown)."""
        out = self.drain(timeout_s)
        if self._writer.is_alive() and not out["abandoned"]:
            try:
                self._jobs.put_nowait(None)
            except Full:  # cannot be: nothing is pending; the daemon ends with us anyway
                return out
            self._writer.join(max(0.0, self.drain_s - out["s"]))
        return out

    def _write_sidecar(self, e: Entry) -> None:
        _write_json(
            self.dir / f"{e.key}.json",
            {
                "format": FORMAT,
                "identity": asdict(self.ident),
                "tokens": list(e.tokens),
                "file_bytes": e.file_bytes,
                "sha256": e.sha256,
                "bytes": e.bytes,
                "used": e.used,
            },
        )

    # ---------------------------------------------------------------- lockstep

    def _agree(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (one small all_gather); one rank: its own."""
        if self.group is None or self.group.size() == 1:
            return [values]
        got = mx.distributed.all_gather(mx.array([values], dtype=mx.int64), group=self.group)
        return got.tolist()

    def _load(self, e: Entry) -> list | None:
        path = self.dir / f"{e.key}.safetensors"
        try:
            if path.stat().st_size != e.file_bytes or file_sha256(path) != e.sha256:
                raise ValueError("size or SHA-256 differs from its sidecar")
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
            held = {int(c.offset) for c in cache if hasattr(c, "offset")}
            if (
                int(meta.get("tokens", -1)) != len(e.tokens)
                or meta.get("key") != e.key
                or held - {len(e.tokens)}
            ):
                raise ValueError(
                    f"holds {meta.get('tokens')} tokens of {meta.get('key')} "
                    f"(KV offsets {sorted(held)}), not {len(e.tokens)}"
                )
            mx.eval([c.state for c in cache])
            return cache
        except Exception as ex:  # noqa: BLE001 - any unreadable entry is skipped
            logging.warning("prefix cache %s: corrupt, removed (%s)", path, ex)
            self.stats["corrupt"] += 1
            self._remove(e.key)
            return None

    def lookup(self, tokens: list[int], floor: int) -> tuple[list | None, int]:
        """The longest stored prefix of ``tokens`` longer than ``floor`` (what memory
        already gives) and shorter than ``tokens`` (one token is left to prefill), the
        same on every rank, or (None, 0). Called by every rank at the same request."""
        t0 = time.perf_counter()
        with self._lock:  # only entries whose files are whole on this rank
            ready = [e for e in self.entries.values() if e.state == "ready"]
        cands = sorted(
            (
                e
                for e in ready
                if floor < len(e.tokens) < len(tokens)
                and tuple(tokens[: len(e.tokens)]) == e.tokens
            ),
            key=lambda e: (-len(e.tokens), e.key),
        )
        cache, entry = None, None
        for e in cands:
            cache = self._load(e)
            if cache is not None:
                entry = e
                break
        n = len(entry.tokens) if entry else 0
        lengths = [v[0] for v in self._agree([n])]
        if n == 0 or any(x != n for x in lengths):
            if any(lengths):
                self.stats["disagreed"] += 1
                logging.warning(
                    "prefix cache: ranks hold %s tokens of this prompt: not used", lengths
                )
            self.stats["misses"] += 1
            return None, 0
        self._touch(entry)
        self.stats["hits"] += 1
        took = time.perf_counter() - t0
        self.stats["restore_s"].append(round(took, 4))
        print(
            f"k3dist: prefix cache hit: {n} tokens restored in {took:.3f} s (rank "
            f"{self.ident.rank}, {entry.file_bytes:,} B)",
            file=sys.stderr,
            flush=True,
        )
        return cache, n

    def preload(self, max_bytes: int, max_entries: int, max_tokens: int) -> list:
        """At server start, before the first request: the most recently used entries
        (by the use counter every rank advances alike), up to ``max_bytes`` accounted
        bytes, ``max_entries`` entries and ``max_tokens`` tokens, loaded and checked as
        ``lookup`` checks them, for the prompt cache's memory: a restarted server's
        first matching turn is then a memory hit. The same entries on every rank or
        none: rank 0's candidate keys are shared (all_gather), only those every rank
        holds are loaded, and only those every rank verified are kept. Returns
        [(tokens, cache)], least recently used first. Called by every rank."""
        if max_bytes <= 0 or max_entries <= 0 or max_tokens <= 0:
            return []  # off (the same deployment on every rank: no rank agrees anything)
        t0 = time.perf_counter()
        with self._lock:
            ready = sorted(
                (e for e in self.entries.values() if e.state == "ready"),
                key=lambda e: (-e.used, e.key),
            )
        picked, nbytes, ntokens = [], 0, 0
        for e in ready:
            if len(picked) == max_entries:
                break
            if nbytes + e.bytes > max_bytes or ntokens + len(e.tokens) > max_tokens:
                continue
            picked.append(e)
            nbytes, ntokens = nbytes + e.bytes, ntokens + len(e.tokens)
        # every rank's picks, as 4 x 32-bit words a key, -1 for none (the same width on
        # every rank); rank 0's order decides, a key some rank did not pick is left out
        words = [int(e.key[i : i + 8], 16) for e in picked for i in range(0, 32, 8)]
        rows = self._agree(words + [-1] * (4 * max_entries - len(words)))
        picks = [
            {"".join(f"{w:08x}" for w in r[i : i + 4]) for i in range(0, len(r), 4) if r[i] >= 0}
            for r in rows
        ]
        keys = [
            "".join(f"{w:08x}" for w in rows[0][i : i + 4])
            for i in range(0, len(rows[0]), 4)
            if rows[0][i] >= 0
        ]
        mine = {e.key: e for e in picked}
        loaded = {}
        for k in keys:
            if all(k in p for p in picks):
                cache = self._load(mine[k])
                if cache is not None:
                    loaded[k] = cache
        verified = self._agree([int(k in loaded) for k in keys] or [0])
        out = [
            (list(mine[k].tokens), loaded[k])
            for i, k in enumerate(keys)
            if k in loaded and all(r[i] for r in verified)
        ]
        out.reverse()  # least recently used first: the prompt cache's LRU order
        took = time.perf_counter() - t0
        self.stats["preloaded"] = len(out)
        self.stats["preload_s"] = round(took, 4)
        print(
            f"k3dist: prefix cache preload (rank {self.ident.rank}): {len(out)} of "
            f"{len(ready)} entries ({sum(len(t) for t, _ in out):,} tokens) into memory in "
            f"{took:.3f} s",
            file=sys.stderr,
            flush=True,
        )
        return out

    def save(self, tokens: list[int], cache: list[Any]) -> bool:
        """Queue ``cache`` (the state after ``tokens``) for this rank's writer unless it
        is shorter than ``min_tokens`` or already stored; evict least recently used
        entries past the bound. Called by every rank at the same request and token; it
        returns once the snapshot is queued (the write itself runs on the writer)."""
        if len(tokens) < self.min_tokens:
            return False
        key = prefix_key(tokens, self.ident)
        t0 = time.perf_counter()
        had = self.entries.get(key)
        if had is not None and had.state == "failed":
            had = None  # this rank could not write it: write it again
        ok, nbytes, frozen = 1, 0, None
        if had is not None:  # this rank has it; another may have lost it: agree below
            nbytes = had.bytes
        elif {int(c.offset) for c in cache if hasattr(c, "offset")} - {len(tokens)}:
            ok = 0  # not the state after these tokens: never written (the caller's bug)
            logging.warning(
                "prefix cache: a cache of other length offered for %d tokens", len(tokens)
            )
        elif self._jobs.full() or self._closing:
            ok = 0  # the writer is behind, or stopping: kept by no rank, not waited for
        else:
            frozen = snapshot(cache)
            nbytes = _nbytes(frozen)
        rows = self._agree([nbytes, ok, had is not None])
        if not all(r[1] for r in rows):  # some rank could not queue it: none keeps it
            self.stats["dropped"] += 1
            self._remove(key)
            return False
        size = max(r[0] for r in rows)
        if had is not None:  # the same object the writer may hold: updated in place
            e, e.bytes, e.used = had, size, self._clock()
        else:
            e = Entry(key, tuple(int(t) for t in tokens), 0, "", size, self._clock(), "writing")
        with self._lock:
            self.entries[key] = e
            if e.state == "ready":
                self._write_sidecar(e)
        if frozen is not None:
            with self._idle:
                self._pending += 1
            self._jobs.put_nowait(lambda: self._write_queued(e, frozen))  # a free slot
        self._evict()
        if all(r[2] for r in rows):
            return False  # already stored everywhere: only its use was counted
        self.stats["save_s"].append(round(time.perf_counter() - t0, 4))
        if key in self.entries:
            self.stats["saved"] += 1
            return True
        return False

    def _evict(self) -> None:
        """Least recently used first (ties by key), until the entries fit the bound."""
        order = sorted(self.entries.values(), key=lambda e: (e.used, e.key))
        total = self.total_bytes()
        for e in order:
            if total <= self.max_bytes:
                break
            total -= e.bytes
            self._remove(e.key)
            self.stats["evicted"] += 1

    def report(self) -> dict:
        restore = self.stats["restore_s"]
        save, write = self.stats["save_s"], self.stats["write_s"]
        return {
            "folder": str(self.dir),
            "entries": len(self.entries),
            "bytes": self.total_bytes(),
            "max_bytes": self.max_bytes,
            "tokens": sum(len(e.tokens) for e in list(self.entries.values())),
            "skipped_at_start": len(self.skipped),
            "swept_at_start": len(self.swept),
            "writing": sum(e.state == "writing" for e in list(self.entries.values())),
            **{
                k: v
                for k, v in self.stats.items()
                if k not in ("restore_s", "save_s", "write_s", "writes")
            },
            "recent_writes": list(self.stats["writes"]),
            "last_restore_s": restore[-1] if restore else None,
            "last_save_s": save[-1] if save else None,
            "last_write_s": write[-1] if write else None,
        }
