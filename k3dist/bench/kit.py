"""Benchmarks of a K3 across ranks: shared timing and report helpers, and the cores
behind ``benchmarks/decode.py`` (one deployment, per box) and ``benchmarks/compare.py``
(k3dist expert parallelism against mlx-lm's own tensor- and pipeline-parallel modes
and a single process, in one ``mlx.launch`` run).

Method, everywhere:

- Every timed block starts after a barrier, so a rank never waits for a peer that
  is still finishing the previous block; the barrier is not timed.
- A decode step is timed synchronously (forward, argmax, ``.item()``), without
  mlx-lm's ``async_eval`` overlap: what one token costs, end to end.
- Expert parallelism's compute is *measured*: the same steps with the MoE
  ``all_sum`` bypassed (``model.set_collectives(False)``: wrong numbers, the same
  work); communication is total minus that, paired round by round. It includes
  waiting for the slower rank (load imbalance), which is what a placement changes.
- Tensor/pipeline parallel communication is *estimated*: each collective a step
  issues (counted from the model's structure) times a microbenchmark of that
  collective at that payload.
- Modes are timed in interleaved rounds (order rotated each round) so that drift
  on a shared machine lands on all of them; ratios are taken per round, then the
  median.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import k3dist
from k3dist.build import convert, slicing
from k3dist.build.rss import peak_rss
from k3dist.factory import synth
from k3dist.format import layout, placement
from k3dist.format.folder import INDEX_NAME, load_config
from k3dist.format.journal import locked, remake_stale
from k3dist.model import compat
from k3dist.model.attention import QuantizedSumLinear, SumLinear
from k3dist.model.experts import ExpertParallelMoE
from k3dist.model.forms import resolve_form
from k3dist.serve import introspect, loader

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.nn.layers.distributed import QuantizedShardedToAllLinear, ShardedToAllLinear
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3
from mlx_lm.utils import load_model, sharded_load

# ----------------------------------------------------------------------------- reporting


def stats(xs: Sequence[float], digits: int = 4) -> dict:
    """Median and spread (p10, p90) of a list of trials."""
    a = np.asarray(xs, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    return {"median": round(float(np.median(a)), digits),
            "p10": round(float(np.percentile(a, 10)), digits),
            "p90": round(float(np.percentile(a, 90)), digits),
            "mean": round(float(a.mean()), digits), "n": int(a.size)}


REPO = k3dist.REPO


def emit(report: dict, out: str | Path | None, indent: int = 2) -> str:
    """Print a benchmark's JSON report and write it to ``out`` when given."""
    text = json.dumps(report, indent=indent)
    print(text)
    if out:  # .partial then renamed: a killed run leaves no half report
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(out.suffix + ".partial")
        part.write_text(text + "\n")
        part.rename(out)
    return text


def repo_path(path: str | Path) -> str:
    """``path`` as results record it: relative to the repository, never a machine path
    (a folder outside the repository, e.g. a temporary one, as ``<temp>/NAME``)."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return f"<temp>/{p.name}"


def command_line(argv: Sequence[str] | None = None) -> str:
    """This process's command as results record it: ``python`` and repository-relative
    paths (an absolute argument outside the repository is kept: it was asked for)."""
    argv = sys.argv if argv is None else argv

    def rel(a: str) -> str:
        p = Path(a)
        if p.is_absolute() and p.resolve().is_relative_to(REPO):
            return str(p.resolve().relative_to(REPO))
        return a

    return " ".join(shlex.quote(rel(a)) for a in ["python", *argv])


def environment(argv: Sequence[str] | None = None) -> dict:
    """The exact command, versions, machine, backend and BLAS of this process."""
    return {
        "command": command_line(argv),
        "versions": {"k3dist": k3dist.__version__, "mlx": mx.__version__,
                     "mlx_lm": mlx_lm.__version__, "python": platform.python_version()},
        "machine": platform.platform(),
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": {"device": str(mx.default_device()), "metal": mx.metal.is_available()},
        "blas": k3dist.blas_status(),
        "distributed": _launch_info(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return None


def _launch_info() -> dict:
    """What mlx.launch passed this rank: its rank and the ring's addresses."""
    info: dict = {"rank": os.environ.get("MLX_RANK")}
    hf = os.environ.get("MLX_HOSTFILE")
    if hf:
        try:
            info["ring"] = json.loads(Path(hf).read_text())
        except (OSError, ValueError):
            info["ring"] = None
    return info


