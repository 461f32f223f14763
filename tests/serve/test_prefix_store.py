"""Prefix caches on disk (k3dist.serve.prefix_store): keying, checks on load, LRU by
bytes (one process: the agreement is with itself); the restart through a real 2-rank
server is in test_prefix_restart.py."""

from __future__ import annotations

import copy
import json
import threading
import time

from k3dist.serve.prefix_store import Identity, PrefixStore, prefix_key

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache

IDENT = Identity("build0", "place0", "split", "float32", 0, 1)


def _cache(n: int, seed: int) -> list:
    """A real K3-shaped cache list: one MLA-like KVCache of n tokens, one KDA ArraysCache."""
    mx.random.seed(seed)
    kv = KVCache()
    kv.update_and_fetch(mx.random.normal((1, 1, n, 8)), mx.random.normal((1, 1, n, 8)))
    kda = ArraysCache(size=2)
    kda[0], kda[1] = mx.random.normal((1, 3, 4)), mx.random.normal((1, 2, 4, 4))
    return [kv, kda]


def _same(a: list, b: list) -> bool:
    fa, fb = tree_flatten([c.state for c in a]), tree_flatten([c.state for c in b])
    return len(fa) == len(fb) and all(  # KVCache: keys, values, offset
        ka == kb and (mx.array_equal(x, y).item() if isinstance(x, mx.array) else x == y)
        for (ka, x), (kb, y) in zip(fa, fb, strict=True)
    )


def test_key_names_tokens_and_identity_not_rank():
    k = prefix_key([1, 2, 3], IDENT)
    assert k == prefix_key((1, 2, 3), Identity("build0", "place0", "split", "float32", 1, 1))
    for other in (
        Identity("build1", "place0", "split", "float32", 0, 1),
        Identity("build0", "place1", "split", "float32", 0, 1),
        Identity("build0", "place0", "replicated", "float32", 0, 1),
        Identity("build0", "place0", "split", "bfloat16", 0, 1),
        Identity("build0", "place0", "split", "float32", 0, 2),
    ):
        assert prefix_key([1, 2, 3], other) != k
        assert other.folder() != IDENT.folder()
    assert prefix_key([1, 2, 4], IDENT) != k and prefix_key([1, 2], IDENT) != k


def test_restored_after_reopen_longest_prefix_and_checks(tmp_path):
    s = PrefixStore(tmp_path, IDENT, 10**9, min_tokens=4)
    a, b = _cache(6, 0), _cache(10, 1)
    assert not s.save([1] * 3, _cache(3, 2))  # under min_tokens: not written
    assert s.save(list(range(6)), a) and s.save(list(range(10)), b)
    assert not s.save(list(range(6)), a)  # already there
    s.flush()  # the writer thread has put both on disk
    s2 = PrefixStore(tmp_path, IDENT, 10**9, min_tokens=4)  # a restart
    assert len(s2.entries) == 2
    got, n = s2.lookup(list(range(12)), floor=0)
    assert n == 10 and _same(got, b)
    got, n = s2.lookup(list(range(10)), floor=0)  # one token must be left to prefill
    assert n == 6 and _same(got, a)
    assert s2.lookup(list(range(12)), floor=10) == (None, 0)  # memory gives as much
    assert s2.lookup([9, *range(11)], floor=0) == (None, 0)
    # another build under the same folder sees none of it
    other = PrefixStore(tmp_path, Identity("build1", "place0", "split", "float32", 0, 1), 10**9)
    assert other.entries == {}
    # a flipped byte: skipped (and removed), the shorter entry serves instead
    f = s2.dir / f"{prefix_key(list(range(10)), IDENT)}.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0xFF
    f.write_bytes(bytes(raw))
    got, n = s2.lookup(list(range(12)), floor=0)
    assert n == 6 and _same(got, a) and s2.stats["corrupt"] == 1 and not f.exists()
    # a sidecar of another identity in this folder (copied in): stale, skipped at start
    side = s2.dir / f"{prefix_key(list(range(6)), IDENT)}.json"
    meta = json.loads(side.read_text())
    side.write_text(json.dumps(dict(meta, identity=dict(meta["identity"], dtype="float16"))))
    s3 = PrefixStore(tmp_path, IDENT, 10**9, min_tokens=4)
    assert s3.entries == {} and len(s3.skipped) == 1
    # a half-written file is swept at start
    (s3.dir / "x.partial.safetensors").write_bytes(b"junk")
    s4 = PrefixStore(tmp_path, IDENT, 10**9)
    assert not any(p.name.startswith("x.") for p in s4.dir.iterdir())
    assert s4.swept == ["x.partial.safetensors"] and s4.report()["swept_at_start"] == 1


