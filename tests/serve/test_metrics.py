"""``GET /metrics`` and the ``/status`` page on the real 2-rank server (the shared "text"
server: counts are taken as differences from this file's own start).

/metrics is read with the Prometheus client library's own text parser, and scraped by a
real Prometheus server (Debian's, ``tests/prom.py``) queried over its HTTP API; the page is
loaded in headless Chromium (Debian's ``chromium``) driven over the DevTools protocol
(``websockets``, which mlx-vlm already brings), and its numbers are compared with
/metrics read by the test."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from prom import Prometheus
from prometheus_client.parser import text_string_to_metric_families
from serving import check_alive

CHAT = {"role": "user", "content": "Count to five."}


@pytest.fixture(scope="module")
def srv(shared):
    s = shared.get("text", "test_metrics.py")
    yield s
    check_alive(s, "left by test_metrics.py")


def scrape(srv) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)


def series(m: dict, name: str) -> dict[tuple, float]:
    return {lab: v for (n, lab), v in m.items() if n == name}


def settled(srv, timeout: float = 20.0) -> dict:
    """/metrics once rank 1's last report (one per watchdog heartbeat, 1 s) has caught
    up with rank 0: both ranks generated the same tokens, nothing running."""
    deadline = time.time() + timeout
    while True:
        m = scrape(srv)
        gen = [val(m, "k3dist_rank_generated_tokens_total", rank=r) for r in (0, 1)]
        if (gen[0] == gen[1] and not val(m, "k3dist_running_requests")) or time.time() > deadline:
            return m
        time.sleep(0.2)


def test_metrics_count_what_was_sent_on_both_ranks(srv):
    before = settled(srv)
    client = srv.client()
    usage = []
    for _ in range(2):
        r = client.chat.completions.create(
            model="kimi-k3", messages=[CHAT], max_tokens=12, temperature=0
        )
        usage.append(r.usage)
    r = client.completions.create(model="kimi-k3", prompt="Once upon", max_tokens=10)
    usage.append(r.usage)
    bad = urllib.request.Request(
        srv.url + "/v1/chat/completions",
        data=json.dumps({"model": "kimi-k3", "messages": "not a list"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=30)
    assert e.value.code == 400
    after = settled(srv)

    def d(name, **labels):
        return val(after, name, **labels) - val(before, name, **labels)

    assert d("k3dist_requests_total", api="openai_chat", status=200) == 2
    assert d("k3dist_requests_total", api="openai_completions", status=200) == 1
    assert d("k3dist_requests_total", api="openai_chat", status=400) == 1
    generated = sum(u.completion_tokens for u in usage)
    prompt = sum(u.prompt_tokens for u in usage)
    assert d("k3dist_generated_tokens_total") == generated
    assert d("k3dist_prompt_tokens_total") == prompt
    # rank 1's figures came over the watchdog's side channel: the same tokens
    for rank in (0, 1):
        assert d("k3dist_rank_generated_tokens_total", rank=rank) == generated, rank
        assert d("k3dist_rank_prompt_tokens_total", rank=rank) == prompt, rank
        assert d("k3dist_rank_requests_finished_total", rank=rank) == 3, rank
        assert val(after, "k3dist_rank_up", rank=rank) == 1
        assert val(after, "k3dist_rank_warm", rank=rank) == 1
        assert val(after, "k3dist_rank_resident_bytes", rank=rank) > 100e6
        assert val(after, "k3dist_rank_plan_bytes", rank=rank) > 0
        assert val(after, "k3dist_rank_memory_limit_bytes", rank=rank) > 0
        assert d("k3dist_rank_prefill_chunks_total", rank=rank) >= 3
    assert val(after, "k3dist_rank_report_age_seconds", rank=1) < 5
    # the collective-bearing eval of each decode step, timed on every rank: the ranks
    # ran the same steps (lockstep), each one took time; at most a step per token
    steps = [d("k3dist_rank_decode_steps_total", rank=r) for r in (0, 1)]
    waits = [d("k3dist_rank_collective_wait_seconds_total", rank=r) for r in (0, 1)]
    assert steps[0] == steps[1] and 1 <= steps[0] <= generated, (steps, generated)
    assert all(w > 0 for w in waits), waits
    assert all(w / steps[0] < 30 for w in waits), (waits, steps)  # seconds a step: sane
    # one first token per request, the rest are inter-token gaps
    assert d("k3dist_time_to_first_token_seconds_count") == 3
    assert d("k3dist_inter_token_latency_seconds_count") == generated - 3
    assert d("k3dist_time_to_first_token_seconds_sum") > 0
    assert d("k3dist_prefix_cache_hits_total") + d("k3dist_prefix_cache_misses_total") == 3
    assert val(after, "k3dist_queue_depth") == 0 and val(after, "k3dist_requests_in_flight") == 0
    assert val(after, "k3dist_prefix_cache_memory_entries") >= 1
    # sampled routes (34 tokens or fewer: at least one sample taken, at token 16, and
    # counted two steps later): every sample adds top-k routes per token to each layer
    assert generated >= 19, usage
    routes = series(after, "k3dist_expert_routes_total")
    assert val(after, "k3dist_route_samples_total") >= 1 and routes
    per_layer: dict[str, float] = {}
    for lab, v in routes.items():
        per_layer[dict(lab)["layer"]] = per_layer.get(dict(lab)["layer"], 0) + v
    with urllib.request.urlopen(srv.url + "/status/placement", timeout=10) as r:
        placement = json.loads(r.read())
    assert sorted(int(x) for x in per_layer) == placement["layers"]
    assert len(set(per_layer.values())) == 1  # the same tokens went through every layer
    assert {o for row in placement["owners"] for o in row} == {0, 1}
    assert val(after, "k3dist_khi_overflow_routes_total") == 0  # not a graded build


# -- a real Prometheus server scraping /metrics ------------------------------------------

# what the issue names, as Prometheus stores it: the server's own series, and the series
# of every rank (``rank`` label; rank 1's carried on the watchdog's heartbeat)
SERVER_SERIES = (
    "k3dist_requests_total",
    "k3dist_requests_in_flight",
    "k3dist_queue_depth",
    "k3dist_running_requests",
    "k3dist_prompt_tokens_total",
    "k3dist_generated_tokens_total",
    "k3dist_time_to_first_token_seconds_bucket",
    "k3dist_inter_token_latency_seconds_bucket",
    "k3dist_prefill_chunks_total",
    "k3dist_prefix_cache_hits_total",
    "k3dist_prefix_cache_misses_total",
    "k3dist_prefix_cache_cached_tokens_total",
    "k3dist_prefix_cache_memory_bytes",
    "k3dist_khi_overflow_routes_total",
    "k3dist_khi_dropped_routes_total",
    "k3dist_expert_routes_total",
    "k3dist_route_samples_total",
)  # the disk store's series: tests/serve/test_prefix_restart.py (a server with one)
RANK_SERIES = (
    "k3dist_rank_up",
    "k3dist_rank_warm",
    "k3dist_rank_resident_bytes",
    "k3dist_rank_mlx_active_bytes",
    "k3dist_rank_plan_bytes",
    "k3dist_rank_memory_limit_bytes",
    "k3dist_rank_running_requests",
    "k3dist_rank_generated_tokens_total",
    "k3dist_rank_prompt_tokens_total",
    "k3dist_rank_prefill_chunks_total",
    "k3dist_rank_decode_steps_total",
    "k3dist_rank_collective_wait_seconds_total",
)


def test_prometheus_server_scrapes_every_series_of_both_ranks(srv, tmp_path):
    # enough tokens for a routing sample (every 16 tokens, counted two steps later)
    srv.client().completions.create(
        model="kimi-k3", prompt="Once upon a time", max_tokens=40, temperature=0
    )
    m = settled(srv)
    host = srv.url.split("://", 1)[1]
    assert host.startswith("127.0.0.1:"), srv.url  # loopback: /metrics takes no key
    with Prometheus(tmp_path / "prometheus", host) as prom:
        want = {(n, None) for n in SERVER_SERIES} | {
            (n, r) for n in RANK_SERIES for r in ("0", "1")
        }

        def seen(res) -> set:
            return {(x["metric"]["__name__"], x["metric"].get("rank")) for x in res}

        expr = 'count by (__name__, rank) ({job="k3dist", __name__=~"k3dist_.+"})'
        res = prom.wait(expr, lambda res: want <= seen(res))
        assert want <= seen(res), sorted(want - seen(res))
        up = prom.query('up{job="k3dist"}')
        assert [x["value"][1] for x in up] == ["1"], up
        # what Prometheus stored is what /metrics said (the server is idle)
        got = prom.wait(
            'k3dist_rank_generated_tokens_total{job="k3dist"}',
            lambda res: (
                len(res) == 2
                and all(
                    float(x["value"][1])
                    == val(m, "k3dist_rank_generated_tokens_total", rank=x["metric"]["rank"])
                    for x in res
                )
            ),
            timeout=20,
        )
        assert {x["metric"]["rank"]: float(x["value"][1]) for x in got} == {
            r: val(m, "k3dist_rank_generated_tokens_total", rank=r) for r in ("0", "1")
        }
        waits = prom.query('k3dist_rank_collective_wait_seconds_total{job="k3dist"}')
        assert len(waits) == 2 and all(float(x["value"][1]) > 0 for x in waits), waits


# -- the status page in headless Chromium ------------------------------------------------


class DevTools:
    """Chromium's DevTools protocol on one page (a websocket, JSON commands)."""

    def __init__(self, ws):
        self.ws, self.n = ws, 0

    def call(self, method: str, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        deadline = time.time() + 60
        while time.time() < deadline:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
        raise TimeoutError(method)

    def eval(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")


@pytest.fixture
def browser(tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("the status page test needs Chromium: apt-get install -y chromium")
    proc = subprocess.Popen(
        [
            exe,
            "--headless",
            "--no-sandbox",  # root in a container
            "--disable-gpu",
            "--no-first-run",
            "--remote-debugging-port=0",
            "--remote-allow-origins=*",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1280,1000",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port, deadline, seen = None, time.time() + 60, []
        while port is None and time.time() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            port = int(m.group(1)) if m else None
        assert port, f"chromium did not start: {''.join(seen)[-2000:]}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.loads(r.read()) if t["type"] == "page")
        from websockets.sync.client import connect

        with connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
            yield DevTools(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


PAGE = """(() => {
  if (!window.k3status) return {polls: 0};  // not loaded, or no read of /metrics yet
  const v = (id) => document.getElementById(id).dataset.value;
  const heat = document.getElementById("heat").dataset;
  return {
    polls: window.k3status ? window.k3status.polls : 0,
    generated: v("generated"), prompt: v("prompt"), requests: v("requests"),
    routes: v("routes"), samples: v("route-samples"), hits: v("cache-hits"),
    misses: v("cache-misses"), running: v("running"),
    heat: {layers: heat.layers, experts: heat.experts, hot: heat.hot},
    ranks: [...document.querySelectorAll("#ranks .rank")].map((d) => ({
      id: d.id, up: d.dataset.up, warm: d.dataset.warm, generated: d.dataset.generated})),
    err: document.getElementById("err").textContent,
  };
})()"""


def wait_page(tools: DevTools, cond, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        p = tools.eval(PAGE)
        if cond(p) or time.time() > deadline:
            return p
        time.sleep(0.1)


def check_page_equals_metrics(tools: DevTools, srv) -> dict:
    """The page's numbers, read after a poll that followed the test's own read of
    /metrics, equal that read (the server is idle: nothing moves in between)."""
    m = settled(srv)
    polls = tools.eval(PAGE)["polls"]
    p = wait_page(tools, lambda p: p["polls"] >= polls + 2)
    assert p["polls"] >= polls + 2, p
    assert p["err"] == "", p["err"]
    assert float(p["generated"]) == val(m, "k3dist_generated_tokens_total")
    assert float(p["prompt"]) == val(m, "k3dist_prompt_tokens_total")
    assert float(p["requests"]) == sum(series(m, "k3dist_requests_total").values())
    routes = series(m, "k3dist_expert_routes_total")
    assert float(p["routes"]) == sum(routes.values())
    assert int(p["heat"]["hot"]) == len(routes)
    assert float(p["samples"]) == val(m, "k3dist_route_samples_total")
    assert float(p["hits"]) == val(m, "k3dist_prefix_cache_hits_total")
    assert float(p["misses"]) == val(m, "k3dist_prefix_cache_misses_total")
    assert [r["id"] for r in p["ranks"]] == ["rank-0", "rank-1"]
    for r in p["ranks"]:
        rank = r["id"].split("-")[1]
        assert float(r["up"]) == 1 and float(r["warm"]) == 1
        assert float(r["generated"]) == val(m, "k3dist_rank_generated_tokens_total", rank=rank)
    return p


def test_status_page_in_chromium_shows_metrics_and_updates(srv, browser, tmp_path):
    tools = browser
    tools.call("Page.enable")
    tools.call("Page.navigate", url=srv.url + "/status?interval=250")
    first = wait_page(tools, lambda p: p["polls"] >= 1)
    assert first["polls"] >= 1, first
    check_page_equals_metrics(tools, srv)

    # while requests run, the same page (no reload) shows the tokens growing
    done = threading.Event()

    def send() -> None:
        try:
            client = srv.client()
            for i in range(3):
                client.chat.completions.create(
                    model="kimi-k3",
                    messages=[{"role": "user", "content": f"Tell a story, part {i}."}],
                    max_tokens=24,
                    temperature=0,
                )
        finally:
            done.set()

    start = float(tools.eval(PAGE)["generated"])
    t = threading.Thread(target=send, daemon=True)
    t.start()
    seen, deadline = set(), time.time() + 240
    while not done.is_set() and time.time() < deadline:
        seen.add(float(tools.eval(PAGE)["generated"]))
        time.sleep(0.1)
    t.join(60)
    assert done.is_set()
    during = sorted(x for x in seen if x > start)
    assert len(during) >= 2, (start, seen)  # at least two updates mid-run
    p = check_page_equals_metrics(tools, srv)
    assert float(p["generated"]) >= start + 3
    assert int(p["heat"]["layers"]) >= 1 and int(p["heat"]["experts"]) >= 2
    shot = tools.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    import base64

    png = base64.b64decode(shot["data"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    (tmp_path / "status.png").write_bytes(png)