def launcher() -> dict | None:
    """The ``mlx.launch`` process that started this rank (its parent, when the rank
    runs on the launching machine): pid and CPU seconds so far. ``None`` otherwise."""
    ppid = os.getppid()
    try:
        cmd = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "mlx.launch" not in cmd:
            return None
        f = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return {"pid": ppid, "cpu_s": (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"),
            "nice": os.getpriority(os.PRIO_PROCESS, ppid)}


def nice_launcher(niceness: int = 19) -> dict | None:
    """Lower the scheduling priority of this rank's ``mlx.launch`` parent. Its output
    threads poll in a loop (``select`` on each child's always-writable stdin pipe
    returns at once): measured here ~1.4 cores of a 2-core box for the whole run,
    taken from the ranks. Returns the launcher's info after, None if not found."""
    info = launcher()
    if info is not None and info["nice"] < niceness:
        os.setpriority(os.PRIO_PROCESS, info["pid"], niceness)
        info = launcher()
    return info


def memory() -> dict:
    return {"mx_peak_bytes": int(mx.get_peak_memory()),
            "mx_active_bytes": int(mx.get_active_memory()), "vm_hwm_bytes": peak_rss()}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds for ``model``."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def gather_json(obj, group: mx.distributed.Group | None) -> list:
    """Every rank's ``obj`` (JSON-able), in rank order, on every rank."""
    if group is None or group.size() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).astype(np.int32)
    n = int(mx.distributed.all_gather(mx.array([data.size]), group=group).max().item())
    pad = np.zeros(n + 1, dtype=np.int32)
    pad[0], pad[1:data.size + 1] = data.size, data
    rows = np.array(mx.distributed.all_gather(mx.array(pad)[None], group=group))
    return [json.loads(bytes(r[1:r[0] + 1].astype(np.uint8)).decode()) for r in rows]


def barrier(group: mx.distributed.Group | None) -> None:
    if group is not None and group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group))


# ----------------------------------------------------------------------------- builds


def ensure_preset_build(preset: str, cache: str | Path = "runs", progress: bool = False) -> Path:
    """``<cache>/<preset>-build``, converted from ``<cache>/<preset>-src`` (synthesized
    with seed 0 if missing); both reused when complete. Ranks sharing a machine take a
    file lock, so one writes while the others wait; on separate machines each makes
    its own (deterministic: the same build hash everywhere)."""
    if preset not in synth.PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(synth.PRESETS)}")
    cache = Path(cache)
    src, build = cache / f"{preset}-src", cache / f"{preset}-build"
    with locked(cache / f".{preset}.lock"):
        if not (src / INDEX_NAME).exists():
            synth.synthesize(src, preset, seed=0, progress=progress)
        return remake_stale(build, lambda: convert.convert(src, build, progress=progress))


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    """``n`` ids from the base vocabulary (no control tokens), seeded."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab - 256, size=n)]


# ----------------------------------------------------------------------------- routing


class _RouteRecorder(nn.Module):
    """Stands in for one MoE module during a calibration pass: routes its input with
    the module's own gate and kimi_k3's router (``compat.group_expert_select``), keeps the
    selections, then runs the module unchanged."""

    def __init__(self, moe: kimi_k3.KimiK3SparseMoE):
        super().__init__()
        self.moe = moe
        self.selected: list[mx.array] = []

    def __call__(self, x: mx.array) -> mx.array:
        m, a = self.moe, self.moe.args
        inds, _ = compat.group_expert_select(
            m.gate(x), m.e_score_correction_bias, a.num_experts_per_token,
            a.num_expert_group, a.topk_group, a.routed_scaling_factor, a.moe_renormalize)
        self.selected.append(inds)
        return m(x)


def router_selections(model, prompt: list[int]) -> dict[int, np.ndarray]:
    """Per MoE layer (model layer index): the experts the router picks for each token
    of ``prompt`` in one forward pass of ``model`` (single-process, all experts);
    ``[tokens, top_k]`` global ids."""
    layers = model.layers
    swapped = {}
    for i, layer in enumerate(layers):
        if isinstance(layer.mlp, kimi_k3.KimiK3SparseMoE):
            swapped[i] = layer.mlp
            layer.mlp = _RouteRecorder(layer.mlp)
    try:
        mx.eval(model(mx.array([prompt]), cache=model.make_cache()))
        return {i: np.concatenate([np.array(s).reshape(-1, s.shape[-1])
                                   for s in layers[i].mlp.selected])
                for i in swapped}
    finally:
        for i, moe in swapped.items():
            layers[i].mlp = moe


def selection_counts(selections: dict[int, np.ndarray], num_experts: int
                     ) -> dict[int, np.ndarray]:
    return {i: np.bincount(s.reshape(-1), minlength=num_experts).astype(np.int64)
            for i, s in selections.items()}


def routing_counts(model, prompt: list[int]) -> dict[int, np.ndarray]:
    """How often each expert is selected per MoE layer over ``prompt`` (the input of
    ``placement.load_aware``)."""
    return selection_counts(router_selections(model, prompt),
                            model.args.text_config.num_experts)


def balance(plc: placement.Placement, selections: dict[int, np.ndarray]) -> dict:
    """Mean over MoE layers of the expected largest per-rank (token, expert) pair
    count per token (the decode critical path); perfect balance is top_k / size."""
    per = [plc.expected_max_load(i, s) for i, s in selections.items()]
    k = next(iter(selections.values())).shape[-1]
    return {"expected_max_pairs_per_token": round(float(np.mean(per)), 4),
            "ideal": round(k / plc.size, 4)}


# ----------------------------------------------------------------------------- loading


def load_single(build: str | Path, dtype: str = "float32"):
    """mlx-lm's kimi_k3, whole, in this process."""
    model, config = load_model(Path(build), lazy=True, strict=True)
    model.set_dtype(loader.DTYPES[dtype])
    mx.eval(model.parameters())
    return model, config


