"""What the server counts, in the Prometheus text format (``GET /metrics``, rank 0).

One ``ServeMetrics`` per rank. The lockstep loop reports each request's events to it
(``RequestTimer``: start, prefill chunk, token, end) on every rank; rank 0's handler
counts requests by API and status. Figures that belong to a rank (its resident memory
against its plan and limit, warm-up, the tokens it generated) are one small dict
(``ServeMetrics.rank_stats``); the other ranks send theirs to rank 0 on the watchdog's
side channel every heartbeat (``Watchdog.stats``, a ``M <json>`` line), so rank 0
exports every rank's series without a collective on the decode path.

Expert routes are sampled off the hot path: each MoE layer keeps a reference to the
expert ids of its last call (``ExpertParallelMoE.last_routes``, evaluated by the step
anyway); every ``ROUTE_SAMPLE_EVERY`` generated tokens rank 0's generation thread
takes them and, two steps later (evaluated by then), copies them to the host and
counts them per (layer, expert). The router runs on every rank on the same input, so
rank 0's counts are every rank's. For graded builds the same sample gives the ``k_hi``
overflows (promoted routes of a token beyond ``k_hi``) and the drops among them (those
with no lo copy).

Collective wait per step, as far as it can be seen without a new sync: every rank times
the one call where its generation thread waits for a decode step's tokens (mlx-lm's
``mx.eval`` in ``GenerationBatch._step``; ``k3dist.serve.lockstep._TimedEval``). That
evaluation holds every all_sum of the step, so a rank that waits for its peer waits
there; it also holds the step's compute not hidden behind the host's building of the
next step (an upper bound of the wait in collectives; ``benchmarks/speed/ep_decode.py`` splits
compute from communication).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Generated tokens between two samples of the routing (a host copy of every MoE
# layer's expert ids for the step in flight: one short stall of the pipeline).
ROUTE_SAMPLE_EVERY = 16
# what a peer's report carries of ServeMetrics.counts
RANK_COUNTS = (
    "generated_tokens",
    "prompt_tokens",
    "prefill_chunks",
    "finished",
    "decode_steps",
    "step_wait_s",
)
# The API a request path belongs to (the ``api`` label); anything else is "other".
APIS = {
    "/v1/chat/completions": "openai_chat",
    "/chat/completions": "openai_chat",
    "/v1/completions": "openai_completions",
    "/v1/messages": "anthropic_messages",
    "/v1/messages/count_tokens": "anthropic_count_tokens",
    "/v1/responses": "openai_responses",
    "/v1/k3dist/prefix": "k3dist_prefix",
}
# seconds; decode on the real model is ~0.05-0.5 s a token, prefill seconds to minutes
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, float("inf"))


def api_of(path: str) -> str:
    return APIS.get(path, "other")


def resident_bytes() -> int | None:
    """This process's resident memory (Linux ``VmRSS``; ``ru_maxrss``, its peak, where
    there is no ``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


