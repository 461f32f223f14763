"""A prefix cache that survives a restart, through the real 2-rank server (mlx.launch on
loopback): two agents' system prompts + tools pre-computed (POST /v1/k3dist/prefix),
the server stopped and started again on the same folder; the first turn then restores
its prefix from disk on both ranks and gives the tokens single-process mlx-lm gives with
no cache; an entry corrupted on one rank only is skipped by both (a miss, same tokens). A prefill
its client abandoned is stored too: after the restart its retry resumes from disk. A SIGTERM
stop right after an entry is stored drains the writers of both ranks (within the
deployment's bound), so the restart is warm; a write past the bound is abandoned."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

from k3dist.serve.prefix_store import file_sha256

from prom import Prometheus
from prometheus_client.parser import text_string_to_metric_families
from serving import Server, post_conn, post_raw, wait_logs
from test_agent_api import TOOLS_C, _greedy
from test_server_abandon import _in_flight, _logged, _long_prompt, _send
from util import REPO

SLOW_DISK = REPO / "tests/scripts/serve_slow_disk.py"

KW = {
    "model": "kimi-k3",
    "max_tokens": 6,
    "temperature": 0,
    "tools": TOOLS_C,
    "extra_body": {"chat_template_kwargs": {"thinking": False}},
}


def _system(name: str) -> list[dict]:
    return [
        {
            "role": "system",
            "content": f"You are {name}, a coding agent. "
            + " ".join(f"Rule {i}: keep file {i} under {40 + i} lines." for i in range(12)),
        }
    ]


def _turn(srv, system, user: str):
    c = srv.client()
    r = c.chat.completions.create(messages=[*system, {"role": "user", "content": user}], **KW)
    return r.usage.prompt_tokens_details.cached_tokens


def _precompute(srv, system) -> dict:
    status, raw = post_raw(
        srv.url + "/v1/k3dist/prefix",
        json.dumps(
            {"messages": system, "tools": TOOLS_C, "chat_template_kwargs": {"thinking": False}}
        ).encode(),
        timeout=120,
    )
    assert status == 200, raw
    return json.loads(raw)


def test_prefix_survives_restart_and_corrupt_entry_is_skipped(ranks, mini_build, tmp_path):
    store = tmp_path / "prefixes"
    extra = (
        "--no-warmup",  # what is cached and restored does not depend on it
        "--max-context",
        "1024",
        "--prefix-cache-dir",
        str(store),
        "--prefix-cache-min-tokens",
        "64",
        "--prefix-cache-preload-gb",
        "0",  # restored from disk at the first turn (the preload is tested below)
    )
    a, b = _system("Ada"), _system("Bob")
    srv = Server(ranks, tmp_path / "first", extra)
    try:
        pa, pb = _precompute(srv, a), _precompute(srv, b)
        assert pa["stored"] and pb["stored"] and pa["prefix_tokens"] > 100, (pa, pb)
        assert pa["key"] != pb["key"]
        # in memory already: the first session's first turn starts warm
        assert _turn(srv, a, "List the files.") >= pa["prefix_tokens"]
        # its next turn (the reply, then a user turn) reuses all of the first turn's
        # prompt but its last token: mlx-lm's own copy from the batch (the batch path
        # takes no prefill copy of its own, which would be stale there and logged)
        first = [*a, {"role": "user", "content": "List the files."}]
        n1 = srv.client().chat.completions.create(messages=first, **KW).usage.prompt_tokens
        nxt = [*first, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Ok"}]
        r = srv.client().chat.completions.create(messages=nxt, **KW)
        assert r.usage.prompt_tokens_details.cached_tokens >= n1 - 1, (n1, r.usage)
        assert "prefill copy of" not in srv.output()
        status, raw = post_raw(
            srv.url + "/v1/k3dist/prefix",
            json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
        )
        assert status == 400 and b"system" in raw
        # a long completion abandoned a third of the way into its prefill: kept, stored
        long = {"prompt": "# stored\n" + _long_prompt(ranks, 800), "max_tokens": 4}
        s = _send(srv.port, "/v1/completions", {**long, "stream": True})
        n = _in_flight(srv, 0)["prompt_tokens"]
        _in_flight(srv, n // 3)
        s.close()
        line = _logged(srv, 1)[0]
        stopped = int(re.search(r"at prompt token (\d+) of", line)[1])
    finally:
        srv.stop()
    files = {r: sorted(store.glob(f"*/rank{r}-of-2/*.safetensors")) for r in range(2)}
    assert len(files[0]) == len(files[1]) >= 2, files

    srv = Server(ranks, tmp_path / "second", extra)
    try:
        log = srv.wait_output('"entries": ', 2)
        assert log.count('"entries": ') == 2, log  # both ranks list their entries
        user = "Show me the tests."
        cached = _turn(srv, a, user)  # restored from disk: nothing in memory yet
        assert cached >= pa["prefix_tokens"], cached
        logs = wait_logs(srv, 0, 1)
        assert logs[0] == logs[1] and logs[0][0]["cached"] == cached
        want = _greedy(mini_build, [*a, {"role": "user", "content": user}], 6)
        assert logs[0][0]["tokens"] == want  # the restored cache: the tokens of no cache
        # /metrics: the restore counted as a disk hit and a prefix-cache hit (rank 0's store)
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}

        def one(name: str) -> float:
            return fams[name].samples[0].value

        assert one("k3dist_prefix_cache_disk_hits") >= 1
        assert one("k3dist_prefix_cache_disk_entries") >= 2  # the two prefixes, turns
        assert one("k3dist_prefix_cache_disk_bytes") > 0
        assert one("k3dist_prefix_cache_hits") >= 1
        assert one("k3dist_prefix_cache_cached_tokens") >= cached
        # a real Prometheus server sees the disk store's series too (tests/prom.py)
        host = srv.url.split("://", 1)[1]
        disk = {"k3dist_prefix_cache_disk_bytes", "k3dist_prefix_cache_disk_entries"}
        with Prometheus(tmp_path / "prometheus", host) as prom:
            res = prom.wait(
                '{job="k3dist", __name__=~"k3dist_prefix_cache_disk_.+"}',
                lambda res: disk <= {x["metric"]["__name__"] for x in res},
            )
        got = {x["metric"]["__name__"]: float(x["value"][1]) for x in res}
        assert got.get("k3dist_prefix_cache_disk_bytes", 0) > 0, got
        assert got.get("k3dist_prefix_cache_disk_entries", 0) >= 2, got
        # Bob's entry corrupted on rank 1 only: rank 0's is whole, yet neither uses it
        bad = next(p for p in files[1] if p.stem == pb["key"])
        raw = bytearray(bad.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        bad.write_bytes(bytes(raw))
        assert _turn(srv, b, user) == 0
        logs = wait_logs(srv, 1, 1)
        assert logs[0] == logs[1] and logs[0][0]["cached"] == 0
        assert logs[0][0]["tokens"] == _greedy(
            mini_build, [*b, {"role": "user", "content": user}], 6
        )
        assert _turn(srv, a, "Again.") >= pa["prefix_tokens"]  # still serving, in lockstep
        assert wait_logs(srv, 2, 1)[0] == wait_logs(srv, 2, 1)[1]
        # the abandoned prefill's retry, after the restart: resumed from disk
        status, _, raw = post_conn(srv.port, {**long, "temperature": 0})
        assert status == 200, raw
        cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert stopped - 32 <= cached <= stopped, (cached, stopped)  # --prefill-chunk 32
        assert f"{cached} of {n} prompt tokens cached (prefix store)" in srv.output()
    finally:
        srv.stop()
    # rank 1 dropped what it could not verify; the miss prefilled Bob's prefix again and
    # stored it anew, whole (rank 0 kept its own)
    side = json.loads(bad.with_suffix(".json").read_text())
    assert bad.read_bytes() != bytes(raw) and file_sha256(bad) == side["sha256"]


def _sigterm(srv, rank: int) -> float:
    """SIGTERM to one rank (what a supervisor or launchd sends); seconds until mlx.launch
    and both ranks are gone. The ranks' pids come from their watchdog lines."""
    pids = {
        int(r): int(p)
        for r, p in re.findall(r"\[k3dist watchdog rank (\d)\] .*pid (\d+)\)", srv.output())
    }
    assert set(pids) == {0, 1}, srv.output()
    t = time.perf_counter()
    os.kill(pids[rank], signal.SIGTERM)
    srv.proc.wait(timeout=120)
    while any(os.path.exists(f"/proc/{p}") for p in pids.values()):
        assert time.perf_counter() - t < 120, "a rank outlived its launcher"
        time.sleep(0.05)
    return time.perf_counter() - t


