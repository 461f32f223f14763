"""Projected decode speed of the real K3 on N boxes, per mode, from a cost model.

    python benchmarks/speed/project.py [--boxes 2] [--profile mxfp4 graded] [--backend ring jaccl]
        [--bw-fraction 0.7] [--jaccl-latency-us 50] [--ring-latency-us 600] [--sync-ms 1]
        [--counts routing.npz] [--batch 1 8] [--calibrate]
        [--prefill] [--out benchmarks/results/DATE/project.json]

Prints JSON: per build profile and backend, each mode's bytes / FLOPs / collectives per
step and rank, time split, tok/s and per-box footprint; the published two-box anchors
next to the model with what each implies; the constants with where each comes from.
``--calibrate`` also measures this machine (memory bandwidth, MLX matvecs, loopback
all_sum under ``mlx.launch -n 2``). Model and equations: ``k3dist.bench.costmodel``.
``--prefill`` adds time to first token (cold 2K / 20K / 100K prompts, EP-split and TP,
at two prefill efficiencies), the inter-token latency of running requests per prefill
chunk size, and a cached prefix restored from disk against recomputing it
(``prefill`` in the JSON; equations in ``costmodel.prefill_chunk``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from importlib import metadata
from pathlib import Path

import k3dist
from k3dist.bench import bandwidth, collectives, record
from k3dist.bench import costmodel as cm
from k3dist.config.box import Box
from k3dist.factory import synth
from k3dist.format import layout, placement
from k3dist.format.folder import load_config
from k3dist.format.kvmemory import GiB

PUBLISHED_TB = 1.561  # the mxfp4 build's published size


def parse_args() -> argparse.Namespace:
    d = cm.Hardware()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="config.json (default: the real K3's, shipped)")
    ap.add_argument("--boxes", type=int, default=2)
    ap.add_argument("--profile", nargs="+", default=list(cm.PROFILES), choices=cm.PROFILES)
    ap.add_argument(
        "--plan",
        help="a graded build plan (python -m k3dist.pipeline.plan --json; "
        "one plan or {'plans': {attention: plan}}): adds profile plan-<attention> "
        "per plan (its promoted fraction, lo format, non-expert classes)",
    )
    ap.add_argument("--hi-fraction", type=float, help="override: experts kept at mxfp4")
    ap.add_argument("--hi-pair-fraction", type=float, help="override: pairs on the hi bank")
    ap.add_argument("--lo-bits", type=float, help="override: lo bank bits/weight")
    ap.add_argument("--nonexpert-bits", type=int, choices=(16, 8, 4), help="override")
    ap.add_argument("--backend", nargs="+", default=["ring", "jaccl"], choices=cm.BACKENDS)
    ap.add_argument("--jaccl-latency-us", type=float, default=cm.BACKENDS["jaccl"].latency_s * 1e6)
    ap.add_argument("--ring-latency-us", type=float, default=cm.BACKENDS["ring"].latency_s * 1e6)
    ap.add_argument("--jaccl-gbs", type=float, default=cm.BACKENDS["jaccl"].bandwidth / 1e9)
    ap.add_argument("--ring-gbs", type=float, default=cm.BACKENDS["ring"].bandwidth / 1e9)
    ap.add_argument("--mem-bw-gbs", type=float, default=d.mem_bw / 1e9)
    ap.add_argument("--bw-fraction", type=float, default=d.bw_fraction)
    ap.add_argument("--tflops", type=float, default=d.flops / 1e12)
    ap.add_argument("--flops-fraction", type=float, default=d.flops_fraction)
    ap.add_argument("--memory-gib", type=float, default=d.box.memory_bytes / GiB)
    ap.add_argument("--wired-limit-mb", type=int, default=d.box.wired_limit_mb)
    ap.add_argument("--runtime-reserve-gib", type=float, default=d.box.runtime_reserve_bytes / GiB)
    ap.add_argument(
        "--sync-ms",
        type=float,
        default=d.sync_s * 1e3,
        help="host sync per MoE layer (EP local form)",
    )
    ap.add_argument(
        "--placeholder-reads",
        type=float,
        default=d.placeholder_reads,
        help="memory reads of the redirect expert per MoE layer (placeholder)",
    )
    ap.add_argument(
        "--form",
        default="placeholder",
        choices=cm.FORMS,
        help="EP form in the headline numbers (both are reported)",
    )
    ap.add_argument("--context", type=int, default=4096, help="tokens in the MLA cache")
    ap.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1, 8],
        help="requests decoded together in lockstep (batch 1 is the headline; "
        "others go to 'batched', with aggregate and per-request tok/s)",
    )
    ap.add_argument(
        "--counts",
        help="routing counts (.npz layer_<L> / JSON): load-aware placement and sampled routing",
    )
    ap.add_argument(
        "--placement",
        choices=("contiguous", "load-aware"),
        help="default: load-aware with --counts, else contiguous",
    )
    ap.add_argument(
        "--routing-skew",
        help="benchmarks/speed/routing_skew.py JSON: the busiest rank's "
        "load measured on the trained mini-K3's real routing over uniform, per "
        "ranks/placement/batch, applied to the real K3's uniform expectation",
    )
    ap.add_argument(
        "--collectives-from",
        help="an ep_vs_tp_pp.py JSON: the all_sums per decode "
        "token counted from its running models, checked against this model's "
        "count for the same build's config (a mismatch stops the projection)",
    )
    ap.add_argument("--calibrate", action="store_true", help="measure this machine too")
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="time to first token, chunk trade-off, cached prefix restore",
    )
    ap.add_argument(
        "--disk-gbs",
        type=float,
        default=5.0,
        help="prefix-cache read speed (GB/s; assumed: Mac Studio internal SSD)",
    )
    ap.add_argument(
        "--sha-gbs",
        type=float,
        default=2.0,
        help="SHA-256 of one core (GB/s; assumed, ARMv8 SHA-2 instructions)",
    )
    ap.add_argument(
        "--sha-threads",
        type=int,
        default=8,
        help="threads hashing a restored entry's 64 MiB pieces "
        "(k3dist.serve.prefix_store.HASH_THREADS; an M3 Ultra has 24 "
        "performance cores)",
    )
    ap.add_argument("--allsum-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    return ap.parse_args()


def hardware(args) -> dict[str, cm.Hardware]:
    box = Box(
        mem_bw=args.mem_bw_gbs * 1e9,
        flops=args.tflops * 1e12,
        memory_bytes=int(args.memory_gib * GiB),
        wired_limit_mb=args.wired_limit_mb,
        runtime_reserve_bytes=int(args.runtime_reserve_gib * GiB),
    )
    base = cm.Hardware(
        box=box,
        bw_fraction=args.bw_fraction,
        flops_fraction=args.flops_fraction,
        sync_s=args.sync_ms * 1e-3,
        placeholder_reads=args.placeholder_reads,
    )
    lat = {"jaccl": args.jaccl_latency_us, "ring": args.ring_latency_us}
    bw = {"jaccl": args.jaccl_gbs, "ring": args.ring_gbs}
    return {b: cm.with_backend(base, b, lat[b] * 1e-6, bw[b] * 1e9) for b in args.backend}


def profiles(args) -> dict[str, cm.Profile]:
    over = {
        k: v
        for k, v in (
            ("hi_fraction", args.hi_fraction),
            ("lo_bits", args.lo_bits),
            ("hi_pair_fraction", args.hi_pair_fraction),
            ("nonexpert_bits", args.nonexpert_bits),
        )
        if v is not None
    }
    out = {n: replace(cm.PROFILES[n], **over) for n in args.profile}
    if args.plan:
        data = json.loads(Path(args.plan).read_text())
        for plan in data["plans"].values() if "plans" in data else [data]:
            prof = cm.plan_profile(plan, source=args.plan)
            out[prof.name] = replace(prof, **over)
            PLAN_BUDGET[prof.name] = plan["budget_per_rank"]
    return out


# profile -> the plan's wired budget per rank (its own box model: sysctl-raised wired limit)
PLAN_BUDGET: dict[str, int] = {}


def mark_plan_fit(name: str, proj: dict) -> dict:
    if name in PLAN_BUDGET:
        for v in proj["modes"].values():
            fp = v["footprint_per_box"]
            fp["plan_budget_per_rank"] = PLAN_BUDGET[name]
            fp["fits_plan_budget"] = fp["total"] <= PLAN_BUDGET[name]
    return proj


def calibrate(runs: int = 3) -> dict:
    """Loopback all_sum timings (a few launches: on a shared, loaded box single runs
    flip between ~0.1 ms and ~10-16 ms medians), then memory bandwidth."""
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    cmd = [launcher, "-n", "2", "--python", sys.executable, __file__, "--allsum-worker"]
    allsum: dict = {"runs": [], "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    for _ in range(runs):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        if r.returncode or not lines:
            allsum["error"] = (r.stderr or r.stdout)[-2000:]
            break
        allsum["runs"].append(json.loads(lines[-1]))
    for key in ("single_median_us", "chained_median_us"):
        allsum[f"best_{key}"] = {
            size: min(run[size][key] for run in allsum["runs"])
            for size in (allsum["runs"][0] if allsum["runs"] else {})
            if size != "size"
        }
    out = {
        "machine": platform.platform(),
        "blas": k3dist.blas_status(),
        "allsum_loopback_ring": allsum,
        "bandwidth": bandwidth.measure_bandwidth(),
    }
    moe = sorted(glob.glob(str(Path(__file__).parents[1] / "results" / "*" / "moe-step.json")))
    if moe:
        m = json.loads(Path(moe[-1]).read_text())
        out["moe_step"] = {
            "file": record.repo_path(moe[-1]),
            "median_ms": m["median_ms"],
            "non_owned_cost_ms": m["non_owned_cost_ms"],
        }
    return out


COUNTED = {"ep_contiguous": "ep-replicated", "ep_split": "ep-split", "tp": "tp"}


def check_collectives(path: str) -> dict:
    """The all_sums per decode token ep_vs_tp_pp.py counted on its running models (rank 0)
    against this model's count for that build's config and rank count."""
    rep = json.loads(Path(path).read_text())
    build = k3dist.REPO / rep["build"]
    config = load_config(build)
    f = cm.facts(config, cm.PROFILES["mxfp4"])
    counted = rep["ranks"][0]["counted"]
    out = {"from": path, "build": rep["build"], "size": rep["size"], "modes": {}}
    for name, mode in COUNTED.items():
        if name not in counted:
            continue
        model = sum(c["count"] for c in cm.collectives(f, mode, rep["size"], cm.Hardware()))
        got = counted[name]["collectives_per_token"]
        out["modes"][mode] = {"counted": got, "model": model}
        if got != model:
            sys.exit(
                f"{path}: {name} ran {got} all_sums per decode token, the cost model "
                f"counts {model} for {rep['build']}: fix the model before projecting"
            )
    return out


PREFILL_PROMPTS = (2048, 20480, 102400)
PREFILL_CHUNKS = (128, 256, 512, 2048)


def prefill_section(config: dict, prof: cm.Profile, hw: cm.Hardware, boxes: int, args) -> dict:
    """Cold time to first token per mode, the chunk trade-off, and a cached prefix."""
    f = cm.facts(config, prof)
    tc = f.tc
    effs = {"headline": cm.PREFILL_FLOPS_FRACTION, "optimistic": 0.5}
    runs = (("ep-split", "local"), ("ep-split", "placeholder"), ("tp", "local"))
    cold = {}
    for name, eff in effs.items():
        for mode, form in runs:
            key = f"{mode}/{form}" if mode in cm.EP_MODES else mode
            for P in PREFILL_PROMPTS:
                r = cm.prefill(f, mode, boxes, hw, P, 512, 0, form, eff)
                cold.setdefault(name, {}).setdefault(key, {})[str(P)] = {
                    "ttft_s": round(r["ttft_s"], 1),
                    "prefill_tok_s": round(r["prefill_tok_s"], 1),
                    "comm_s": round(r["comm_s"], 2),
                    "attention_share_of_flops": round(r["attention_flops"] / r["flops"], 3),
                }
    trade = {
        name: {
            f"{P}-token prompt": cm.chunk_tradeoff(
                f, "ep-split", boxes, hw, PREFILL_CHUNKS, P, 4, 4096, "local", eff
            )
            for P in (4096, 20480)
        }
        for name, eff in effs.items()
    }
    # a cached 20K-token prefix (an agent's system prompt + tools) and a new turn
    from k3dist.format import kvmemory

    cached = {}
    threads = args.sha_threads
    for n in (20480,):
        req = kvmemory.request_bytes(tc, n, 2, size=boxes, step=256)
        nbytes = req["per_request"]
        read_s, sha_s = nbytes / (args.disk_gbs * 1e9), nbytes / (args.sha_gbs * 1e9 * threads)
        # after a restart: restored from disk at the first matching turn (preload off), or
        # loaded into memory at server start (prefix_cache_preload_gb, the default): then
        # the first turn is a memory hit and the restore is paid in the start, before any
        # request (start_restore_s below), not in the turn
        restores = {
            "warm_in_memory": 0.0,
            "restored_after_restart": read_s + sha_s,
            "preloaded_at_restart": 0.0,
        }
        rows, parts = {}, {}
        for name, eff in effs.items():
            for suffix in (64, 256, 1024):
                warm = cm.prefill(f, "ep-split", boxes, hw, n + suffix, 512, n, "local", eff)
                coldr = cm.prefill(f, "ep-split", boxes, hw, n + suffix, 512, 0, "local", eff)
                for where, restore in restores.items():
                    rows.setdefault(name, {}).setdefault(where, {})[f"new_turn_{suffix}"] = {
                        "ttft_cached_s": round(restore + warm["ttft_s"], 2),
                        "ttft_cold_s": round(coldr["ttft_s"], 1),
                        "ratio": round((restore + warm["ttft_s"]) / coldr["ttft_s"], 4),
                    }
            # what the 64-token turn's one chunk spends its time on, and MLA absorbed
            step = cm.prefill_chunk(f, "ep-split", boxes, hw, 64, n, "local", eff)
            absorbed = cm.prefill_chunk(
                f, "ep-split", boxes, hw, 64, n, "local", eff, mla="absorbed"
            )
            first = cm.prefill(f, "ep-split", boxes, hw, n + 64, 512, n, "local", eff)[
                "first_token_s"
            ]
            t = step["time_s"]
            parts[name] = {
                "chunk_s": {k: round(v, 3) for k, v in t.items()},
                "bound": "FLOPs" if t["flops"] >= t["memory"] else "memory",
                "first_token_s": round(first, 3),
                "mla_expand_share_of_flops": round(step["mla_expand_flops"] / step["flops"], 3),
                "chunk_s_mla_absorbed": round(absorbed["time_s"]["total"], 3),
                "ttft_mla_absorbed_s": {
                    where: round(r + absorbed["time_s"]["total"] + first, 2)
                    for where, r in restores.items()
                },
            }
        cached[str(n)] = {
            "bytes_per_rank": nbytes,
            "mla_latent_bytes": req["mla_latent_cache"],
            "kda_state_bytes": req["kda_state"],
            "restore_s": {
                "read": round(read_s, 3),
                "sha256": round(sha_s, 3),
                "total": round(read_s + sha_s, 3),
            },
            "preloaded_at_restart": {
                "start_restore_s": round(read_s + sha_s, 3),
                "note": "the same read + hash, paid once at server start (before the "
                "first request, every rank) instead of in the first matching turn; "
                "the turn is then a memory hit",
            },
            "ttft": rows,
            "new_turn_64_parts": parts,
        }
    return {
        "mode_for_tradeoff": "ep-split, local form, batch of 4 decoding at 4K context",
        "efficiencies": effs,
        "sources": cm.PREFILL_SOURCES,
        "disk": {
            "read_GBps": args.disk_gbs,
            "sha256_GBps_per_core": args.sha_gbs,
            "sha256_threads": args.sha_threads,
            "source": "assumed: Apple publishes no SSD speed; Mac Studio internal "
            "SSDs read ~5-7 GB/s in public tests; SHA-256 ~2 GB/s on one "
            "core with ARMv8 SHA-2 instructions (not measured here: this "
            "box is x86); M3 Ultra: 32-core CPU, 24 performance + 8 "
            "efficiency cores (Apple, Mac Studio 2025 tech specs); read and "
            "hash counted one after the other (no overlap assumed)",
        },
        "cold_chunk_512": cold,
        "chunk_tradeoff": trade,
        "cached_prefix": cached,
    }


def summary(res: dict) -> list[str]:
    rows = [
        f"{'profile':10} {'backend':7} {'mode':14} {'tok/s':>6} {'GB/rank':>8} "
        f"{'coll':>5} {'comp ms':>8} {'comm ms':>8} {'box GB':>7} fits"
    ]
    for pn, per in res["projections"].items():
        for b, pr in per.items():
            for m, v in pr["modes"].items():
                fp = v["footprint_per_box"]
                rows.append(
                    f"{pn:10} {b:7} {m:14} {v['tok_s']:6.2f} "
                    f"{v['bytes_critical_path'] / 1e9:8.1f} {v['n_collectives']:5d} "
                    f"{v['time_s']['compute'] * 1e3:8.1f} "
                    f"{v['time_s']['comm'] * 1e3:8.1f} {fp['total_GB']:7.1f} "
                    f"{'yes' if fp['fits'] else 'NO'}"
                )
    return rows


def main() -> None:
    args = parse_args()
    if args.allsum_worker:
        k3dist.set_blas_threads(1)  # two ranks share this box's cores
        from k3dist.model.group import join

        group = join()
        r = collectives.allsum_timings(group)
        if group.rank() == 0:
            print(json.dumps(r), flush=True)
        return
    config = json.loads(Path(args.config).read_text()) if args.config else synth.real_config()
    tc = layout.text_config(config)
    counts = placement.read_counts(args.counts) if args.counts else None
    kind = args.placement or ("load-aware" if counts is not None else "contiguous")
    if kind == "load-aware" and counts is None:
        sys.exit("--placement load-aware needs --counts (routing counts per MoE layer)")
    pl = (
        placement.for_config(tc, args.boxes, args.counts if kind == "load-aware" else None)
        if args.boxes > 1
        else None
    )
    hws = hardware(args)
    profs = profiles(args)
    skews = {}
    if args.routing_skew:
        table = json.loads(Path(args.routing_skew).read_text())["results"]
        for B in args.batch:
            key = f"{args.boxes}/{kind}/{B}"
            if key not in table:
                sys.exit(
                    f"{args.routing_skew}: no {key} (ranks/placement/batch); rerun "
                    f"benchmarks/speed/routing_skew.py --ranks {args.boxes} --batch {B}"
                )
            skews[B] = {k: table[key][k] for k in ("skew", "skew_pairs", "skew_union")}

    res: dict = {
        "command": record.command_line(),
        "versions": {
            "k3dist": k3dist.__version__,
            "python": platform.python_version(),
            **{p: metadata.version(p) for p in ("mlx", "mlx-lm", "numpy")},
        },
        "config": args.config
        or "k3dist.factory.synth.real_config() (moonshotai/Kimi-K3 config.json)",
        "constants": {
            "hardware": cm.hardware_json(next(iter(hws.values()))),
            "backends": {b: asdict(h.backend) for b, h in hws.items()},
            "sources": cm.SOURCES,
        },
        "footprint": {},
        "projections": {},
        "anchors": {},
    }

    def projected(pn: str, prof, batch: int) -> dict:
        """Each backend's projection of profile ``pn`` at ``batch`` requests in lockstep,
        with whether the planner fits it."""
        return {
            b: mark_plan_fit(
                pn,
                cm.project(
                    config,
                    prof,
                    h,
                    args.boxes,
                    form=args.form,
                    context=args.context,
                    placement=pl,
                    counts=counts,
                    batch=batch,
                    skew=skews.get(batch),
                ),
            )
            for b, h in hws.items()
        }

    for pn, prof in profs.items():
        fp = cm.footprint(config, prof)
        if pn == "mxfp4":
            fp["published_TB"] = PUBLISHED_TB
            fp["error_vs_published"] = round(fp["build_bytes"] / 1e12 / PUBLISHED_TB - 1, 5)
        res["footprint"][pn] = fp
        if args.boxes > 1:
            res.setdefault("attention_bytes_per_rank", {})[pn] = cm.attention_bytes(
                config, prof, args.boxes
            )
        res["projections"][pn] = projected(pn, prof, 1)
        if args.boxes == 2:
            res["anchors"][pn] = cm.compare_anchors(config, prof, hws, args.context, args.form)
    for B in (b for b in args.batch if b != 1):
        res.setdefault("batched", {})[str(B)] = {
            pn: projected(pn, prof, B) for pn, prof in profs.items()
        }
    res["summary_tok_s_batched"] = {
        B: {
            pn: {
                b: {
                    m: {
                        "aggregate": round(v["tok_s"], 2),
                        "per_request": round(v["tok_s_per_request"], 2),
                    }
                    for m, v in pr["modes"].items()
                }
                for b, pr in per.items()
            }
            for pn, per in by.items()
        }
        for B, by in res.get("batched", {}).items()
    }
    if args.collectives_from:
        res["collectives_check"] = check_collectives(args.collectives_from)
    res["summary_tok_s"] = {
        pn: {b: {m: round(v["tok_s"], 2) for m, v in pr["modes"].items()} for b, pr in per.items()}
        for pn, per in res["projections"].items()
    }
    if args.prefill:
        pn = next(iter(profs))
        res["prefill"] = {
            pn: {b: prefill_section(config, profs[pn], h, args.boxes, args) for b, h in hws.items()}
        }
    if args.calibrate:
        res["measured_here"] = calibrate()
    text = json.dumps(res, indent=1, default=float)
    print(text)
    print("\n".join(summary(res)), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
