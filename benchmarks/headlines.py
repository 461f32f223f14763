"""What benchmarks/README.md shows of each benchmark, declared once: its results files'
name, its subject, the script that makes it, one line on what it measures, and its
headline figures as paths into its JSON (``benchmarks/index.py`` renders them)."""

from __future__ import annotations

from dataclasses import dataclass

SUBJECTS = {
    "speed": "Speed: decode and prefill, measured here and projected",
    "quality": "Quality: low-bit builds against their MXFP4 teacher",
    "memory": "Memory: peak RSS against the bounds",
    "pipeline": "Build pipeline: plans, disk, the 93-layer rehearsal, weights checks",
    "serving": "Serving: prompt caches, idle, metrics",
    "agents": "Coding agents",
    "faults": "Faults and hostile traffic",
    "train": "Training the minis",
    "other": "Not declared in benchmarks/index.py",
}


@dataclass(frozen=True)
class Pick:
    """The element of a list of objects whose ``key`` equals ``value``."""

    key: str
    value: str | int


ALL = "*"  # every element of a list or value of an object (then ``Figure.agg`` joins them)
Step = str | int | Pick


@dataclass(frozen=True)
class Figure:
    """A headline figure: the value at ``path`` in a run's JSON, divided by ``scale``,
    formatted with ``fmt``; with ``ALL`` in the path, ``agg`` (max, min, sum, count) of them."""

    label: str
    path: tuple[Step, ...]
    fmt: str = "{}"
    scale: float = 1.0
    agg: str | None = None


@dataclass(frozen=True)
class Benchmark:
    name: str  # the results files' name (and every ``<name>-<suffix>``)
    subject: str  # a key of SUBJECTS
    script: str  # what makes it: a script under benchmarks/ or a module
    what: str  # one line: what it measures, on what
    figures: tuple[Figure, ...] = ()
    projection: bool = False  # a model's numbers, not a measurement: constants in the JSON
    command: tuple[tuple[Step, ...], ...] = (("command",),)  # the first found


def F(label: str, *path: Step, fmt: str = "{}", scale: float = 1.0, agg: str | None = None):
    return Figure(label, path, fmt, scale, agg)


GB = {"fmt": "{:.1f} GB", "scale": 1e9}
MB = {"fmt": "{:.0f} MB", "scale": 1e6}
TB = {"fmt": "{:.3f} TB", "scale": 1e12}
S = {"fmt": "{:.2f} s"}
PCT = {"fmt": "{:.1%}"}


def _q(build: str, key: str, fmt: str = "{:.5f}") -> Figure:
    """A quality report's row figure (``k3dist.bench.evaluate``'s rows, by build)."""
    return F(f"{key} {build}", "rows", Pick("build", build), key, fmt=fmt)


