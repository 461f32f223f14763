"""One rank's start-up, the sequence ``launch/serve.py`` runs: key check, group join,
watchdog, preflight, load, warm-up, prefix store, then the server (rank 0 answers).

    mlx.launch --hostfile hostfiles/tb5.json launch/serve.py [--config deploy.yaml]
    mlx.launch --hostfile hostfiles/local.json --python .venv/bin/python launch/serve.py

With no model configured it serves the embedded default (made and sliced on first
use). Every step takes what it needs of the typed deployment; nothing is re-stated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import k3dist
from k3dist.config import deployment
from k3dist.config.deployment import Deployment
from k3dist.format import manifest as manifests
from k3dist.format.placement import Placement
from k3dist.format.verify import Report
from k3dist.model.group import join
from k3dist.serve import (
    auth,
    handler,
    keepawake,
    loader,
    metrics,
    peer_link,
    preflight,
    server,
    supervise,
    warmup,
    watchdog,
)

# what serving takes of the deployment (the build's own keys are slicing/rank_split.py's)
KEYS = deployment.keys("rank", "serving", "images", "access", "prefix cache")


def parse_args(argv: list[str] | None = None) -> Deployment:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    deployment.add_arguments(ap, KEYS)
    return deployment.from_args(ap, ap.parse_args(argv), KEYS)


def log(rank: int, msg: str) -> None:
    # one write with its newline: mlx.launch relays ranks' output in the pieces it reads
    sys.stderr.write(f"[k3dist rank {rank}] {msg}\n")
    sys.stderr.flush()


def rank_folder(dep: Deployment, rank: int, size: int) -> Path:
    """This rank's folder. The embedded default is made and sliced on first use, and
    again when its cache is stale (the shipped mini-K3 or k3dist's formats changed): only
    then is the build pipeline imported (serving itself needs the format layer only)."""
    folder = dep.rank_path(rank)
    if dep.build != Deployment().build or dep.rank_dir != Deployment().rank_dir:
        return folder
    if manifests.slices_current_build(folder, k3dist.MINI_K3):
        return folder
    from k3dist.pipeline import default

    log(rank, f"embedded default: preparing {folder} (cached after the first run)")
    return default.ensure_default_rank(rank, size, folder)


def close_stdin() -> None:
    """A rank reads nothing from stdin: close the pipe mlx.launch gave it (/dev/null in
    its place), so mlx.launch's forwarding thread can drop it instead of spinning on it
    (k3dist.serve.supervise writes the line that makes it notice)."""
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
    except OSError:
        pass


def launch_rank() -> int:
    """This process's rank as mlx.launch numbers it (``MLX_RANK``), known before the
    group is joined; 0 when started without a launcher."""
    try:
        return int(os.environ.get("MLX_RANK", "0"))
    except ValueError:
        return 0


def api_key_of(dep: Deployment) -> str | None:
    """The API key, on the rank that answers HTTP (only rank 0's Mac needs the key file),
    checked before the group is joined: a bad key file, or another machine's reach
    without a key, stops us here (mlx.launch then ends the other ranks)."""
    if launch_rank() != 0:
        return None
    try:
        api_key = auth.load_key(dep.api_key, dep.api_key_file)
        auth.check_exposure(dep.host, api_key, dep.allow_no_api_key)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"launch/serve.py: refusing to start: {e}") from None
    return api_key


@dataclass
class Rank:
    """What start-up has made so far on this rank (each step adds its part)."""

    dep: Deployment
    group: Any
    wd: watchdog.Watchdog | None = None
    stores: list = field(default_factory=list)  # the prefix store, once made

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def on_stop(self, why: str, origin: int) -> None:
        handler.abort_streams(f"server stopping: {why} (from rank {origin})")
        for store in self.stores:  # every rank, the same bound (prefix_cache_drain_s)
            store.drain()


def start_watchdog(r: Rank) -> None:
    """The side-channel watchdog (more than one rank): a lost peer or a stop ends every
    open stream with an error, and a failing rank tells the others why."""
    dep = r.dep
    host, port = peer_link.coordinator_address(r.group, port=dep.watchdog_port)
    r.wd = watchdog.Watchdog(
        r.rank,
        r.size,
        host,
        port,
        timeout_s=dep.watchdog_timeout_s,
        parent_pid=os.getppid() if dep.stop_with_launcher else None,
        on_lost=lambda lost, why: handler.abort_streams(f"rank {lost} was lost ({why})"),
        on_stop=r.on_stop,
        stop_work_s=dep.prefix_cache_drain_s if dep.prefix_cache_dir else 0.0,
    )
    r.wd.start()
    watchdog.install_signal_handlers(r.wd)
    watchdog.install_failure_hook(r.wd)
    log(r.rank, f"watchdog: coordinator {host}:{port}, timeout {dep.watchdog_timeout_s}s")


def load(r: Rank, folder: Path) -> tuple[Any, dict, dict, Any]:
    """The rank's model (checked, lazily loaded, sharded), its config, manifest and
    tokenizer."""
    dep = r.dep
    t0 = time.perf_counter()
    model, config, manifest = loader.load_deployed(
        dep, r.group, folder, peer_failure=r.wd.peer_failures.get if r.wd else None
    )
    log(r.rank, f"{folder}: {Report(**manifest['verify']).summary()}")
    tokenizer = loader.load_tokenizer(folder)
    log(
        r.rank,
        f"loaded {folder} (build {manifest['build_hash']}, placement "
        f"{manifest['placement_hash']}, moe form {loader.resolve_form(dep.moe_form)}) "
        f"in {time.perf_counter() - t0:.1f}s",
    )
    return model, config, manifest, tokenizer


def warm(r: Rank, model, vocab_size: int) -> dict | None:
    """Every prefill chunk and decode batch shape compiled before the first request
    (a JIT compile inside a collective kills a real two-box run)."""
    dep = r.dep
    model.chunk_sizes = warmup.chunk_sizes(dep.prefill_chunk)
    if not dep.warmup:
        return None
    defaults = {"temp": dep.temperature, "top_p": dep.top_p}  # the deployment's own
    out = warmup.warm_up(
        model, dep.prefill_chunk, vocab_size, (*warmup.SAMPLERS, defaults), dep.max_batch
    )
    log(r.rank, f"warm-up: {json.dumps(out)}")
    return out


def count(r: Rank, model, manifest: dict, pre: dict, warmed) -> metrics.ServeMetrics | None:
    """What every rank counts for ``/metrics`` (the deployment's ``metrics``); rank 1's
    figures reach rank 0 with its heartbeat, rank 0 counts routes for all (every rank
    routes alike)."""
    if not r.dep.metrics:
        return None
    counted = metrics.ServeMetrics(
        r.rank,
        r.size,
        preflight=pre,
        warm=warmed is not None,
        peers=(lambda: dict(r.wd.peer_stats)) if r.wd else None,
        peer_timeout_s=r.dep.watchdog_timeout_s,
    )
    if r.wd is not None:
        r.wd.stats = counted.rank_stats
    if r.rank == 0:
        counted.attach_routes(model, Placement.from_json(manifest["placement"]).owners)
    return counted


def describe(r: Rank, model, config: dict, manifest: dict, warmed, pre: dict) -> dict:
    """What ``/v1/k3dist`` reports of this deployment."""
    dep = r.dep
    return {
        "ranks": r.size,
        "build_hash": manifest["build_hash"],
        "placement": manifest["placement"]["kind"],
        "placement_hash": manifest["placement_hash"],
        "moe_form": loader.resolve_form(dep.moe_form),
        "dtype": dep.dtype,
        "attention": manifest.get("attention"),
        "max_context": dep.max_context,
        "prefill_chunks": model.chunk_sizes,
        "max_batch": dep.max_batch,
        "vocab_size": config["text_config"]["vocab_size"],
        "warmup": warmed,
        "warmup_kernels": warmup.jit_kernels_loaded(),
        "blas": k3dist.blas_status(),
        "preflight": pre,
        "verify": manifest["verify"]["mode"],
    }


def attach_vision(r: Rank, provider, model, folder: Path, config: dict, tokenizer):
    """The vision tower (mlx-vlm is imported only here) and the image limits."""
    from k3dist.serve import vision

    dep = r.dep
    provider.processor = vision.attach(
        model, folder, config, tokenizer, r.group, loader.DTYPES[dep.dtype]
    )
    log(
        r.rank,
        f"vision: on (tower on rank {vision.TOWER_RANK}; at most {dep.max_images} "
        f"images of {dep.max_image_pixels:,} pixels; local images "
        f"{dep.image_dir or 'off'})",
    )
    return vision.VisionLimits(dep.max_images, dep.max_image_pixels, dep.image_dir)


def open_prefix_store(r: Rank, manifest: dict):
    """The on-disk prefix caches of this rank (imported only when configured)."""
    from k3dist.serve import prefix_store

    dep = r.dep
    ident = prefix_store.Identity(
        manifest["build_hash"],
        manifest["placement_hash"],
        dep.attention if r.size > 1 else "replicated",
        dep.dtype,
        r.rank,
        r.size,
    )
    store = prefix_store.PrefixStore(
        dep.prefix_cache_dir,
        ident,
        int(dep.prefix_cache_gb * 1e9),
        dep.prefix_cache_min_tokens,
        r.group,
        dep.prefix_cache_drain_s,
    )
    r.stores.append(store)
    log(r.rank, f"prefix cache: {json.dumps(store.report())}")
    return store


def token_log_path(dep: Deployment, rank: int) -> Path | None:
    if not dep.token_log:
        return None
    path = Path(dep.token_log.format(rank=rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> None:
    close_stdin()
    dep = parse_args(argv)
    api_key = api_key_of(dep)
    if dep.blas_threads:
        k3dist.set_blas_threads(dep.blas_threads)
    r = Rank(dep, join(dep.ring_connect_s))
    if r.rank != launch_rank():
        raise SystemExit(
            f"launch/serve.py: MLX_RANK={launch_rank()} but the group made this rank {r.rank}: "
            "the API key was checked on the wrong rank; start the ranks with mlx.launch"
        )
    supervise.announce_launch_files(r.rank)
    if r.size > 1:
        start_watchdog(r)
    folder = rank_folder(dep, r.rank, r.size)
    pre = preflight.preflight(folder, dep)  # the folder and its caches fit in memory
    log(r.rank, f"preflight: {json.dumps(pre)}")
    model, config, manifest, tokenizer = load(r, folder)
    vocab_size = config["text_config"]["vocab_size"]
    warmed = warm(r, model, vocab_size)
    counted = count(r, model, manifest, pre, warmed)
    keepawake.DeviceHeartbeat(dep.heartbeat_s).start()
    info = describe(r, model, config, manifest, warmed, pre)
    provider = server.K3ModelProvider(server.cli_args(dep), model, tokenizer, dep.model_id)
    limits = attach_vision(r, provider, model, folder, config, tokenizer) if dep.vision else None
    store = open_prefix_store(r, manifest) if dep.prefix_cache_dir else None
    if store is not None:
        info["prefix_cache"] = store.report()
    server.serve(
        dep,
        provider,
        info,
        vocab_size=vocab_size,
        token_log=token_log_path(dep, r.rank),
        vision_limits=limits,
        api_key=api_key,
        prefix_store=store,
        idle_gate=r.wd,
        serve_metrics=counted,
    )


if __name__ == "__main__":
    main()
