"""How the EP model runs: the MoE forms for pairs a rank does not own, and the
prefill chunking that keeps every shape a warmed-up one."""

from __future__ import annotations

from k3dist.format.placement import MOE_FORMS

import mlx.core as mx


def resolve_form(form: str) -> str:
    """``auto``: sync-free on Metal (a host sync per layer cost the published graded
    build 2.06x decode there), local-only on CPU (benchmarks/speed/moe_step.py)."""
    if form not in ("auto", *MOE_FORMS):
        raise ValueError(f"moe form must be 'auto' or one of {MOE_FORMS}, not {form!r}")
    if form != "auto":
        return form
    return "placeholder" if mx.metal.is_available() else "local"


def split_length(n: int, sizes: list[int]) -> list[int]:
    """``n`` as a sum of the allowed sizes, largest first."""
    parts = []
    for s in sizes:
        while n >= s:
            parts.append(s)
            n -= s
    return parts