def load_tensor_parallel(build: str | Path, group: mx.distributed.Group,
                         dtype: str = "float32"):
    """mlx-lm's own tensor parallelism: ``sharded_load`` (``kimi_k3.Model.shard``)."""
    try:
        model, _, config = sharded_load(str(build), tensor_group=group, return_config=True)
    except ValueError as e:
        tc = layout.text_config(load_config(build))
        raise ValueError(
            f"mlx-lm's kimi_k3 shard() cannot split this build over {group.size()} ranks "
            f"({e}); its experts are split by their intermediate dimension "
            f"({tc['moe_intermediate_size']}), so moe_intermediate_size / {group.size()} must "
            "be a multiple of the quantization group (32 for mxfp4): use a build with wider "
            "experts (the bench preset) or fewer ranks") from None
    model.set_dtype(loader.DTYPES[dtype])
    mx.eval(model.parameters())
    return model, config


def load_pipeline(build: str | Path, group: mx.distributed.Group, dtype: str = "float32"):
    """mlx-lm's own pipeline parallelism (``model.language_model.model.pipeline``).
    Not ``sharded_load``: it pipelines only models with ``model.model.pipeline``."""
    model, config = load_model(Path(build), lazy=True, strict=True)
    model.language_model.model.pipeline(group)
    model.set_dtype(loader.DTYPES[dtype])
    mx.eval(model.parameters())
    barrier(group)
    return model, config


def slice_for_rank(build: str | Path, out: str | Path, group: mx.distributed.Group,
                   plc: placement.Placement | None, attention: str = "split") -> Path:
    """This rank's folder of ``build`` under ``out`` (each rank writes its own, so
    this works on one machine or several)."""
    return slicing.slice_rank(build, Path(out) / f"rank{group.rank()}", group.rank(),
                              group.size(), plc, progress=False, attention=attention)


# ----------------------------------------------------------------------------- stepping


def prefill(model, prompts: list[int] | list[list[int]]) -> tuple[list, int | list[int], float]:
    """A fresh cache filled with ``prompts`` (one forward; a list of equal-length prompts
    is one batch), the greedy next token (a list for a batch), and the seconds it took."""
    batch = bool(prompts) and isinstance(prompts[0], list)
    rows = prompts if batch else [prompts]
    cache = model.make_cache()
    t = time.perf_counter()
    logits = model(mx.array(rows), cache=cache)
    toks = mx.argmax(logits[:, -1], axis=-1).tolist()
    return cache, (toks if batch else toks[0]), time.perf_counter() - t


def decode_steps(model, cache, token: int | list[int], n: int
                 ) -> tuple[list, list[float]]:
    """``n`` greedy decode steps from ``token`` (one per row for a batch, every row one
    step per forward, in lockstep): tokens (per step: an int, or a list for a batch) and
    ms per step."""
    batch = isinstance(token, list)
    cur = token if batch else [token]
    toks, ms = [], []
    for _ in range(n):
        t = time.perf_counter()
        logits = model(mx.array(cur)[:, None], cache=cache)
        cur = mx.argmax(logits[:, -1], axis=-1).tolist()
        ms.append((time.perf_counter() - t) * 1e3)
        toks.append(cur if batch else cur[0])
    return toks, ms


# ----------------------------------------------------------------------------- collectives


def _time(fn: Callable[[], mx.array], trials: int, group) -> list[float]:
    mx.eval(fn())  # warm-up
    barrier(group)
    out = []
    for _ in range(trials):
        t = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - t) * 1e3)
    return out


def time_all_sum(group, width: int, tokens: int = 1, trials: int = 30) -> list[float]:
    """ms per ``all_sum`` of a float32 ``[1, tokens, width]``."""
    x = mx.ones((1, tokens, width), dtype=mx.float32)
    return _time(lambda: mx.distributed.all_sum(x, group=group), trials, group)


def time_all_gather(group, width: int, tokens: int = 1, trials: int = 30) -> list[float]:
    x = mx.ones((1, tokens, width), dtype=mx.float32)
    return _time(lambda: mx.distributed.all_gather(x, group=group), trials, group)


