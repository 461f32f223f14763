"""One Mac, as the planner fits a build into it and the cost model times it: memory,
what macOS lets the GPU wire, what stays free of that, bandwidth and compute. One
definition for both (``k3dist.pipeline.byte_budget``, ``k3dist.bench.costmodel``), passed in;
every figure says its source in :data:`SOURCES`."""

from __future__ import annotations

from dataclasses import dataclass

from k3dist.format.kvmemory import GiB


@dataclass(frozen=True)
class Box:
    """A box. Defaults: M3 Ultra (80-core GPU, "512 GB", i.e. 512 GiB) with
    ``iogpu.wired_limit_mb`` raised."""

    name: str = "M3 Ultra 80-core GPU, 512 GB"
    memory_bytes: int = 512 * GiB
    wired_limit_mb: int = 499712  # sysctl iogpu.wired_limit_mb (raised from the default)
    runtime_reserve_bytes: int = 4 * GiB  # of the wired memory: MLX cache, buffers
    mem_bw: float = 819e9  # B/s
    flops: float = 28.7e12  # FLOP/s, assumed

    @property
    def wired_bytes(self) -> int:
        """What the GPU may wire (``iogpu.wired_limit_mb``)."""
        return self.wired_limit_mb << 20

    @property
    def usable_bytes(self) -> int:
        """What a rank's weights, caches and activations may take: the wired memory less
        the runtime reserve."""
        return self.wired_bytes - self.runtime_reserve_bytes


# what macOS and the process's unwired memory keep beside the GPU's wired limit (the
# default Box: 512 GiB less 488 GiB wired); a box of another size keeps the same
OS_RESERVE_GIB = 24


def sized(memory_gib: float, wired_limit_mb: int | None = None) -> Box:
    """An M3 Ultra-class box of ``memory_gib`` GiB: wired limit ``memory - 24 GiB``
    unless given (``sysctl iogpu.wired_limit_mb`` as set on that host)."""
    if not memory_gib > OS_RESERVE_GIB:
        raise ValueError(f"a box of {memory_gib:g} GiB leaves nothing past macOS's 24 GiB")
    wired = int((memory_gib - OS_RESERVE_GIB) * 1024) if wired_limit_mb is None else wired_limit_mb
    if not 0 < wired <= memory_gib * 1024:
        raise ValueError(
            f"wired limit {wired} MB for a {memory_gib:g} GiB box: give 1..{int(memory_gib * 1024)}"
        )
    return Box(
        name=f"{memory_gib:g} GB box", memory_bytes=int(memory_gib * GiB), wired_limit_mb=wired
    )


def box_item(item: str | float | dict) -> dict:
    """One box as a deployment or ``--boxes`` names it: ``256``, ``"256:237568"`` (GiB,
    optionally ``:wired_limit_mb``) or ``{memory_gib, wired_limit_mb, host}``; returned
    as that mapping (``wired_limit_mb`` None: memory - 24 GiB)."""
    if isinstance(item, dict):
        return dict(item)
    mem, _, wired = str(item).strip().partition(":")
    try:
        return {"memory_gib": float(mem), "wired_limit_mb": int(wired) if wired else None}
    except ValueError:
        raise ValueError(
            f"box {item!r}: give GiB[:wired_limit_mb], e.g. 256 or 256:237568"
        ) from None


def parse_boxes(spec: str | list) -> tuple[Box, ...]:
    """``512,256,256`` or ``512,256:230000,256`` (GiB, optionally ``:wired_limit_mb``
    each), or a list of such items or of ``{memory_gib, wired_limit_mb}``: one box per
    rank, in rank order."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for it in items:
        b = box_item(it)
        try:
            out.append(sized(float(b["memory_gib"]), b.get("wired_limit_mb")))
        except ValueError as e:
            raise ValueError(
                f"box {it!r}: {e} (give GiB[:wired_limit_mb], e.g. 256:237568)"
            ) from None
    if not out:
        raise ValueError("no boxes named; give e.g. --boxes 512,256,256")
    return tuple(out)


def boxes_spec(boxes: tuple[Box, ...]) -> str:
    """The ``--boxes`` string of ``boxes`` (each ``GiB:wired_limit_mb``)."""
    return ",".join(f"{b.memory_bytes / GiB:g}:{b.wired_limit_mb}" for b in boxes)


SOURCES = {
    "memory_bytes": "spec: Apple, M3 Ultra up to 512 GB unified memory (512 GiB, 549.76 GB)",
    "wired_limit_mb": "assumed: sysctl iogpu.wired_limit_mb raised to 499712 (488 GiB wired "
    "for the GPU; the default is ~75% of RAM on large machines), 24 GiB left to macOS and "
    "the process's unwired memory (Python, tokenizer, HTTP server, file cache pressure)",
    "runtime_reserve_bytes": "assumed: 4 GiB of the wired memory kept free for MLX's "
    "allocator cache and fragmentation, Metal command buffers and the collective buffers",
    "mem_bw": "spec: Apple, M3 Ultra 819 GB/s unified memory bandwidth",
    "flops": "assumed: 80 GPU cores x 128 FP32 lanes x 2 x ~1.4 GHz (Apple publishes no "
    "TFLOPS); FLOP time stays under ~15% of memory time at batch 1",
}
