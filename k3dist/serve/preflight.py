"""Memory preflight: before minutes of loading, does this rank's folder fit in the
memory this machine can give it (and, on Metal, under the wired limit), and does the
deployment's headroom hold what serving will keep beside the weights? Refuse with the
numbers and the fix; otherwise wire the footprint. The headroom is the deployment's
``memory_headroom_gib`` (``k3dist.config.deployment``); it must hold at least the KV cache and
state of ``max_batch`` requests at ``max_context`` tokens plus the prompt cache's bound
(:func:`kv_need`) and the activations of one ``prefill_chunk`` at ``max_context``
(:func:`activation_need`), both from ``k3dist.format.kvmemory``: the arithmetic the build
planner budgets with. Running out of memory under load on Metal is a crash, not an error a
client sees.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from k3dist.config.deployment import Deployment
from k3dist.format import kvmemory, layout, manifest
from k3dist.format.folder import load_config
from k3dist.format.kvmemory import GiB
from k3dist.format.sfile import read_header

import mlx.core as mx

MiB = 1 << 20


class PreflightError(RuntimeError):
    """This rank cannot fit; the message has the numbers and the fix."""


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB ({n:,} bytes)"


def folder_weight_bytes(folder: str | Path) -> int:
    """Bytes of tensor data in the folder's safetensors files (what loading maps in)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise PreflightError(
            f"{folder}: no *.safetensors files; pass a rank folder made by "
            "slicing/rank_split.py (or a build folder)"
        )
    return sum(h.file_size - h.data_offset for h in map(read_header, files))


def parse_meminfo(text: str) -> int:
    """Linux: MemAvailable (the kernel's estimate of memory usable without swapping)."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"/proc/meminfo: unexpected unit {unit!r} for MemAvailable")
            return int(value) * 1024
    raise ValueError("/proc/meminfo has no MemAvailable line (Linux >= 3.14 has it)")


def parse_vm_stat(text: str) -> int:
    """macOS: (free + inactive) pages x page size. Speculative and purgeable pages are
    left out, so this errs on the side of refusing."""
    lines = text.splitlines()
    if not lines or "page size of" not in lines[0]:
        raise ValueError(f"vm_stat: no page size in the first line {lines[:1]}")
    page = int(lines[0].split("page size of")[1].split()[0])
    pages = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        if value.strip().rstrip(".").isdigit():
            pages[key.strip()] = int(value.strip().rstrip("."))
    missing = [k for k in ("Pages free", "Pages inactive") if k not in pages]
    if missing:
        raise ValueError(f"vm_stat: no {missing} lines")
    return (pages["Pages free"] + pages["Pages inactive"]) * page


def free_memory() -> tuple[int, str]:
    """(bytes this process could use now, where the number came from)."""
    if sys.platform == "darwin":
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, check=True).stdout
        return parse_vm_stat(out), "vm_stat free+inactive pages"
    return parse_meminfo(Path("/proc/meminfo").read_text()), "/proc/meminfo MemAvailable"


def _sysctl_int(name: str) -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def metal_limits() -> dict | None:
    """The GPU's wired-memory ceiling where Metal is present, else None."""
    if not mx.metal.is_available():
        return None
    try:
        info = mx.device_info(mx.gpu)
    except (AttributeError, TypeError):  # older MLX: only the metal namespace has it
        info = mx.metal.device_info()
    return {
        "max_recommended_working_set_bytes": int(info["max_recommended_working_set_size"]),
        "memory_bytes": int(info["memory_size"]),
        # 0 means the macOS default (about 3/4 of memory on large machines)
        "iogpu_wired_limit_mb": _sysctl_int("iogpu.wired_limit_mb"),
    }


