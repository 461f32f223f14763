"""Generated hostile input (issue 28): a short fixed-seed run of the property-based
fuzzer (k3dist.bench.fuzz) over chat/completions, completions, messages, count_tokens
and responses against the 2-rank server with vision on (mlx.launch on loopback).
Every answer a 2xx with a well-formed body or stream, or a 4xx in that API's error
shape; no 5xx, no reset; both ranks alive and in lockstep afterwards. The long run is
benchmarks/faults/fuzz_requests.py.
"""

from __future__ import annotations

import json

from k3dist.bench import fuzz

import pytest
from serving import SHARED, check_alive, post_conn, token_log, wait_logs

pytest.importorskip(
    "mlx_vlm", reason="vision tests need the extra: pip install 'k3dist[vision]' (CI installs it)"
)

N_REQUESTS = 100  # ~20 per endpoint


@pytest.fixture(scope="module")
def srv(shared):
    # read also by test_vision_server; --max-tokens is fuzz.SMALL_TOKENS (serving.SHARED)
    flags = SHARED["vision"][0]
    assert flags[flags.index("--max-tokens") + 1] == str(fuzz.SMALL_TOKENS)
    s = shared.get("vision", __name__)
    yield s
    check_alive(s, f"after {__name__}")


def test_generated_requests_get_2xx_or_4xx_in_shape_and_ranks_stay_in_lockstep(srv):
    report = fuzz.run(srv.port, N_REQUESTS, seed_=20261202)
    summary = report.summary()
    print(json.dumps(summary, indent=1)[:4000])
    assert summary["requests"] == N_REQUESTS
    assert set(summary["by_endpoint"]) == set(fuzz.ENDPOINTS)
    assert summary["failures"] == 0, summary["first_failures"]
    # some of each kind: the fuzzer reaches generation as well as the refusals
    ok = sum(n for c in summary["by_endpoint"].values() for s, n in c.items() if s.startswith("2"))
    assert ok >= 10 and summary["5xx"] == summary["connection_errors"] == 0
    # both ranks alive, serving, and agreed on every token they generated
    assert srv.proc.poll() is None and set(srv.rank_pids()) == {0, 1}
    status, _, body = post_conn(srv.port, {"model": "kimi-k3", "prompt": "hi", "max_tokens": 2})
    assert status == 200, body
    # rank 0 logs a request before its reply; rank 1 when its own generation ends, which
    # can trail: wait for rank 1 to hold as many entries as rank 0
    logs = wait_logs(srv, 0, len(token_log(srv, 0)))
    assert len(logs[0]) >= 1 and logs[0] == logs[1]