def test_sigterm_drains_prefix_writes_on_both_ranks(ranks, tmp_path):
    store = tmp_path / "prefixes"
    extra = (
        "--no-warmup",
        "--max-context",
        "1024",
        "--prefix-cache-dir",
        str(store),
        "--prefix-cache-min-tokens",
        "64",
    )
    a, b = _system("Ada"), _system("Bob")
    # 1. each rank's write takes 2 s more (a slow disk; the precompute leaves 2 entries
    # queued per rank, ~4 s of writes in flight); SIGTERM (to rank 1, relayed)
    # right after the entry is queued: the stop waits for both writers, exit code 0
    srv = Server(
        ranks,
        tmp_path / "first",
        (*extra, "--write-delay-s", "2", "--prefix-cache-drain-s", "60"),
        entry=SLOW_DISK,
    )
    try:
        pa = _precompute(srv, a)
        assert pa["stored"] and pa["prefix_tokens"] > 100, pa
        took = _sigterm(srv, 1)
    finally:
        srv.stop()
    log = srv.output()
    drained = re.findall(r"prefix cache stop \(rank (\d)\): (\d+) queued entries written", log)
    assert sorted(r for r, _ in drained) == ["0", "1"], log  # both ranks drained
    n = int(drained[0][1])
    assert n >= 1 and drained[0][1] == drained[1][1], drained  # the system entry, and more
    assert "exited with code" not in log and "was killed" not in log, log
    assert took < 60, took
    # 2. a write that outlasts the bound (1 s) is abandoned on every rank: the stop still
    # ends within the bound plus the watchdog's grace, exit code 0
    srv = Server(
        ranks,
        tmp_path / "second",
        (*extra, "--write-delay-s", "600", "--prefix-cache-drain-s", "1"),
        entry=SLOW_DISK,
    )
    try:
        pb = _precompute(srv, b)
        assert pb["stored"], pb
        bounded = _sigterm(srv, 0)
    finally:
        srv.stop()
    log = srv.output()
    abandoned = re.findall(
        r"prefix cache stop \(rank (\d)\): abandoned (\d+) of (\d+) queued entries after 1 s",
        log,
    )
    assert sorted(r for r, _, _ in abandoned) == ["0", "1"], log
    assert all(a == q and int(a) >= 1 for _, a, q in abandoned), abandoned
    assert "exited with code" not in log and "was killed" not in log, log
    assert bounded < 1 + 2 + 10, bounded  # drain bound + watchdog grace + process exits
    # 3. restarted: Ada's entry is whole on both ranks (a restart-warm hit), Bob's was
    # never renamed into place and its partial file is swept
    srv = Server(ranks, tmp_path / "third", extra)
    try:
        assert _turn(srv, a, "List the files.") >= pa["prefix_tokens"]
        logs = wait_logs(srv, 0, 1)
        assert logs[0] == logs[1]
        out = srv.output()
        assert out.count(f'"entries": {n},') == 2, out  # Ada's, whole; none of Bob's
        for r in range(2):  # the preload (on by default) put them in memory before serving
            assert f"prefix cache preload (rank {r}): {n} of {n} entries" in out, out
        assert "prefix cache hit" not in out  # a memory hit: nothing read at the turn
    finally:
        srv.stop()
    for r in range(2):
        names = {f.name for f in store.glob(f"*/rank{r}-of-2/*")}
        assert not any(".partial" in n or pb["key"] in n for n in names), names
    print(
        f"\nSIGTERM with a write in flight: stopped in {took:.2f} s (drained); "
        f"past the 1 s bound: {bounded:.2f} s (abandoned)"
    )