class RouteSampler:
    """Per-layer expert route counts from samples of the MoE layers' last routes."""

    def __init__(self, model, every: int = ROUTE_SAMPLE_EVERY):
        from k3dist.model.experts import ExpertParallelMoE

        self.layers = [
            (i, layer.mlp)
            for i, layer in enumerate(model.layers)
            if isinstance(layer.mlp, ExpertParallelMoE)
        ]
        n_exp = self.layers[0][1].args.num_experts if self.layers else 0
        self.counts = np.zeros((len(self.layers), n_exp), dtype=np.int64)
        self.samples = 0
        self.overflow = 0  # graded: promoted routes beyond k_hi, in the samples
        self.dropped = 0  # of those, the ones with no lo copy
        self.every, self._tokens = every, 0
        self._seen, self._steps = None, 0  # layer 0's last routes seen; steps counted
        self._pending: tuple[int, list] | None = None  # (step, the layers' routes)
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Keep each layer's last routes from now on (warm-up's are not counted)."""
        for _, m in self.layers:
            m.record_last_routes(True)

    def on_token(self) -> None:
        """Called by the generation thread for every generated token (rank 0).

        Every ``every`` tokens it takes references to the layers' latest routes (those
        of the step just built, in flight); it copies them to the host once two newer
        steps have been built: the loop builds step n+2 only after reading step n's
        tokens, so the copy never waits for the device."""
        self._tokens += 1
        latest = self.layers[0][1].last_routes if self.layers else None
        if latest is not None and latest is not self._seen:
            self._seen, self._steps = latest, self._steps + 1
        if self._pending is not None and self._steps >= self._pending[0] + 2:
            self._count(self._pending[1])
            self._pending = None
        if self._pending is None and self._tokens % self.every == 0 and latest is not None:
            self._pending = (self._steps, [m.last_routes for _, m in self.layers])

    def _count(self, refs: list) -> None:
        got = []
        for r in refs:
            try:
                got.append(None if r is None else np.asarray(r).reshape(-1, r.shape[-1]))
            except (RuntimeError, ValueError):  # not a concrete array (a traced call)
                got.append(None)
        with self.lock:
            for j, (ids, (_, m)) in enumerate(zip(got, self.layers, strict=True)):
                if ids is None:
                    continue
                self.counts[j] += np.bincount(ids.reshape(-1), minlength=self.counts.shape[1])
                o, d = m.sampled_overflow(ids)
                self.overflow, self.dropped = self.overflow + o, self.dropped + d
            self.samples += 1

    def snapshot(self) -> tuple[list[int], np.ndarray, int]:
        with self.lock:
            return [i for i, _ in self.layers], self.counts.copy(), self.samples


class RequestTimer:
    """One request's events on one rank (the lockstep queue calls these)."""

    __slots__ = ("m", "t0", "last", "n", "started", "ended")

    def __init__(self, m: ServeMetrics, submitted: float | None):
        self.m, self.t0 = m, submitted if submitted is not None else time.perf_counter()
        self.last, self.n, self.started, self.ended = None, 0, False, False

    def start(self, prompt_tokens: int, cached_tokens: int) -> None:
        if self.started:
            return
        self.started = True
        m = self.m
        with m.lock:
            m.running += 1
            m.counts["prompt_tokens"] += prompt_tokens
            m.counts["cached_tokens"] += max(0, cached_tokens)
            m.counts["cache_hits" if cached_tokens > 0 else "cache_misses"] += 1

    def chunk(self) -> None:
        with self.m.lock:
            self.m.counts["prefill_chunks"] += 1

    def token(self) -> None:
        now = time.perf_counter()
        m = self.m
        if self.last is None:
            m.ttft.observe(now - self.t0)
        else:
            m.itl.observe(now - self.last)
        self.last = now
        self.n += 1
        with m.lock:
            m.counts["generated_tokens"] += 1
        if m.routes is not None:
            m.routes.on_token()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        with self.m.lock:
            self.m.counts["finished"] += 1
            if self.started:
                self.m.running -= 1


