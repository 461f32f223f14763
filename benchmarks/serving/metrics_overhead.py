"""What counting costs decode: tok/s of a 2-rank server with metrics on (the default:
/metrics, latencies, rank 1's heartbeat report, sampled expert routes) and with
``--no-metrics``, side by side in one run.

    nice -n 10 .venv/bin/python benchmarks/serving/metrics_overhead.py [--rounds 8] [--tokens 64] \\
        [--rank-dir DIR] [--out benchmarks/results/DATE/metrics-overhead.json]

Both servers (launch/run.py over mlx.launch on loopback, as an operator starts one; the
embedded mini-K3 unless --rank-dir) run at once; their idle ranks wait on the watchdog,
not in a collective, and the supervisor keeps mlx.launch from spinning on its pipes (a
bare mlx.launch burns over a core while idle), so only the one being measured works.
Each round sends one streamed completion of ``--tokens`` tokens to each, in turn, and
times decode from the first streamed token to the last (prefill excluded), and the CPU
seconds both of its ranks spent on the request per token streamed (from /proc: what
counting adds is CPU work). The order alternates (ABBA), and
``order_balanced_on_over_off`` is the geometric mean of the paired ratios, in which what
going first costs cancels. /metrics of the counted server is read every round (a scrape
as Prometheus would do it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _served.py: benchmarks/
from k3dist.bench import record  # noqa: E402

from _served import Served, cpu_seconds  # noqa: E402


def decode_rate(url: str, tokens: int, prompt: str) -> tuple[float, int]:
    """(decode tok/s, tokens streamed) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"text"' in line:
                times.append(time.perf_counter())
    n = len(times)
    if n < 3:
        raise RuntimeError(f"only {n} tokens streamed from {url}; ask a longer --prompt")
    return (n - 1) / (times[-1] - times[0]), n


def ranks_cpu_s(server: Served) -> list[float]:
    """CPU seconds so far of the server's ranks 0 and 1."""
    procs = server.processes()
    if not {"rank0", "rank1"} <= procs.keys():
        raise RuntimeError(f"expected 2 ranks, found {sorted(procs)}")
    return [cpu_seconds(procs[f"rank{r}"]) or 0.0 for r in (0, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default="def fibonacci(n):\n    ")
    ap.add_argument("--rank-dir", help="rank folders ({rank}); default: the embedded mini")
    ap.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="OpenBLAS threads per rank (default 1: four ranks share the machine, and "
        "BLAS threads spinning beside the other ranks swamp the difference measured)",
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    extra = ["--rank-dir", a.rank_dir] if a.rank_dir else []
    extra += ["--blas-threads", str(a.blas_threads)]
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="metrics-overhead-"))
    servers = {}
    try:
        for name, flags in (("metrics_on", []), ("metrics_off", ["--no-metrics"])):
            servers[name] = Served(tmp / name, [*extra, *flags])
        for s in servers.values():  # the first request of each: not measured
            decode_rate(s.url, 4, a.prompt)
        rates: dict[str, list[float]] = {k: [] for k in servers}
        streamed: dict[str, list[int]] = {k: [] for k in servers}
        cpu_per_token: dict[str, list[float]] = {k: [] for k in servers}
        rank_cpu: dict[str, list[list[float]]] = {k: [] for k in servers}
        scrapes, loads = 0, []
        for i in range(a.rounds):
            loads.append(round(os.getloadavg()[0], 2))
            order = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for name in order:
                cpu0 = ranks_cpu_s(servers[name])
                rate, n = decode_rate(servers[name].url, a.tokens, a.prompt)
                cpu1 = ranks_cpu_s(servers[name])
                per_rank = [(b - a) / n for a, b in zip(cpu0, cpu1, strict=True)]
                rank_cpu[name].append([round(x, 4) for x in per_rank])
                cpu_per_token[name].append(sum(per_rank))
                rates[name].append(rate)
                streamed[name].append(n)
            with urllib.request.urlopen(servers["metrics_on"].url + "/metrics", timeout=30) as r:
                assert b"k3dist_generated_tokens_total" in r.read()
                scrapes += 1
        try:  # --no-metrics: no /metrics at all (404), nothing counted
            urllib.request.urlopen(servers["metrics_off"].url + "/metrics", timeout=30)
            off_status = 200
        except urllib.error.HTTPError as e:
            off_status = e.code
    finally:
        codes = {k: s.stop() for k, s in servers.items()}
    on, off = statistics.median(rates["metrics_on"]), statistics.median(rates["metrics_off"])
    # each round's on/off pair ran back to back: their ratio cancels the load of the moment
    paired = [x / y for x, y in zip(rates["metrics_on"], rates["metrics_off"], strict=True)]
    # rounds alternate which server goes first (ABBA: a server runs twice in a row across
    # rounds), so whatever going first costs is in half the ratios one way and in half the
    # other: over an even number of rounds their geometric mean cancels it
    on_first = [x for i, x in enumerate(paired) if i % 2 == 0]
    off_first = [x for i, x in enumerate(paired) if i % 2 == 1]
    balanced = statistics.geometric_mean(paired[: len(paired) // 2 * 2] or [1.0])
    cpu_on, cpu_off = cpu_per_token["metrics_on"], cpu_per_token["metrics_off"]
    cpu_paired = [x / y for x, y in zip(cpu_on, cpu_off, strict=True)]
    report = {
        **record.environment(),
        "server_commands": {k: s.cmd for k, s in servers.items()},
        "rounds": a.rounds,
        "tokens_asked": a.tokens,
        "tokens_streamed": streamed,
        "decode_tok_s": {k: [round(x, 3) for x in v] for k, v in rates.items()},
        "decode_tok_s_stats": {k: record.stats(v) for k, v in rates.items()},
        "median_on_over_off": round(on / off, 4),
        "paired_on_over_off": [round(x, 4) for x in paired],
        "paired_on_over_off_stats": record.stats(paired),
        "paired_on_first": record.stats(on_first),
        "paired_off_first": record.stats(off_first),
        "order_balanced_on_over_off": round(balanced, 4),
        "rank_cpu_s_per_token": {k: [round(x, 4) for x in v] for k, v in cpu_per_token.items()},
        "rank_cpu_s_per_token_stats": {k: record.stats(v) for k, v in cpu_per_token.items()},
        "rank_cpu_s_per_token_by_rank": rank_cpu,
        "paired_cpu_on_over_off": [round(x, 4) for x in cpu_paired],
        "paired_cpu_on_over_off_stats": record.stats(cpu_paired),
        "loadavg_1m_per_round": loads,
        "loadavg_at_start": [round(x, 2) for x in load0],
        "metrics_scrapes_during_run": scrapes,
        "metrics_off_get_metrics_status": off_status,
        "server_exit_codes": codes,
    }
    record.emit(report, a.out, indent=1)


if __name__ == "__main__":
    main()
