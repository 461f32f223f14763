"""A prefix cache that survives a restart, through the real 2-rank server (mlx.launch on
loopback): two agents' system prompts + tools pre-computed (POST /v1/k3dist/prefix),
the server stopped and started again on the same folder; the first turn then restores
its prefix from disk on both ranks and gives the tokens single-process mlx-lm gives with
no cache; an entry corrupted on one rank only is skipped by both (a miss, same tokens)."""

from __future__ import annotations

import json

from k3dist.serve.prefix_store import file_sha256

from serving import Server, post_raw, wait_logs
from test_agent_api import TOOLS_C, _greedy

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
        "--max-context",
        "1024",
        "--prefix-cache-dir",
        str(store),
        "--prefix-cache-min-tokens",
        "64",
    )
    a, b = _system("Ada"), _system("Bob")
    srv = Server(ranks, tmp_path / "first", extra)
    try:
        pa, pb = _precompute(srv, a), _precompute(srv, b)
        assert pa["stored"] and pb["stored"] and pa["prefix_tokens"] > 100, (pa, pb)
        assert pa["key"] != pb["key"]
        # in memory already: the first session's first turn starts warm
        assert _turn(srv, a, "List the files.") >= pa["prefix_tokens"]
        status, raw = post_raw(
            srv.url + "/v1/k3dist/prefix",
            json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
        )
        assert status == 400 and b"system" in raw
    finally:
        srv.stop()
    files = {r: sorted(store.glob(f"*/rank{r}-of-2/*.safetensors")) for r in range(2)}
    assert len(files[0]) == len(files[1]) >= 2, files

    srv = Server(ranks, tmp_path / "second", extra)
    try:
        log = srv.output()
        assert log.count('"entries": ') == 2, log  # both ranks list their entries
        user = "Show me the tests."
        cached = _turn(srv, a, user)  # restored from disk: nothing in memory yet
        assert cached >= pa["prefix_tokens"], cached
        logs = wait_logs(srv, 0, 1)
        assert logs[0] == logs[1] and logs[0][0]["cached"] == cached
        want = _greedy(mini_build, [*a, {"role": "user", "content": user}], 6)
        assert logs[0][0]["tokens"] == want  # the restored cache: the tokens of no cache
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
    finally:
        srv.stop()
    # rank 1 dropped what it could not verify; the miss prefilled Bob's prefix again and
    # stored it anew, whole (rank 0 kept its own)
    side = json.loads(bad.with_suffix(".json").read_text())
    assert bad.read_bytes() != bytes(raw) and file_sha256(bad) == side["sha256"]
