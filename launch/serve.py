"""Serve Kimi K3 expert-parallel over an OpenAI-compatible API (rank 0 answers).

    mlx.launch --hostfile hostfiles/tb5.json launch/serve.py [--config deploy.yaml]
    mlx.launch --hostfile hostfiles/local.json --python .venv/bin/python launch/serve.py

Every rank: watchdog -> preflight -> load its folder -> warm-up -> serve. With no
model configured it serves the embedded default (made and sliced on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import k3dist
from k3dist.format import deployment, manifest
from k3dist.format.deployment import Deployment
from k3dist.format.kvmemory import GiB
from k3dist.format.placement import Placement
from k3dist.format.verify import Report
from k3dist.model.group import join
from k3dist.serve import (
    auth,
    keepawake,
    loader,
    metrics,
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
    again when its cache is stale (data/mini-k3 or k3dist's formats changed): only then
    is the build pipeline imported (serving itself needs the format layer only)."""
    folder = dep.rank_path(rank)
    if dep.build != Deployment().build or dep.rank_dir != Deployment().rank_dir:
        return folder
    if manifest.slices_current_build(folder, k3dist.DATA_DIR / "mini-k3"):
        return folder
    from k3dist.build import default

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


def main(argv: list[str] | None = None) -> None:
    close_stdin()
    dep = parse_args(argv)
    api_key = None
    # Only rank 0 answers HTTP, so only its Mac needs the key file (README, deploy/tb5.yaml).
    # Checked before the group is joined: a bad key file, or another machine's reach
    # without a key, stops us here (mlx.launch then ends the other ranks).
    if launch_rank() == 0:
        try:
            api_key = auth.load_key(dep.api_key, dep.api_key_file)
            auth.check_exposure(dep.host, api_key, dep.allow_no_api_key)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"launch/serve.py: refusing to start: {e}") from None
    if dep.blas_threads:
        k3dist.set_blas_threads(dep.blas_threads)
    group = join(dep.ring_connect_s)
    rank, size = group.rank(), group.size()
    if rank != launch_rank():
        raise SystemExit(
            f"launch/serve.py: MLX_RANK={launch_rank()} but the group made this rank {rank}: "
            "the API key was checked on the wrong rank; start the ranks with mlx.launch"
        )
    supervise.announce_launch_files(rank)

    stores: list = []  # the prefix store, once made: a stop drains its writer

    def on_stop(why: str, origin: int) -> None:
        server.abort_streams(f"server stopping: {why} (from rank {origin})")
        for store in stores:  # every rank, the same bound (prefix_cache_drain_s)
            store.drain()

    wd = None
    if size > 1:
        host, port = watchdog.coordinator_address(group, port=dep.watchdog_port)
        wd = watchdog.Watchdog(
            rank,
            size,
            host,
            port,
            timeout_s=dep.watchdog_timeout_s,
            parent_pid=os.getppid() if dep.stop_with_launcher else None,
            on_lost=lambda r, why: server.abort_streams(f"rank {r} was lost ({why})"),
            on_stop=on_stop,
            stop_work_s=dep.prefix_cache_drain_s if dep.prefix_cache_dir else 0.0,
        )
        wd.start()
        watchdog.install_signal_handlers(wd)
        watchdog.install_failure_hook(wd)  # a failing rank tells the others why
        log(rank, f"watchdog: coordinator {host}:{port}, timeout {dep.watchdog_timeout_s}s")

    folder = rank_folder(dep, rank, size)

    pre = preflight.preflight(
        folder,
        headroom_bytes=int(dep.memory_headroom_gb * GiB),
        max_batch=dep.max_batch,
        max_context=dep.max_context,
        prefill_chunk=dep.prefill_chunk,
        prompt_cache_tokens=dep.prompt_cache_tokens,
        dtype=dep.dtype,
    )
    log(rank, f"preflight: {json.dumps(pre)}")

    t0 = time.perf_counter()
    model, config, manifest = loader.load_rank(
        folder,
        group,
        dep.dtype,
        dep.moe_form,
        dep.verify,
        peer_failure=wd.peer_failures.get if wd else None,
        attention=dep.attention,
        boxes=dep.boxes,
    )
    log(rank, f"{folder}: {Report(**manifest['verify']).summary()}")
    tokenizer = loader.load_tokenizer(folder)
    log(
        rank,
        f"loaded {folder} (build {manifest['build_hash']}, placement "
        f"{manifest['placement_hash']}, moe form {loader.resolve_form(dep.moe_form)}) "
        f"in {time.perf_counter() - t0:.1f}s",
    )

    model.chunk_sizes = warmup.chunk_sizes(dep.prefill_chunk)
    warm = None
    if dep.warmup:
        defaults = {"temp": dep.temperature, "top_p": dep.top_p}  # the deployment's own
        warm = warmup.warm_up(
            model,
            dep.prefill_chunk,
            config["text_config"]["vocab_size"],
            (*warmup.SAMPLERS, defaults),
            dep.max_batch,
        )
        log(rank, f"warm-up: {json.dumps(warm)}")
    counted = (
        None
        if not dep.metrics
        else metrics.ServeMetrics(
            rank,
            size,
            preflight=pre,
            warm=warm is not None,
            peers=(lambda: dict(wd.peer_stats)) if wd else None,
            peer_timeout_s=dep.watchdog_timeout_s,
        )
    )
    if wd is not None and counted is not None:
        wd.stats = counted.rank_stats  # rank 1's figures reach rank 0 with its heartbeat
    if rank == 0 and counted is not None:  # every rank routes alike: rank 0's counts are all's
        counted.attach_routes(model, Placement.from_json(manifest["placement"]).owners)
    beat = keepawake.DeviceHeartbeat(dep.heartbeat_s)
    beat.start()

    info = {
        "ranks": size,
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
        "warmup": warm,
        "warmup_kernels": warmup.jit_kernels_loaded(),
        "blas": k3dist.blas_status(),
        "preflight": pre,
        "verify": manifest["verify"]["mode"],
    }
    args = server.cli_args(
        model_id=dep.model_id,
        max_tokens=dep.max_tokens,
        temp=dep.temperature,
        top_p=dep.top_p,
        prefill_step_size=dep.prefill_chunk,
        cors_origins=dep.cors_origins,
        max_batch=dep.max_batch,
    )
    provider = server.K3ModelProvider(args, model, tokenizer, dep.model_id)
    limits = None
    if dep.vision:  # mlx-vlm is imported only here
        from k3dist.serve import vision

        provider.processor = vision.attach(
            model, folder, config, tokenizer, group, loader.DTYPES[dep.dtype]
        )
        limits = vision.VisionLimits(dep.max_images, dep.max_image_pixels, dep.image_dir)
        log(
            rank,
            f"vision: on (tower on rank {vision.TOWER_RANK}; at most {dep.max_images} "
            f"images of {dep.max_image_pixels:,} pixels; local images "
            f"{dep.image_dir or 'off'})",
        )
    token_log = Path(dep.token_log.format(rank=rank)) if dep.token_log else None
    if token_log is not None:
        token_log.parent.mkdir(parents=True, exist_ok=True)
        token_log.unlink(missing_ok=True)
    store = None
    if dep.prefix_cache_dir:  # imported only when configured
        from k3dist.serve import prefix_store

        ident = prefix_store.Identity(
            manifest["build_hash"],
            manifest["placement_hash"],
            dep.attention if size > 1 else "replicated",
            dep.dtype,
            rank,
            size,
        )
        store = prefix_store.PrefixStore(
            dep.prefix_cache_dir,
            ident,
            int(dep.prefix_cache_gb * 1e9),
            dep.prefix_cache_min_tokens,
            group,
            dep.prefix_cache_drain_s,
        )
        stores.append(store)
        info["prefix_cache"] = store.report()
        log(rank, f"prefix cache: {json.dumps(store.report())}")
    server.serve(
        dep.host,
        dep.port,
        provider,
        max_context=dep.max_context,
        info=info,
        vocab_size=config["text_config"]["vocab_size"],
        max_queued_requests=dep.max_queued_requests,
        max_connections=dep.max_connections,
        token_log=token_log,
        vision_limits=limits,
        api_key=api_key,
        prompt_cache_tokens=dep.prompt_cache_tokens,
        prefix_store=store,
        prefix_preload_bytes=int(dep.prefix_cache_preload_gb * 1e9),
        idle_gate=wd,
        serve_metrics=counted,
        keepalive_s=dep.keepalive_s,
    )


if __name__ == "__main__":
    main()