def _attention_layout(folder: Path) -> tuple[dict, int, list[int]]:
    """The folder's text config, and the ranks its attention is split over with the
    layers whose heads are divided (a rank folder sliced with attention split: its
    manifest says which; anything else: 1, none)."""
    try:
        tc = layout.text_config(load_config(folder))
    except (OSError, ValueError) as e:
        raise PreflightError(
            f"{folder}: cannot read config.json ({e}); pass a rank folder made "
            "by slicing/rank_split.py (or a build folder)"
        ) from None
    size, split = 1, []
    try:
        m = json.loads((folder / manifest.MANIFEST).read_text())
        if manifest.attention_of(m)["mode"] == "split":
            size, split = int(m["size"]), list(manifest.attention_of(m)["split_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no (readable) manifest: count the whole state; the loader checks the folder
    return tc, size, split


def _figures(folder: Path, what: str, figure, **kw) -> tuple[dict, int, list[int]]:
    """``figure`` (a ``kvmemory`` function) of the folder's config at its attention
    split, with that split (ranks, split layers); a config without K3's settings is a
    PreflightError naming the file and the fix."""
    tc, size, split = _attention_layout(folder)
    try:
        return figure(tc, size=size, split_layers=split, **kw), size, split
    except (KeyError, TypeError) as e:
        raise PreflightError(
            f"{folder}/config.json: no K3 {what} settings ({e!r} missing); "
            "pass a rank folder made by slicing/rank_split.py"
        ) from None


def kv_need(
    folder: str | Path,
    *,
    max_batch: int,
    max_context: int,
    prompt_cache_tokens: int | None = None,
    dtype: str = "bfloat16",
) -> dict:
    """The KV cache and state serving keeps on this rank at most
    (``k3dist.format.kvmemory.serving_bytes``): ``max_batch`` requests at ``max_context``
    tokens and the prompt cache (``prompt_cache_tokens``; None: 4 x ``max_context``), in
    the deployment's compute ``dtype``, from the folder's ``config.json``. A rank folder
    sliced with attention split holds its share of the split layers' KDA state (its
    manifest says which); anything else, all of it."""
    kv, size, split = _figures(
        Path(folder),
        "attention",
        kvmemory.serving_bytes,
        context=max_context,
        batch=max_batch,
        prompt_cache_tokens=prompt_cache_tokens,
        act=kvmemory.act_bytes(dtype),
    )
    return {**kv, "dtype": dtype, "attention_ranks": size, "split_layers": len(split)}


def activation_need(
    folder: str | Path, *, max_context: int, prefill_chunk: int, dtype: str = "bfloat16"
) -> dict:
    """The peak activations of one prefill chunk of ``prefill_chunk`` tokens at
    ``max_context`` on this rank (``k3dist.format.kvmemory.prefill_activation_bytes``), in
    the deployment's compute ``dtype``; a rank folder sliced with attention split holds
    its share of the split MLA layers' heads (its manifest says which)."""
    act, size, _ = _figures(
        Path(folder),
        "model",
        kvmemory.prefill_activation_bytes,
        context=max_context,
        chunk=prefill_chunk,
        act=kvmemory.act_bytes(dtype),
    )
    return {**act, "dtype": dtype, "attention_ranks": size}


def check_memory(
    folder: str | Path,
    weights: int,
    headroom: int,
    free: int,
    free_source: str,
    metal: Mapping | None = None,
    kv: Mapping | None = None,
    act: Mapping | None = None,
) -> int:
    """Refuse (PreflightError) unless the headroom holds ``kv`` (:func:`kv_need`) plus
    ``act`` (:func:`activation_need`; either None: not counted) and weights + headroom
    fit; returns the footprint.
    Pure: preflight passes the measured numbers, tests pass pretend ones."""
    kv_total = kv["total"] if kv is not None else 0
    act_total = act["total"] if act is not None else 0
    # a prompt joining the decode batch copies the batch's caches; never during a prefill
    joining = kv["requests"] if kv is not None else 0
    need = kv_total + max(act_total, joining)
    if (kv is not None or act is not None) and need > headroom:
        parts = []
        if kv is not None:
            pc = kv["prompt_cache"]
            parts.append(
                f"serving max_batch {kv['batch']} requests together of up to max_context "
                f"{kv['context']:,} tokens keeps up to {_gib(kv['requests'])} of KV cache and "
                f"state on this rank ({_gib(kv['per_request'])} a request, {kv['dtype']}), and "
                f"the prompt cache up to {_gib(pc['total'])} (prompt_cache_tokens "
                f"{pc['tokens']:,}: at most {pc['tokens_held_at_most']:,} tokens in "
                f"{pc['entries_at_most']} entries): {_gib(kv_total)}"
            )
        if act is not None:
            parts.append(
                f"prefilling a prefill_chunk of {act['prefill_chunk']:,} tokens at "
                f"{act['context']:,} tokens of context takes up to {_gib(act_total)} of "
                f"activations ({act['attention_heads']} attention heads on this rank: MLA k/v "
                f"{_gib(act['mla_kv_decompressed'])}, attention scores "
                f"{_gib(act['attention_scores'])}, {act['dtype']})"
            )
        if joining > act_total:
            parts.append(
                f"a prompt joining the decode batch copies its caches: "
                f"{_gib(joining)} more for a moment"
            )
        only = "" if act is not None else ", which must also hold the prefill activations"
        knobs = (
            "max_batch, max_context, prompt_cache_tokens or prefill_chunk"
            if act is not None
            else "max_batch, max_context or prompt_cache_tokens"
        )
        raise PreflightError(
            f"{folder}: {'; '.join(parts)}; {_gib(need)} in all, but "
            f"memory_headroom_gib is {headroom / GiB:g} ({_gib(headroom)}){only}; fix: lower "
            f"{knobs}, or raise memory_headroom_gib above "
            f"{math.ceil(need / GiB)} where the machine has the memory (a "
            "smaller build leaves more)"
        )
    footprint = weights + headroom
    need = (
        f"{folder} needs {_gib(footprint)}: {_gib(weights)} of weights + "
        f"{_gib(headroom)} headroom for KV cache and activations"
    )
    smaller = (
        "serve a smaller build (more experts in the 2-bit lo bank) or slice for more "
        "ranks (slicing/rank_split.py --size N+1)"
    )
    if footprint > free:
        raise PreflightError(
            f"{need}, but only {_gib(free)} is free ({free_source}); fix: "
            f"free {_gib(footprint - free)} (quit other programs), {smaller}"
        )
    if metal is not None:
        ceiling = metal["max_recommended_working_set_bytes"]
        if footprint > ceiling:
            mb = math.ceil(footprint / MiB)
            # macOS itself needs a few GiB that are never wired.
            if mb * MiB > metal["memory_bytes"] - 4 * GiB:
                raise PreflightError(
                    f"{need}, more than this machine can wire "
                    f"({_gib(metal['memory_bytes'])} of memory); fix: {smaller}"
                )
            raise PreflightError(
                f"{need}, but Metal may wire only {_gib(ceiling)} (iogpu.wired_limit_mb="
                f"{metal.get('iogpu_wired_limit_mb')}); fix: sudo sysctl iogpu.wired_limit_mb="
                f"{mb} (resets at reboot), or {smaller}"
            )
    return footprint


def serving_need(folder: str | Path, dep: Deployment) -> tuple[dict, dict]:
    """:func:`kv_need` and :func:`activation_need` at a deployment's limits: its
    ``max_batch``, ``max_context``, ``prompt_cache_tokens``, ``prefill_chunk`` and
    ``dtype``."""
    kv = kv_need(
        folder,
        max_batch=dep.max_batch,
        max_context=dep.max_context,
        prompt_cache_tokens=dep.prompt_cache_tokens,
        dtype=dep.dtype,
    )
    act = activation_need(
        folder, max_context=dep.max_context, prefill_chunk=dep.prefill_chunk, dtype=dep.dtype
    )
    return kv, act


def preflight(
    folder: str | Path,
    dep: Deployment,
    *,
    free_bytes: int | None = None,
    set_wired: bool = True,
) -> dict:
    """Check that this rank's folder and what serving keeps beside it
    (:func:`serving_need` at the deployment's limits) fit in its ``memory_headroom_gib``
    before loading it; on Metal, wire it.

    ``free_bytes`` replaces the measured free memory (tests, or a deployment that
    knows better). Returns the numbers, for serve to print as evidence.
    """
    headroom_bytes = int(dep.memory_headroom_gib * GiB)
    weights = folder_weight_bytes(folder)
    kv, act = serving_need(folder, dep)
    if free_bytes is None:
        free, source = free_memory()
    else:
        free, source = int(free_bytes), "given"
    metal = metal_limits()
    footprint = check_memory(folder, weights, headroom_bytes, free, source, metal, kv, act)
    report = {
        "folder": str(folder),
        "weights_bytes": weights,
        "headroom_bytes": headroom_bytes,
        "kv_need_bytes": kv["total"],
        "activations_bytes": act["total"],
        "need_bytes": kvmemory.need_bytes(kv, act)["total"],
        "kv": {
            k: kv[k]
            for k in ("batch", "context", "dtype", "per_request", "requests", "attention_ranks")
        }
        | {
            "prompt_cache_tokens": kv["prompt_cache"]["tokens"],
            "prompt_cache_bytes": kv["prompt_cache"]["total"],
        },
        "footprint_bytes": footprint,
        "free_bytes": free,
        "free_source": source,
        "metal": metal,
        "wired_limit_set_bytes": None,
        "previous_wired_limit_bytes": None,
    }
    if metal is not None and set_wired:
        # Wiring keeps the weights resident: without it macOS may page expert banks
        # out between requests and the first token after an idle spell stalls.
        try:
            report["previous_wired_limit_bytes"] = mx.set_wired_limit(footprint)
        except (RuntimeError, ValueError) as e:
            raise PreflightError(
                f"mx.set_wired_limit({footprint:,}) failed ({e}); fix: sudo "
                f"sysctl iogpu.wired_limit_mb={math.ceil(footprint / MiB)}"
            ) from None
        report["wired_limit_set_bytes"] = footprint
    return report