def time_send_recv(group, width: int, tokens: int = 1, trials: int = 30) -> list[float]:
    """ms for one hop of a float32 ``[1, tokens, width]`` between ranks 0 and 1: a
    ping-pong, halved (other ranks idle)."""
    x = mx.ones((1, tokens, width), dtype=mx.float32)
    r = group.rank()

    def ping() -> mx.array:
        if r == 0:
            mx.eval(mx.distributed.send(x, 1, group=group))
            return mx.distributed.recv_like(x, 1, group=group)
        if r == 1:
            y = mx.distributed.recv_like(x, 0, group=group)
            mx.eval(y)
            return mx.distributed.send(y, 0, group=group)
        return x

    return [t / 2 for t in _time(ping, trials, group)]


def collective_plan(model, group: mx.distributed.Group | None) -> list[dict]:
    """The collectives one forward of ``model`` issues on this rank, read from its
    structure: ``{"op", "width", "count", "what"}`` (payload ``[1, T, width]``
    float32 for T tokens). all_sum for k3dist EP's MoE layers and mlx-lm TP's
    sharded-to-all layers and MoE layers; for mlx-lm's pipeline the hops (send/recv
    from rank r+1 to r, each rank's packed AttnRes blocks + hidden) and the final
    all_gather."""
    plan: dict[tuple[str, int, str], int] = {}

    def add(op: str, width: int, what: str, n: int = 1) -> None:
        plan[(op, width, what)] = plan.get((op, width, what), 0) + n

    tm = model.language_model.model
    hidden = tm.args.hidden_size
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, ExpertParallelMoE):
            if mlp.group is not None:
                w = mlp.latent_size or hidden
                add("all_sum", w + hidden if mlp._shared_split else w, "moe routed+shared")
        elif isinstance(mlp, kimi_k3.KimiK3SparseMoE) and mlp.sharding_group is not None:
            w = mlp.latent_size or hidden
            add("all_sum", w + hidden if mlp.shared_experts is not None else w,
                "moe routed+shared")
        for _, m in layer.named_modules():
            if isinstance(m, (ShardedToAllLinear, QuantizedShardedToAllLinear, SumLinear,
                              QuantizedSumLinear)):
                add("all_sum", int(m.weight.shape[0]), "sharded-to-all linear")
    if tm.pipeline_size > 1:
        # rows rank r receives from r+1: its AttnRes blocks so far + the hidden state
        mine = (tm.in_blocks + 1) if tm.use_attn_res else 1
        rows = np.array(mx.distributed.all_gather(mx.array([mine]), group=group)).reshape(-1)
        for r in range(tm.pipeline_size - 1):
            add("send_recv", int(rows[r]) * hidden, f"pipeline hop {r + 1}->{r}")
        add("all_gather", hidden, "pipeline output")
    return [{"op": op, "width": w, "count": n, "what": what}
            for (op, w, what), n in sorted(plan.items())]


_TIMERS = {"all_sum": time_all_sum, "all_gather": time_all_gather, "send_recv": time_send_recv}


def price_plan(plan: list[dict], group, tokens: int, trials: int,
               memo: dict | None = None) -> dict:
    """Microbenchmark each collective of ``plan`` at ``tokens`` tokens; the step's
    estimated communication is the sum of count x median."""
    memo = {} if memo is None else memo
    rows, total = [], 0.0
    for c in plan:
        key = (c["op"], c["width"], tokens)
        if key not in memo:
            memo[key] = stats(_TIMERS[c["op"]](group, c["width"], tokens, trials))
        s = memo[key]
        total += c["count"] * s["median"]
        rows.append({**c, "tokens": tokens, "bytes": 4 * tokens * c["width"], "ms": s})
    return {"collectives": rows, "estimated_ms": round(total, 4)}


# ----------------------------------------------------------------------------- compare


@dataclass
class Mode:
    name: str
    model: object
    collectives: bool = True  # False: EP with the MoE all_sum bypassed (compute only)
    batch: int = 1  # prompts decoded together in lockstep
    prefill_s: list[float] = field(default_factory=list)
    decode_ms: list[list[float]] = field(default_factory=list)  # per round
    tokens: list[int] = field(default_factory=list)
    cache: list | None = None
    next_token: int = 0

    def run(self, fn):
        if self.collectives:
            return fn()
        self.model.set_collectives(False)
        try:
            return fn()
        finally:
            self.model.set_collectives(True)


PARALLEL = ("ep_contiguous", "ep_load_aware", "ep_split", "tp", "pp", "single")
COMPUTE_ONLY = {"ep_contiguous": "ep_contiguous_nocomm", "ep_load_aware": "ep_load_aware_nocomm",
                "ep_split": "ep_split_nocomm"}
# modes also timed at batch > 1 (CompareSettings.batches)
BATCHED = ("ep_contiguous", "ep_split", "tp", "pp")


def batch_name(mode: str, batch: int) -> str:
    return mode if batch == 1 else f"{mode}@b{batch}"