class ServeMetrics:
    """This rank's figures, and on rank 0 the registry ``GET /metrics`` renders."""

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        preflight: dict | None = None,
        warm: bool = False,
        peers: Callable[[], dict[int, tuple[float, dict]]] | None = None,
        peer_timeout_s: float = 10.0,
    ):
        self.rank, self.size = rank, size
        pre = preflight or {}
        self.plan_bytes = pre.get("footprint_bytes")
        self.limit_bytes = pre.get("wired_limit_set_bytes") or pre.get("free_bytes")
        self.warm = warm
        self.peers = peers or (lambda: {})
        self.peer_timeout_s = peer_timeout_s
        self.lock = threading.Lock()
        self.running = 0
        self.counts = dict.fromkeys(
            (
                "prompt_tokens",
                "cached_tokens",
                "generated_tokens",
                "prefill_chunks",
                "cache_hits",
                "cache_misses",
                "finished",
                "decode_steps",
                "step_wait_s",
            ),
            0,
        )
        self.routes: RouteSampler | None = None
        self.placement: dict | None = None  # {"layers": [...], "owners": [[rank of e]]}
        self.admission = None  # rank 0: server.Admission
        self.prompt_cache = None  # rank 0: K3PromptCache (its store: the disk)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "k3dist_requests",
            "HTTP requests answered, by API and status",
            ["api", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "k3dist_time_to_first_token_seconds",
            "From the request's arrival to its first generated token (rank 0)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "k3dist_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request (rank 0)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        r.register(_Collector(self))

    def step_wait(self, seconds: float) -> None:
        """One decode step's wait for its tokens (the generation thread, every rank)."""
        with self.lock:
            self.counts["decode_steps"] += 1
            self.counts["step_wait_s"] += seconds

    def timer(self, submitted: float | None = None) -> RequestTimer:
        return RequestTimer(self, submitted)

    def attach_routes(self, model, owners: dict[int, list[int]] | None = None) -> None:
        """Sample ``model``'s routing (rank 0); ``owners``: the placement, layer ->
        the rank of each expert, drawn over the heatmap."""
        self.routes = RouteSampler(model)
        if owners is not None:
            layers = [i for i, _ in self.routes.layers]
            self.placement = {
                "layers": layers,
                "owners": [[int(x) for x in owners[i]] for i in layers],
            }

    def rank_stats(self) -> dict:
        """This rank's own figures: what a peer sends rank 0 (one JSON line)."""
        with self.lock:
            c = dict(self.counts)
        return {
            "rss": resident_bytes(),
            "active": _mlx_active(),
            "plan": self.plan_bytes,
            "limit": self.limit_bytes,
            "warm": int(self.warm),
            "running": self.running,
            **{k: c[k] for k in RANK_COUNTS},
        }

    def ranks(self) -> dict[int, dict]:
        """Every rank's latest figures (rank 0 now; peers as last sent) with ``alive``
        and ``age_s`` (seconds since the peer last reported)."""
        out = {self.rank: {**self.rank_stats(), "alive": 1, "age_s": 0.0}}
        now = time.monotonic()
        for r, (t, s) in self.peers().items():
            age = now - t
            out[r] = {**s, "alive": int(age <= self.peer_timeout_s), "age_s": round(age, 3)}
        for r in range(self.size):
            out.setdefault(r, {"alive": 0})
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def placement_json(self) -> bytes:
        return json.dumps(self.placement or {"layers": [], "owners": []}).encode()


def _mlx_active() -> int | None:
    try:
        import mlx.core as mx

        return int(mx.get_active_memory())
    except (AttributeError, RuntimeError):
        return None


# per-rank series: (name, the rank_stats key, counter?, help)
RANK_SERIES = (
    ("k3dist_rank_up", "alive", False, "1 while the rank reports (peers: on the watchdog)"),
    ("k3dist_rank_report_age_seconds", "age_s", False, "Seconds since the rank last reported"),
    ("k3dist_rank_resident_bytes", "rss", False, "The rank's resident memory"),
    ("k3dist_rank_mlx_active_bytes", "active", False, "Memory MLX holds on the rank"),
    ("k3dist_rank_plan_bytes", "plan", False, "The rank's planned footprint (preflight)"),
    (
        "k3dist_rank_memory_limit_bytes",
        "limit",
        False,
        "The rank's wired limit where set, else its free memory at start (preflight)",
    ),
    ("k3dist_rank_warm", "warm", False, "1 once the rank warmed every shape"),
    ("k3dist_rank_running_requests", "running", False, "Requests in the rank's batch"),
    ("k3dist_rank_generated_tokens", "generated_tokens", True, "Tokens the rank generated"),
    ("k3dist_rank_prompt_tokens", "prompt_tokens", True, "Prompt tokens the rank took in"),
    ("k3dist_rank_prefill_chunks", "prefill_chunks", True, "Prefill progress steps of the rank"),
    ("k3dist_rank_requests_finished", "finished", True, "Requests the rank finished"),
    ("k3dist_rank_decode_steps", "decode_steps", True, "Decode steps the rank evaluated"),
    (
        "k3dist_rank_collective_wait_seconds",
        "step_wait_s",
        True,
        "Seconds the rank waited on its decode steps' collective-bearing eval (holds the "
        "step's all_sums and its compute not overlapped with the host)",
    ),
)
# whole-server counters from ServeMetrics.counts: (name, key, help)
COUNTERS = (
    ("k3dist_prompt_tokens", "prompt_tokens", "Prompt tokens of the requests started"),
    ("k3dist_generated_tokens", "generated_tokens", "Tokens generated"),
    ("k3dist_prefill_chunks", "prefill_chunks", "Prefill progress steps (one per chunk)"),
    ("k3dist_prefix_cache_hits", "cache_hits", "Requests that reused a cached prefix"),
    ("k3dist_prefix_cache_misses", "cache_misses", "Requests that reused nothing"),
    (
        "k3dist_prefix_cache_cached_tokens",
        "cached_tokens",
        "Prompt tokens served from the prompt caches (prefix reuse)",
    ),
)

# the on-disk prefix store's own counts (PrefixStore.stats) exported as counters
DISK_COUNTS = {
    "hits": "lookups restored from disk",
    "misses": "lookups with no entry on disk",
    "saved": "entries written",
    "evicted": "entries evicted for space",
    "corrupt": "entries found corrupt (dropped)",
}


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _Collector:
    """The figures read at scrape time: per rank, the queue, the prompt caches, routes."""

    def __init__(self, m: ServeMetrics):
        self.m = m

    def collect(self):
        m = self.m
        ranks = m.ranks()
        for name, key, counter, doc in RANK_SERIES:
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            fam = kind(name, doc, labels=["rank"])
            for r in sorted(ranks):
                v = ranks[r].get(key)
                if v is not None:
                    fam.add_metric([str(r)], float(v))
            yield fam
        with m.lock:
            c, running = dict(m.counts), m.running
        for name, key, doc in COUNTERS:
            yield CounterMetricFamily(name, doc, value=c[key])
        yield _gauge("k3dist_running_requests", "Requests in the decode batch", running)
        if m.admission is not None:
            flight = m.admission.in_flight
            yield _gauge(
                "k3dist_requests_in_flight", "Completions admitted (queued or running)", flight
            )
            yield _gauge(
                "k3dist_queue_depth",
                "Completions admitted, not yet running",
                max(0, flight - running),
            )
            yield _gauge(
                "k3dist_max_requests_in_flight", "Admission limit (429 past it)", m.admission.limit
            )
        pc = m.prompt_cache
        if pc is not None:
            yield _gauge(
                "k3dist_prefix_cache_memory_bytes", "Bytes of the in-memory prompt cache", pc.nbytes
            )
            yield _gauge(
                "k3dist_prefix_cache_memory_entries",
                "Entries of the in-memory prompt cache",
                len(pc),
            )
            store = getattr(pc, "store", None)
            if store is not None:
                yield _gauge(
                    "k3dist_prefix_cache_disk_bytes",
                    "Bytes of the on-disk prefix store",
                    store.total_bytes(),
                )
                yield _gauge(
                    "k3dist_prefix_cache_disk_entries",
                    "Entries of the on-disk prefix store",
                    len(store.entries),
                )
                for key, doc in DISK_COUNTS.items():
                    yield CounterMetricFamily(
                        f"k3dist_prefix_cache_disk_{key}",
                        f"On-disk prefix store: {doc}",
                        value=store.stats.get(key, 0),
                    )
        if m.routes is not None:
            layers, counts, samples = m.routes.snapshot()
            yield CounterMetricFamily(
                "k3dist_route_samples", "Steps whose routing was sampled", value=samples
            )
            yield CounterMetricFamily(
                "k3dist_khi_overflow_routes",
                "Sampled promoted routes past k_hi (graded)",
                value=m.routes.overflow,
            )
            yield CounterMetricFamily(
                "k3dist_khi_dropped_routes",
                "Sampled overflows with no lo copy (graded)",
                value=m.routes.dropped,
            )
            fam = CounterMetricFamily(
                "k3dist_expert_routes",
                "Sampled routes per MoE layer and expert (nonzero)",
                labels=["layer", "expert"],
            )
            for j, layer in enumerate(layers):
                for e in np.flatnonzero(counts[j]):
                    fam.add_metric([str(layer), str(int(e))], float(counts[j, e]))
            yield fam
