"""How long the lockstep loop pauses when a prefix entry is stored: ``PrefixStore.save``
timed on the calling thread (the decode-step gap every running request sees), with the
write on the writer thread (this tree) against the same write done in the loop (the
store's writer drained inside the call: what ``save`` cost before the writer), and the
SHA-256 rate of one core against several threads (hashlib releases the GIL).

    python benchmarks/serving/prefix_write_pause.py --mb 64 256
        --out benchmarks/results/DATE/prefix-write.json
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from k3dist.bench import record
from k3dist.serve.prefix_store import Identity, PrefixStore

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache


def cache_of(mb: int, tokens: int) -> list:
    """A K3-shaped cache (an MLA KVCache of ``tokens`` + a KDA state) of ~``mb`` MB."""
    width = max(1, mb * 10**6 * 3 // 4 // (tokens * 4 * 2))
    kv = KVCache()
    kv.update_and_fetch(
        mx.random.normal((1, 1, tokens, width)), mx.random.normal((1, 1, tokens, width))
    )
    kda = ArraysCache(size=1)
    kda[0] = mx.random.normal((1, mb * 10**6 // 4 // 4 // 1024, 1024))
    mx.eval(kv.state, kda.state)
    return [kv, kda]


def pauses(mb: int, tokens: int, reps: int, inline: bool) -> list[float]:
    out = []
    with tempfile.TemporaryDirectory() as d:
        store = PrefixStore(d, Identity("b", "p", "split", "float32", 0, 1), 10**12, min_tokens=1)
        for i in range(reps):
            cache = cache_of(mb, tokens)
            t = time.perf_counter()
            store.save([i] * tokens, cache)
            if inline:
                store.flush()  # the write inside the call, as before the writer thread
            out.append(time.perf_counter() - t)
            store.flush()
        store.close()
    return out


def sha_rate(mb: int, threads: int) -> float:
    """GB/s of SHA-256 over ``mb`` MB cut into ``threads`` equal chunks, one per thread."""
    data = bytes(mb * 10**6)
    size = len(data) // threads
    chunks = [memoryview(data)[i * size : (i + 1) * size] for i in range(threads)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t = time.perf_counter()
            list(pool.map(lambda c: hashlib.sha256(c).digest(), chunks))
            best = min(best, time.perf_counter() - t)
    return len(data) / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sha-mb", type=int, default=256)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out")
    args = ap.parse_args()
    res = {**record.environment(), "entries": {}, "sha256_GBps": {}}
    for mb in args.mb:
        row = {}
        for name, inline in (("in_loop", True), ("writer_thread", False)):
            p = pauses(mb, args.tokens, args.reps, inline)
            row[name] = {
                "median_s": round(statistics.median(p), 4),
                "max_s": round(max(p), 4),
                "all_s": [round(x, 4) for x in p],
            }
        res["entries"][f"{mb}MB"] = row
        print(
            f"{mb} MB entry: save() pauses the loop {row['in_loop']['median_s']:.3f} s "
            f"written in the loop, {row['writer_thread']['median_s']:.3f} s with the "
            "writer thread",
            flush=True,
        )
    for n in args.threads:
        res["sha256_GBps"][str(n)] = round(sha_rate(args.sha_mb, n), 2)
        print(f"SHA-256 on {n} thread(s): {res['sha256_GBps'][str(n)]} GB/s", flush=True)
    record.emit(res, args.out)


if __name__ == "__main__":
    main()