def test_lru_by_bytes_survives_reopen(tmp_path):
    one = PrefixStore(tmp_path / "probe", IDENT, 10**9, min_tokens=1)
    one.save([0] * 8, _cache(8, 0))
    one.flush()
    size = next(iter(one.entries.values())).bytes
    s = PrefixStore(tmp_path, IDENT, int(2.5 * size), min_tokens=1)  # room for two
    for i in range(2):
        s.save([i] * 8, _cache(8, i))
    s.flush()
    s.lookup([0] * 8 + [5], floor=0)  # [0]*8 is now the most recently used
    s = PrefixStore(tmp_path, IDENT, int(2.5 * size), min_tokens=1)  # order kept on disk
    s.save([2] * 8, _cache(8, 2))
    s.flush()
    assert {e.tokens[0] for e in s.entries.values()} == {0, 2}  # [1]*8 evicted
    assert s.total_bytes() <= 2.5 * size and s.stats["evicted"] == 1
    assert sorted(p.suffix for p in s.dir.iterdir()) == [
        ".json",
        ".json",
        ".safetensors",
        ".safetensors",
    ]
    with pytest.raises(ValueError, match="must be positive"):
        PrefixStore(tmp_path, IDENT, 0)


def test_a_prefill_copy_that_is_not_the_state_after_its_tokens_is_never_kept(tmp_path):
    """mlx-lm's batch prefill fills the batch's caches, not the request's own: the copy
    taken at the prompt's last token but one then holds fewer tokens than it is filed
    under (seen on the server: 4,044 tokens holding 4,014, or 0), and would serve a later
    prompt with tokens skipped. Neither the memory cache nor the disk keeps it."""
    from k3dist.serve.prompt_cache import K3PromptCache

    store = PrefixStore(tmp_path, IDENT, 10**9, min_tokens=1)
    pc = K3PromptCache(8, lambda: _cache(0, 0)[:1], max_tokens=10**6, store=store)
    cache, rest = pc.fetch_nearest_cache("m", list(range(20)))
    assert rest == list(range(20))
    pc.prefill_progress(19, 20)  # the request's cache was never filled: not kept
    assert len(pc) == 0 and store.entries == {}
    cache, _ = pc.fetch_nearest_cache("m", list(range(20)))
    k = mx.zeros((1, 1, 19, 8))
    cache[0].update_and_fetch(k, k)  # filled in place (mlx-lm's single-request path)
    pc.prefill_progress(19, 20)
    store.flush()
    assert len(pc) == 1 and len(store.entries) == 1
    assert not store.save(list(range(30)), _cache(12, 3))  # 12 held, 30 claimed
    assert len(store.entries) == 1 and len(list(store.dir.glob("*.safetensors"))) == 1


def test_an_entry_still_being_written_is_a_miss_and_the_loop_does_not_wait(tmp_path):
    """``save`` returns once the snapshot is queued; until the writer has renamed the
    entry into place a lookup is a miss (on one rank here; the lengths the ranks agree on
    make it a miss on all), then a hit with the tensors saved, even though the cache the
    snapshot came from was changed after ``save``. A full queue keeps no entry."""
    s = PrefixStore(tmp_path, IDENT, 10**9, min_tokens=1)
    hold = threading.Event()
    s._jobs.put(hold.wait)  # the writer is busy with an earlier entry
    a = _cache(6, 0)
    want = [copy.deepcopy(c) for c in a]
    assert s.save(list(range(6)), a)
    assert s.entries[prefix_key(list(range(6)), IDENT)].state == "writing"
    assert s.report()["writing"] == 1
    assert not list(s.dir.glob("*.json"))  # nothing on disk yet
    assert s.lookup(list(range(8)), floor=0) == (None, 0)
    k = mx.ones((1, 1, 2, 8))
    a[0].update_and_fetch(k, k)  # the request goes on: its cache grows past the snapshot
    s._jobs.put(hold.wait)  # a second busy job: the queue (2 snapshots) is full
    assert not s.save(list(range(9)), _cache(9, 1))  # not kept
    assert s.stats["dropped"] == 1 and len(s.entries) == 1
    hold.set()
    s.flush()
    got, n = s.lookup(list(range(8)), floor=0)
    assert n == 6 and _same(got, want)
    # evicted while it was being written: its file never appears
    hold.clear()
    s._jobs.put(hold.wait)
    s.save(list(range(7)), _cache(7, 2))
    s._remove(prefix_key(list(range(7)), IDENT))
    hold.set()
    s.flush()
    assert len(list(s.dir.glob("*.safetensors"))) == 1
    s.close()
    assert not s._writer.is_alive()


