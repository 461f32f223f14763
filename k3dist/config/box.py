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