BENCHMARKS: tuple[Benchmark, ...] = (
    # speed
    Benchmark(
        "decode",
        "speed",
        "speed/ep_decode.py",
        "one EP deployment per box (mlx.launch): prefill tok/s by prompt length, decode step "
        "and tok/s at batch 1, split into compute and communication, peak memory",
        (
            F("rank 0 decode tok/s", "ranks", 0, "decode", "tok_s"),
            F("rank 0 step ms", "ranks", 0, "decode", "step_ms", "median", fmt="{:.1f}"),
        ),
    ),
    Benchmark(
        "compare",
        "speed",
        "speed/ep_vs_tp_pp.py",
        "k3dist EP (attention replicated, load-aware, split) vs mlx-lm TP, PP and one "
        "process in one run, interleaved; ratios per round (> 1: EP faster)",
        (
            F("EP-split / TP decode", "ratios", "ep_split_over_tp_decode"),
            F("EP / TP decode", "ratios", "ep_over_tp_decode"),
            F("EP / PP decode", "ratios", "ep_over_pp_decode"),
            F("EP / single prefill", "ratios", "ep_over_single_prefill"),
        ),
    ),
    Benchmark(
        "prefill-compare",
        "speed",
        "speed/prefill_ep_vs_tp.py",
        "prefill of one prompt in chunks, EP-split vs mlx-lm TP, interleaved rounds",
        (
            F("EP-split / TP time, chunk 32", "ep_split_over_tp_time", "32"),
            F("chunk 128", "ep_split_over_tp_time", "128"),
        ),
    ),
    Benchmark(
        "moe-step",
        "speed",
        "speed/moe_step.py",
        "one MoE layer's expert compute on rank 0 of N: the cost of non-owned pairs per form",
        (
            F("placeholder ms", "median_ms", "placeholder"),
            F("local ms", "median_ms", "local"),
            F("owned only ms", "median_ms", "owned"),
        ),
    ),
    Benchmark(
        "graded-step",
        "speed",
        "speed/graded_step.py",
        "one MoE layer's decode step, graded (two banks) vs single bank (ratio to 2-bit)",
        (
            F("graded k_hi 2", "ratio_vs_single_lo", "layer/graded-k2"),
            F("graded k_hi 4", "ratio_vs_single_lo", "layer/graded-k4"),
            F("MXFP4 single bank", "ratio_vs_single_lo", "layer/single-mxfp4"),
        ),
    ),
    Benchmark(
        "graded-decode",
        "speed",
        "speed/graded_decode.py",
        "whole-model decode step of graded builds vs their single-bank build, interleaved",
        (
            F("builds", "rows", ALL, "ratio", agg="count"),
            F("slowest ratio", "rows", ALL, "ratio", agg="max"),
        ),
    ),
    Benchmark(
        "routing",
        "speed",
        "speed/routing_skew.py",
        "EP load imbalance on the trained mini-K3's real routing vs uniform (skew: measured / "
        "uniform experts read on the busiest rank)",
        (
            F("skew 2 ranks, batch 1", "results", "2/contiguous/1", "skew"),
            F("batch 8", "results", "2/contiguous/8", "skew"),
        ),
    ),
    Benchmark(
        "project",
        "speed",
        "speed/project.py",
        "projected decode tok/s of the real K3 on two M3 Ultras from the cost model "
        "(k3dist.bench.costmodel); batch 8 aggregate where asked",
        (
            F("plan EP-split ring", "summary_tok_s", "plan-split", "ring", "ep-split"),
            F("plan EP-split JACCL", "summary_tok_s", "plan-split", "jaccl", "ep-split"),
            F("graded EP-split JACCL", "summary_tok_s", "graded", "jaccl", "ep-split"),
            F("mxfp4 EP-split JACCL", "summary_tok_s", "mxfp4", "jaccl", "ep-split"),
        ),
        projection=True,
    ),
    Benchmark(
        "project-prefill",
        "speed",
        "speed/project.py --prefill",
        "projected time to first token: cold, by chunk, and a cached 20K prefix (MXFP4, JACCL)",
        (
            F(
                "cold 20K TTFT s",
                *("prefill", "mxfp4", "jaccl", "cold_chunk_512", "headline"),
                *("ep-split/local", "20480", "ttft_s"),
            ),
            F(
                "cached 20K + 64 warm s",
                *("prefill", "mxfp4", "jaccl", "cached_prefix", "20480", "ttft", "headline"),
                *("warm_in_memory", "new_turn_64", "ttft_cached_s"),
            ),
        ),
        projection=True,
    ),
    Benchmark(
        "speed",
        "speed",
        "speed/published_fit.py",
        "the cost model's free terms fitted to published two-M3-Ultra runs; the default build "
        "projected with them, against the goals",
        (
            F("best decode b1 tok/s", "goals", "decode_b1_tok_s", "best_projected"),
            F("goal", "goals", "decode_b1_tok_s", "goal"),
            F("best prefill 8K tok/s", "goals", "prefill_8k_tok_s", "best_projected"),
            F("goal", "goals", "prefill_8k_tok_s", "goal"),
        ),
        projection=True,
    ),
    # quality
    Benchmark(
        "quality",
        "quality",
        "quality/graded_scores.py",
        "uniform, mixed2, graded (every sensitivity score, per-layer and global) and DWQ builds "
        "of the trained mini-K3 vs its MXFP4 teacher: KL, top-1 flip, perplexity",
        (
            F("builds", "rows", ALL, "kl", agg="count"),
            F("lowest KL", "rows", ALL, "kl", agg="min", fmt="{:.5f}"),
        ),
        command=(("driver",), ("command",)),  # the script's, then evaluate's
    ),
    Benchmark(
        "quality-bits",
        "quality",
        "quality/quality_bits.py",
        "the quality table at the real plan's operating points on data/mini-k3-sparse "
        "(128-wide experts): uniform 2/3-bit, graded at a target bpw, DWQ rows",
        (
            _q("2bit-g64", "kl"),
            _q("graded-2.5944-2bit-g128", "kl"),
            _q("graded-2.5944-2bit-g128-dwq", "kl"),
            F("closes of 2bit-g64", "closes", "graded-2.5944-2bit-g128", **PCT),
        ),
        command=(("pipeline", "command"), ("command",)),  # the script's, then evaluate's
    ),
    Benchmark(
        "quality-grid",
        "quality",
        "quality/quality_grid.py",
        "the grid the planner picks the lo bank by: expert bpw x lo format x score student "
        "(k3dist/data/quality-grid.json is its compact copy)",
        (F("rows", "rows", ALL, "kl", agg="count"),),
        command=(("command",), ("provenance", "command")),
    ),
    Benchmark(
        "nonexpert",
        "quality",
        "quality/nonexpert.py",
        "each non-expert tensor class alone at 8/6/5/4 bits: KL to the teacher (what "
        "`plan --nonexpert-sensitivity` reads)",
        (F("rows", "rows", ALL, "kl", agg="count"),),
    ),
    Benchmark(
        "ppl-mini-k3-sparse",
        "quality",
        "k3dist.factory (train/README.md)",
        "held-out perplexity of the retrained sparse mini-K3 (teacher and unigram)",
        (
            F("code ppl (8 windows)", "teacher_8", "code", "ppl", fmt="{:.2f}"),
            F("prose ppl", "teacher_8", "prose", "ppl", fmt="{:.2f}"),
        ),
    ),
    # memory
    Benchmark(
        "convert-memory",
        "memory",
        "memory/convert_memory.py",
        "peak RSS of a conversion against the streaming bound",
        (
            F("peak over baseline", "result", "peak_rss", **MB),
            F("bound over baseline", "result", "bound_over_baseline", **MB),
            F("seconds", "result", "seconds"),
        ),
    ),
    Benchmark(
        "stream-memory",
        "memory",
        "memory/stream_memory.py",
        "peak RSS of the streamed teacher and of calibration vs the whole model (`bench`)",
        (
            F("teacher peak", "teacher", "peak_rss", **MB),
            F("calibrate peak", "calibrate", "peak_rss", **MB),
            F("calibrate bound", "calibrate", "bound", **MB),
            F("whole model", "whole_model", "peak_rss", **MB),
        ),
    ),
    Benchmark(
        "expert-grad-memory",
        "memory",
        "memory/expert_grad_memory.py",
        "peak RSS of one expert-bank backward: plain mx.grad vs the chunked bank_grads",
        (F("largest peak over baseline", "rows", ALL, "peak_over_baseline", agg="max", **MB),),
    ),
    Benchmark(
        "dwq-memory",
        "memory",
        "memory/dwq_memory.py",
        "peak RSS of a DWQ run on `bench`, chunked vs plain expert gradient; the real-K3 bound",
        (F("real K3 bound", "real_k3_bound", "total", **GB),),
    ),
    Benchmark(
        "dwq-memory-bounds",
        "memory",
        "memory/dwq_memory.py --bound-only",
        "the real K3's DWQ memory bound by lo bank and Adam state dtype",
        (
            F("2bit-g128, bf16 state", "real_k3_bounds", "2bit-g128-bf16-state", "total", **GB),
            F("2bit-g64, f32 state", "real_k3_bounds", "2bit-g64-f32-state", "total", **GB),
        ),
        projection=True,
    ),
    Benchmark(
        "vision-memory",
        "memory",
        "memory/vision_memory.py",
        "bytes per rank with and without the vision tower (layouts); the tower's peak memory",
        (
            F("K3 tower BF16", "kimi_k3", "tower_bf16", fmt="{:.2f} GB", scale=1e9),
            F("mini tower BF16", "mini_k3", "tower_bf16", fmt="{:.0f} kB", scale=1e3),
        ),
    ),
    # pipeline
    Benchmark(
        "plan-k3",
        "pipeline",
        "k3dist.pipeline.plan",
        "the real K3's graded plan on two boxes (config and tensor index, no weights)",
        (
            F("lo", "lo", "format"),
            F("promoted", "promoted_fraction", **PCT),
            F("expert bpw", "expert_bpw", fmt="{:.4f}"),
            F("bytes a rank", "bytes_per_rank", "total", **GB),
        ),
        projection=True,
    ),
    Benchmark(
        "plan-k3-measured",
        "pipeline",
        "quality/nonexpert.py --plan-k3",
        "the real K3's plans with the non-expert formats nonexpert.py measured, attention "
        "replicated and split",
        (
            F("lo", "plans", "split", "lo", "format"),
            F("promoted, split", "plans", "split", "promoted_fraction", **PCT),
            F("promoted, replicated", "plans", "replicated", "promoted_fraction", **PCT),
        ),
        projection=True,
    ),
    Benchmark(
        "disk-plan-k3",
        "pipeline",
        "pipeline/disk_plan.py",
        "the real K3's plan and disk plan as the guide's pipeline command makes them "
        "(tests/test_docs.py plans again and fails when this drifts)",
        (
            F("lo", "plan", "lo", "format"),
            F("peak in OUT", "disk_plan", "peak_out", **GB),
            F("with the source", "disk_plan", "peak_with_source", **TB),
            F("with --dwq", "disk_plan_dwq", "peak_with_source", **TB),
        ),
        projection=True,
    ),
    Benchmark(
        "pipeline-mini",
        "pipeline",
        "k3dist.pipeline.runner",
        "the one pipeline command on the mini-K3: stage times, peak disk against the plan",
        (
            F("peak disk measured", "peak_disk_in_out_measured", **MB),
            F("planned", "disk_plan", "peak_out", **MB),
        ),
    ),
    Benchmark(
        "rehearsal",
        "pipeline",
        "pipeline/rehearsal.py",
        "every build stage at K3's real counts (k3counts preset), measured and projected",
        (F("stages", "stages", ALL, "stage", agg="count"),),
        projection=True,
    ),
    Benchmark(
        "rehearsal-pipeline",
        "pipeline",
        "pipeline/rehearsal.py --from-pipeline",
        "the one pipeline command on the k3counts preset, each stage projected to the real K3 "
        "on an M3 Ultra (constants and sources in the JSON)",
        (
            F("tensors", "real_k3", "tensors", fmt="{:,}"),
            F(
                "real K3 total h",
                "stages",
                ALL,
                "real_k3",
                "total_s",
                agg="sum",
                fmt="{:.1f}",
                scale=3600,
            ),
        ),
        projection=True,
    ),
    Benchmark(
        "rehearsal-serve",
        "pipeline",
        "pipeline/rehearsal_serve.py",
        "a 2-rank server on rank folders at K3's counts: ready time, parity, requests, logs",
        (
            F("ready s", "ready_s"),
            F("answered", "requests", "answered_200"),
            F("sent", "requests", "sent"),
        ),
    ),
    Benchmark(
        "rehearsal-parity",
        "pipeline",
        "pipeline/rehearsal_parity.py",
        "greedy parity of an N-rank run against one process, through the logits, and how far "
        "a 1e-7 change moves the single process alone",
        (
            F("rows", "rows", ALL, "greedy_equal", agg="count"),
            F("max |d log p| vs one process", "max_abs_logprob_diff", fmt="{:.3g}"),
            F("1e-7 change alone", "sensitivity", 0, "max_abs_logprob_change", fmt="{:.3g}"),
        ),
        command=(("command",), ("commands",)),
    ),
    Benchmark(
        "count-overhead",
        "pipeline",
        "pipeline/count_overhead.py",
        "what teacher, calibration and the graded stage cost at K3's counts apart from bytes",
        (
            F("calibrate CPU s", "cpu_s", "calibrate"),
            F("graded CPU s", "cpu_s", "graded"),
        ),
    ),
    Benchmark(
        "digest-threads",
        "pipeline",
        "pipeline/digest_threads.py",
        "StreamWriter's two SHA-256 digests on one thread vs two, same bytes",
        (F("speed-up", "speedup_best_wall"),),
    ),
    Benchmark(
        "verify-rate",
        "pipeline",
        "pipeline/verify_rate.py",
        "what checking rank-folder content costs: hash rates, a full check, a stamp restart; "
        "projected for 450 GB a box",
        (
            F("sha256 GB/s, 1 thread", "hash_gbps_memory", "sha256, 1 thread"),
            F("stamp at real size s", "real_scale_stamp", "seconds_incl_manifest_parse"),
            F("full 450 GB projected s", "projection_450gb", "full_ssd_bound_s"),
        ),
    ),
    # serving
    Benchmark(
        "prefix-cache",
        "serving",
        "serving/prefix_cache.py",
        "an agent's ~4K-token prefix across a restart: time to first token cold, warm in "
        "memory, from disk, preloaded; gaps of a running request beside a cold prefill",
        (
            F("cold s", "turn_cold", "ttft_s", **S),
            F("warm s", "turn_warm_memory", "ttft_s", **S),
            F("after restart s", "turn_warm_after_restart", "ttft_s", **S),
            F("preloaded s", "turn_warm_after_restart_preloaded", "ttft_s", **S),
        ),
    ),
    Benchmark(
        "prefix-write",
        "serving",
        "serving/prefix_write_pause.py",
        "the serving loop's pause per stored prefix entry: written in the loop vs the writer "
        "thread",
        (
            F("256 MB in loop s", "entries", "256MB", "in_loop", "median_s"),
            F("256 MB writer thread s", "entries", "256MB", "writer_thread", "median_s"),
        ),
    ),
    Benchmark(
        "prefix-write-gaps",
        "serving",
        "serving/prefix_write_gaps.py",
        "a running request's gaps between tokens while prefix entries are written, vs no write",
        (
            F("across a write p99 s", "write", "gaps", "write", "p99_s"),
            F("decoding alone p99 s", "write", "gaps", "decode", "p99_s"),
        ),
    ),
    Benchmark(
        "idle-cpu",
        "serving",
        "serving/idle_cpu.py",
        "CPU seconds per idle minute of the supervisor, mlx.launch and each rank",
        (
            F("total CPU s / idle min", "after", "cpu_s_per_idle_minute_total"),
            F("before / after", "ratio_total_before_over_after"),
        ),
    ),
    Benchmark(
        "metrics-overhead",
        "serving",
        "serving/metrics_overhead.py",
        "decode tok/s with metrics on and --no-metrics, side by side, rounds alternating",
        (
            F("on tok/s", "decode_tok_s_stats", "metrics_on", "median"),
            F("off tok/s", "decode_tok_s_stats", "metrics_off", "median"),
        ),
    ),
    Benchmark(
        "installed-default",
        "serving",
        "serving/installed_default.py",
        "README's serve command from a non-editable install (pip install . into a fresh "
        "venv): the embedded default from the installed package, /health, one chat",
        (
            F("served", "served"),
            F("pip install s", "install", "pip_install_s"),
            F("to /health s", "serve", "health_s"),
            F("chat status", "serve", "chat", "status"),
        ),
    ),
    # agents
    Benchmark(
        "agent-clients",
        "agents",
        "agents/agent_clients.py",
        "time to first token for Claude Code's, Codex's and aider's full default requests on "
        "the mini, cold and warm",
        (
            F("Claude Code tokens", "clients", "claude", "count_tokens"),
            F("cold s", "clients", "claude", "cold", "ttft_s", fmt="{:.1f}"),
            F("warm s", "clients", "claude", "warm", "ttft_s", fmt="{:.1f}"),
        ),
    ),
    Benchmark(
        "agent-resume",
        "agents",
        "agents/agent_resume.py",
        "Claude Code's default mode against the mini until a turn completes; retries resume "
        "the prefill from the prompt cache",
        (
            F("requests", "requests", ALL, "request", agg="count"),
            F("completed", "run", "completed"),
            F("seconds", "run", "seconds"),
        ),
    ),
    Benchmark(
        "agent-turns",
        "agents",
        "agents/agent_turns.py",
        "prompt reuse across turns: time to first token of turn 2 vs turn 1",
        (
            F("turn 1 s", "turn_1", "ttft_s"),
            F("turn 2 s", "turn_2", "ttft_s"),
            F("ratio", "ttft_turn2_over_turn1"),
        ),
    ),
    # faults
    Benchmark(
        "faults",
        "faults",
        "faults/rank_faults.py",
        "SIGKILL/SIGSTOP of a rank while 8 requests decode or during a prefill: time to "
        "error, exit code, time to serve again",
        (
            F("scenarios", "scenarios", ALL, "time_to_error_max_s", agg="count"),
            F("slowest error s", "scenarios", ALL, "time_to_error_max_s", agg="max", fmt="{:.1f}"),
            F("bound s", "watchdog_bound_s"),
        ),
    ),
    Benchmark(
        "cable-faults",
        "faults",
        "faults/cable_faults.py",
        "cable faults on the two-host rig: when the supervisor exits, with what, and a restart",
        (
            F("faults", "faults", ALL, "exit_s", agg="count"),
            F("slowest exit s", "faults", ALL, "exit_s", agg="max"),
            F("bound s", "exit_bound_s"),
        ),
    ),
    Benchmark(
        "fuzz",
        "faults",
        "faults/fuzz_requests.py",
        "generated hostile requests to the five endpoints of the 2-rank mini server: every "
        "answer a 2xx or a 4xx in shape, ranks alive and in lockstep after",
        (
            F("requests", "requests"),
            F("5xx", "5xx"),
            F("failures", "failures"),
            F("in lockstep", "ranks_in_lockstep"),
        ),
    ),
    Benchmark(
        "soak",
        "faults",
        "faults/soak.py",
        "mixed traffic for a long time: answers vs the same request alone, lost requests, RSS",
        (
            F("minutes", "minutes"),
            F("requests", "requests"),
            F("lost", "lost"),
            F("mismatches", "mismatches"),
        ),
    ),
    # training
    Benchmark(
        "train-log",
        "train",
        "train/train.py",
        "the minis' training logs (JSON lines) and loss curves; train/README.md",
    ),
    Benchmark("train-curve", "train", "train/train.py", "the minis' loss curves"),
)