@dataclass
class CompareSettings:
    prompt_len: int = 64
    prefill_rounds: int = 3
    decode_rounds: int = 12
    steps_per_round: int = 4
    warmup_steps: int = 2
    calib_len: int = 128
    comm_trials: int = 30
    seed: int = 0
    dtype: str = "float32"
    moe_form: str = "auto"
    batches: tuple[int, ...] = (1, 4, 8)  # decode batch sizes (prompts in lockstep)


def _rotated(names: list[str], i: int) -> list[str]:
    k = i % len(names)
    return names[k:] + names[:k]


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio_rounds(num: list[float], den: list[float]) -> list[float]:
    """Speed ratio per round: ``num`` time / ``den`` time (> 1: ``den`` faster)."""
    return [n / d for n, d in zip(num, den, strict=True)]


def compare(build: str | Path, group: mx.distributed.Group, s: CompareSettings,
            tmp: str | Path | None = None, log: Callable[[str], None] = print) -> dict:
    """k3dist EP (contiguous and load-aware placement) vs mlx-lm TP, PP and a single
    process, on every rank of ``group`` (one ``mlx.launch`` run); this rank's report
    (merge with ``merge_compare``)."""
    rank, size = group.rank(), group.size()
    tc = layout.text_config(load_config(build))
    vocab = tc["vocab_size"]
    prompt = random_prompt(vocab, s.prompt_len, s.seed)
    calib = random_prompt(vocab, s.calib_len, s.seed + 1)
    form = resolve_form(s.moe_form)
    t0 = time.perf_counter()

    single, _ = load_single(build, s.dtype)
    # Routing counts from rank 0's single-process model, shared, so every rank builds
    # the same placement even where its floats would differ (another machine).
    moe = layout.moe_layers(tc)
    stacked = np.zeros((len(moe), tc["num_experts"]), dtype=np.int64)
    if rank == 0:
        calib_sel = router_selections(single, calib)
        held_out = router_selections(single, prompt)
        c = selection_counts(calib_sel, tc["num_experts"])
        stacked = np.stack([c[i] for i in moe])
    stacked = np.array(mx.distributed.all_sum(mx.array(stacked.astype(np.int32)),
                                              group=group)).astype(np.int64)
    counts = {i: stacked[j] for j, i in enumerate(moe)}
    plcs = {"ep_contiguous": placement.contiguous(tc["num_experts"], size, moe),
            "ep_load_aware": placement.load_aware(counts, size)}
    placements = {n: {"kind": p.kind, "hash": p.hash} for n, p in plcs.items()}
    if rank == 0:
        for n, p in plcs.items():
            placements[n].update(balance_calibration=balance(p, calib_sel),
                                 balance_benchmark_prompt=balance(p, held_out))
    log(f"rank {rank}: calibration + placements {time.perf_counter() - t0:.1f}s")

    models: dict[str, object] = {"single": single}
    skipped: dict[str, str] = {}
    # ep_contiguous / ep_load_aware: attention replicated on every rank; ep_split: split
    # by heads (contiguous placement), the default deployment
    eps = {n: (p, "replicated") for n, p in plcs.items()}
    eps["ep_split"] = (plcs["ep_contiguous"], "split")
    with tempfile.TemporaryDirectory(prefix="k3dist-bench-", dir=tmp) as td:
        for name, (plc, attention) in eps.items():
            folder = slice_for_rank(build, Path(td) / name, group, plc, attention)
            models[name], _, _ = loader.load_rank(folder, group, s.dtype, form)
    try:
        models["tp"], _ = load_tensor_parallel(build, group, s.dtype)
    except ValueError as e:  # the same shapes on every rank: all skip together
        skipped["tp"] = str(e)
    models["pp"], _ = load_pipeline(build, group, s.dtype)
    log(f"rank {rank}: loaded {sorted(models)} {time.perf_counter() - t0:.1f}s")

    weights = {n: weight_bytes(m) for n, m in models.items()}
    modes: dict[str, Mode] = {}
    for B in s.batches:
        for n in PARALLEL:
            if n in models and (B == 1 or n in BATCHED):
                modes[batch_name(n, B)] = Mode(batch_name(n, B), models[n], batch=B)
    for n, c in COMPUTE_ONLY.items():
        if n in models:
            modes[c] = Mode(c, models[n], collectives=False)
    names = list(modes)
    # Row j of every batch is the same prompt: row 0 is the batch-1 prompt.
    rows = [prompt] + [random_prompt(vocab, s.prompt_len, s.seed + 100 + j)
                       for j in range(1, max(s.batches))]

    def inputs(m: Mode):
        return prompt if m.batch == 1 else rows[:m.batch]

    launch0, w0 = launcher(), time.perf_counter()
    # Warm-up: every mode's prefill shape and decode, compiled before timing.
    for m in modes.values():
        barrier(group)
        cache, tok, _ = m.run(lambda m=m: prefill(m.model, inputs(m)))
        m.run(lambda m=m, c=cache, t=tok: decode_steps(m.model, c, t, s.warmup_steps))
    log(f"rank {rank}: warm-up done {time.perf_counter() - t0:.1f}s")

    for i in range(s.prefill_rounds):
        for n in _rotated(names, i):
            m = modes[n]
            if m.batch > 1 and i:  # batches: prefill once (decode is what is compared)
                continue
            barrier(group)
            m.cache, m.next_token, sec = m.run(lambda m=m: prefill(m.model, inputs(m)))
            if m.batch == 1:
                m.prefill_s.append(sec)
    for m in modes.values():  # greedy sequence: prefill's token, then every decode step
        m.tokens = [m.next_token]
        barrier(group)
        toks, _ = m.run(lambda m=m: decode_steps(m.model, m.cache, m.next_token,
                                                 s.warmup_steps))
        m.tokens += toks
        m.next_token = toks[-1]
    for i in range(s.decode_rounds):
        for n in _rotated(names, i):
            m = modes[n]
            barrier(group)
            toks, ms = m.run(lambda m=m: decode_steps(m.model, m.cache, m.next_token,
                                                      s.steps_per_round))
            m.tokens += toks
            m.next_token = toks[-1]
            m.decode_ms.append(ms)
    barrier(group)
    launch1, w1 = launcher(), time.perf_counter()
    log(f"rank {rank}: timed rounds done {time.perf_counter() - t0:.1f}s")
    launch = None
    if launch0 and launch1:
        launch = {"pid": launch1["pid"], "nice": launch1["nice"],
                  "cpu_cores_used_while_timing": round(
                      (launch1["cpu_s"] - launch0["cpu_s"]) / (w1 - w0), 3)}

    counted = {}
    for n, m in models.items():
        if n != "single":
            barrier(group)
            counted[n] = {"collectives_per_token": introspect.collectives_per_token(m),
                          "weight_bytes": introspect.bytes_held(m)}
    comm = {}
    memo: dict = {}
    for n in PARALLEL:
        if n in models and n != "single":
            plan = collective_plan(models[n], group)
            comm[n] = {"decode": price_plan(plan, group, 1, s.comm_trials, memo),
                       "prefill": price_plan(plan, group, s.prompt_len,
                                             max(5, s.comm_trials // 3), memo)}

    return {
        "rank": rank, "size": size,
        "settings": {**s.__dict__, "moe_form_resolved": form},
        "skipped": skipped,
        "placements": placements,
        "routing_counts": {str(i): c.tolist() for i, c in counts.items()},
        "weights_bytes": weights,
        "memory": memory(),
        "trials": {n: {"batch": m.batch, "prefill_s": [round(x, 5) for x in m.prefill_s],
                       "decode_ms": [[round(x, 4) for x in r] for r in m.decode_ms]}
                   for n, m in modes.items()},
        # batch-1 modes: one token per step; batches: the tokens of row 0 (the batch-1
        # prompt) and of the whole batch
        "tokens": {n: m.tokens for n, m in modes.items() if m.collectives and m.batch == 1},
        "batch_tokens": {n: m.tokens for n, m in modes.items() if m.batch > 1},
        "collectives": comm,
        "counted": counted,
        "launcher": launch,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def summarize(rep: dict) -> dict:
    """Per mode: prefill tok/s, decode step ms and tok/s, compute vs communication;
    speed ratios per interleaved round, then median."""
    P = rep["settings"]["prompt_len"]
    tr = rep["trials"]
    round_ms = {n: [float(np.mean(r)) for r in t["decode_ms"]] for n, t in tr.items()}
    out: dict = {}
    for n, t in tr.items():
        steps = [x for r in t["decode_ms"] for x in r]
        st = stats(steps)
        B = t.get("batch", 1)
        out[n] = {"batch": B, "decode_step_ms": st,
                  "decode_tok_s": round(1e3 / st["median"], 3),  # per request
                  "decode_tok_s_aggregate": round(B * 1e3 / st["median"], 3)}
        if t["prefill_s"]:
            out[n].update(prefill_s=stats(t["prefill_s"]),
                          prefill_tok_s=round(P / float(np.median(t["prefill_s"])), 2))
    for n, c in COMPUTE_ONLY.items():
        if n not in out:
            continue
        comm = [a - b for a, b in zip(round_ms[n], round_ms[c], strict=True)]
        pre = [a - b for a, b in zip(tr[n]["prefill_s"], tr[c]["prefill_s"], strict=True)]
        est = rep["collectives"].get(n, {})
        out[n]["split"] = {
            "method": "measured: the same steps with the MoE all_sum bypassed give compute; "
                      "communication = total - compute, paired per round (so it includes "
                      "waiting for the slower rank and the collective's busy-wait)",
            "decode_compute_ms": out[c]["decode_step_ms"]["median"],
            "decode_comm_ms": stats(comm),
            "decode_transfer_estimated_ms": est.get("decode", {}).get("estimated_ms"),
            "prefill_compute_s": out[c]["prefill_s"]["median"],
            "prefill_comm_s": stats(pre),
            "all_sums_per_step": sum(x["count"] for x in est.get("decode", {}).get(
                "collectives", [])),
        }
    for n, method in (("tp", "estimated: all_sum microbenchmark (both ranks idle but for "
                             "it) at each payload x count per step, read from the sharded "
                             "model; compute = total - that, so it includes waiting for "
                             "the peer (not separable: ring has no group split to bypass)"),
                      ("pp", "estimated: send/recv one-way (ping-pong / 2) per pipeline hop + "
                             "the final all_gather, microbenchmarked at each payload; "
                             "compute = total - that, so it includes waiting for the other "
                             "stage (a pipeline runs its stages one after the other)")):
        if n not in out:
            continue
        est = rep["collectives"][n]
        d, p = est["decode"]["estimated_ms"], est["prefill"]["estimated_ms"]
        out[n]["split"] = {
            "method": method,
            "decode_compute_ms": round(out[n]["decode_step_ms"]["median"] - d, 4),
            "decode_comm_ms": {"median": d},
            "decode_transfer_estimated_ms": d,
            "prefill_compute_s": round(out[n]["prefill_s"]["median"] - p / 1e3, 4),
            "prefill_comm_s": {"median": round(p / 1e3, 5)},
            "collectives_per_step": sum(x["count"] for x in est["decode"]["collectives"]),
        }
    if "single" in out:
        out["single"]["split"] = {"method": "no collectives",
                                  "decode_compute_ms": out["single"]["decode_step_ms"]["median"],
                                  "decode_comm_ms": {"median": 0.0},
                                  "decode_transfer_estimated_ms": 0.0}

    ratios: dict = {}
    per_round: dict = {}
    for ep, tag in (("ep_contiguous", "ep"), ("ep_load_aware", "ep_la"),
                    ("ep_split", "ep_split")):
        for other in ("tp", "pp", "single", "ep_contiguous"):
            if ep in tr and other in tr and other != ep:
                d = _ratio_rounds(round_ms[other], round_ms[ep])
                p = _ratio_rounds(tr[other]["prefill_s"], tr[ep]["prefill_s"])
                per_round[f"{tag}_over_{other}_decode"] = [round(x, 4) for x in d]
                per_round[f"{tag}_over_{other}_prefill"] = [round(x, 4) for x in p]
                ratios[f"{tag}_over_{other}_decode"] = round(float(np.median(d)), 4)
                ratios[f"{tag}_over_{other}_prefill"] = round(float(np.median(p)), 4)
    if "ep_contiguous" in tr and "ep_load_aware" in tr:
        d = _ratio_rounds(round_ms["ep_contiguous"], round_ms["ep_load_aware"])
        ratios["ep_la_over_ep_decode"] = round(float(np.median(d)), 4)
        per_round["ep_la_over_ep_decode"] = [round(x, 4) for x in d]
    # batches: aggregate throughput at batch B over batch 1 (same mode), and modes
    # against each other at the same batch; per round, then median
    for n in BATCHED:
        for name, t in tr.items():
            B = t.get("batch", 1)
            if B == 1 or not name.startswith(f"{n}@") or n not in tr:
                continue
            d = [B * x for x in _ratio_rounds(round_ms[n], round_ms[name])]
            key = f"{n}_batch{B}_over_batch1"
            ratios[key] = round(float(np.median(d)), 4)
            per_round[key] = [round(x, 4) for x in d]
            if n == "ep_split":
                for other in ("tp", "pp", "ep_contiguous"):
                    o = batch_name(other, B)
                    if o in tr:
                        d = _ratio_rounds(round_ms[o], round_ms[name])
                        key = f"ep_split_over_{other}_decode_batch{B}"
                        ratios[key] = round(float(np.median(d)), 4)
                        per_round[key] = [round(x, 4) for x in d]
    return {"modes": out, "ratios": ratios, "ratios_per_round": per_round}


def merge_compare(reports: list[dict], env: dict, build: str | Path) -> dict:
    """One JSON from every rank's ``compare`` report."""
    r0 = reports[0]
    ref = r0["tokens"].get("single", [])
    agree = {}
    for n, toks in r0["tokens"].items():
        mm = _first_mismatch(toks, ref)
        agree[n] = {"same_as_single": mm is None, "first_mismatch": mm}
    ranks_agree = {n: all(r["tokens"][n] == toks for r in reports)
                   for n, toks in r0["tokens"].items()}
    # a request's greedy tokens must not depend on the rest of its batch (float noise
    # may flip a near-tie: the first step that differs is reported)
    batch_row0 = {}
    for n, toks in r0.get("batch_tokens", {}).items():
        alone = r0["tokens"].get(n.split("@")[0], [])
        mm = _first_mismatch([t[0] for t in toks], alone)
        batch_row0[n] = {"same_as_batch1": mm is None, "first_mismatch": mm}
    summaries = [summarize(r) for r in reports]
    bm = json.loads((Path(build) / "k3dist.json").read_text()) if (
        Path(build) / "k3dist.json").exists() else {}
    tc = layout.text_config(load_config(build))
    return {
        **env,
        "build": repo_path(build), "build_hash": bm.get("build_hash"),
        "model": {k: tc.get(k) for k in ("num_hidden_layers", "hidden_size", "num_experts",
                                          "num_experts_per_token", "moe_intermediate_size",
                                          "routed_expert_hidden_size", "vocab_size")},
        "size": r0["size"],
        "settings": r0["settings"],
        "skipped": r0["skipped"],
        "placements": r0["placements"],
        "greedy_tokens": {"tokens": r0["tokens"], "vs_single": agree,
                          "identical_across_ranks": ranks_agree,
                          "all_modes_agree": all(a["same_as_single"] for a in agree.values()),
                          "batch_row0_vs_batch1": batch_row0},
        "launcher": r0.get("launcher"),
        "ratios": summaries[0]["ratios"],
        "ratios_note": "speed ratios (other mode's time / EP's time), > 1: EP faster; per "
                       "interleaved round, then median; from rank 0 (ratios_by_rank: all)",
        "ratios_by_rank": [s["ratios"] for s in summaries],
        "summary": summaries[0]["modes"],
        "summary_by_rank": [s["modes"] for s in summaries],
        "ratios_per_round": summaries[0]["ratios_per_round"],
        "ranks": reports,
    }


# ----------------------------------------------------------------------------- decode


@dataclass
class DecodeSettings:
    prompt_lens: tuple[int, ...] = (16, 64, 128)
    prefill_trials: int = 3
    context_len: int = 64
    decode_trials: int = 40
    warmup_steps: int = 3
    comm_trials: int = 50
    seed: int = 0


def decode_report(model, group: mx.distributed.Group, vocab: int, s: DecodeSettings) -> dict:
    """This rank's figures for an expert-parallel model: prefill tok/s per prompt
    length, decode step (batch 1) with collectives and bypassed (compute), the
    difference (communication), an all_sum microbenchmark at the step's payload."""
    t0 = time.perf_counter()
    prefill_out = {}
    for L in s.prompt_lens:
        prompt = random_prompt(vocab, L, s.seed + L)
        barrier(group)
        prefill(model, prompt)  # warm-up: compile this shape
        secs = []
        for _ in range(s.prefill_trials):
            barrier(group)
            secs.append(prefill(model, prompt)[2])
        st = stats(secs, 5)
        prefill_out[str(L)] = {"seconds": st, "tok_s": round(L / st["median"], 2),
                               "trials_s": [round(x, 5) for x in secs]}

    prompt = random_prompt(vocab, s.context_len, s.seed)
    with_c = Mode("collectives", model)
    without = Mode("bypassed", model, collectives=False)
    for m in (with_c, without):
        barrier(group)
        m.cache, m.next_token, _ = m.run(lambda m=m: prefill(model, prompt))
        toks, _ = m.run(lambda m=m: decode_steps(model, m.cache, m.next_token,
                                                 s.warmup_steps))
        m.next_token = toks[-1]
    for i in range(s.decode_trials):  # interleaved, one step each, order alternating
        for m in ((with_c, without) if i % 2 == 0 else (without, with_c)):
            barrier(group)
            toks, ms = m.run(lambda m=m: decode_steps(model, m.cache, m.next_token, 1))
            m.next_token = toks[-1]
            m.decode_ms.append(ms)
    total = [r[0] for r in with_c.decode_ms]
    compute = [r[0] for r in without.decode_ms]
    plan = collective_plan(model, group)
    est = price_plan(plan, group, 1, s.comm_trials)
    st = stats(total)
    return {
        "rank": group.rank(), "size": group.size(),
        "settings": s.__dict__ | {"prompt_lens": list(s.prompt_lens)},
        "weights_bytes": weight_bytes(model),
        "prefill": prefill_out,
        "decode": {
            "context_len": s.context_len,
            "step_ms": st, "tok_s": round(1e3 / st["median"], 3),
            "compute_ms": stats(compute),
            "comm_ms": stats([a - b for a, b in zip(total, compute, strict=True)]),
            "comm_method": "measured: the same steps with the MoE all_sum bypassed give "
                           "compute; communication = total - compute, paired per trial "
                           "(includes waiting for the slower rank)",
            "all_sums_per_step": sum(c["count"] for c in plan if c["op"] == "all_sum"),
            "all_sum_microbenchmark": est,
            "trials_ms": {"total": [round(x, 4) for x in total],
                          "compute": [round(x, 4) for x in compute]},
        },
        "memory": memory(),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - t0, 1),
    }