def test_a_stop_drains_the_writer_within_its_bound(tmp_path):
    """``drain`` (a SIGTERM stop) waits for the queued entries, then they are on disk
    for the next start; a writer stuck past the bound is abandoned at the bound (the
    stop never hangs) and nothing half-written is served after a reopen. A stopping
    store queues nothing new."""
    s = PrefixStore(tmp_path, IDENT, 10**9, min_tokens=1)
    hold = threading.Event()
    s._jobs.put(hold.wait)  # the writer is busy (a slow disk)
    assert s.save(list(range(6)), _cache(6, 0))
    threading.Timer(0.3, hold.set).start()
    got = s.drain(10.0)
    assert got["queued"] == 1 and got["written"] == 1 and got["abandoned"] == 0, got
    assert not s.save(list(range(7)), _cache(7, 1))  # stopping: not kept
    assert PrefixStore(tmp_path, IDENT, 10**9, min_tokens=1).has(list(range(6)))
    s.close()

    s = PrefixStore(tmp_path / "stuck", IDENT, 10**9, min_tokens=1)
    hold.clear()
    s._jobs.put(hold.wait)
    assert s.save(list(range(6)), _cache(6, 0))
    t = time.monotonic()
    got = s.drain(0.5)
    took = time.monotonic() - t
    assert got["abandoned"] == 1 and got["written"] == 0 and 0.5 <= took < 2.0, (got, took)
    t = time.monotonic()
    s.close(0.2)  # the clean stop's close is bounded too (the writer is still stuck)
    assert time.monotonic() - t < 1.0
    again = PrefixStore(tmp_path / "stuck", IDENT, 10**9, min_tokens=1)
    assert not again.entries and again.lookup(list(range(8)), floor=0) == (None, 0)
    hold.set()


def test_preload_takes_the_most_recent_entries_within_its_bounds(tmp_path):
    s = PrefixStore(tmp_path, IDENT, 10**9, min_tokens=1)
    old, new = _cache(6, 0), _cache(10, 1)
    s.save(list(range(6)), old)
    s.save(list(range(10, 20)), new)
    s.close()
    s = PrefixStore(tmp_path, IDENT, 10**9, min_tokens=1)
    size = max(e.bytes for e in s.entries.values())
    assert s.preload(0, 4, 10**6) == []  # off
    got = s.preload(size, 4, 10**6)  # room for one: the most recently used
    assert [t for t, _ in got] == [list(range(10, 20))] and _same(got[0][1], new)
    got = s.preload(10**9, 4, 12)  # by tokens: the 10-token one, not both
    assert [len(t) for t, _ in got] == [10]
    got = s.preload(10**9, 4, 10**6)  # all, least recently used first
    assert [len(t) for t, _ in got] == [6, 10] and _same(got[0][1], old)
    assert s.preload(10**9, 1, 10**6)[0][0] == list(range(10, 20))  # by entries


def test_another_software_version_reads_another_folder():
    newer = Identity("build0", "place0", "split", "float32", 0, 1, "k3dist 9, mlx 9, mlx-lm 9")
    assert "mlx-lm" in IDENT.software and newer.folder() != IDENT.folder()
    assert prefix_key([1, 2, 3], newer) != prefix_key([1, 2, 3], IDENT)
