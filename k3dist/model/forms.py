"""How the EP model runs: the MoE forms for pairs a rank does not own, and the
prefill chunking that keeps every shape a warmed-up one."""

from __future__ import annotations

from k3dist.format.placement import MOE_FORMS

import mlx.core as mx

# how non-owned (token, expert) pairs are handled (k3dist.model.experts); "auto" picks one.
# "phased": a call of fewer than LOCAL_FROM_TOKENS tokens (decode steps) in the placeholder
# form, a longer one (prefill chunks) in the local form: a chunk's non-owned pairs cost
# more FLOPs than its host syncs (docs/speed.md, "Defaults the table chooses").

# the smallest call that runs local in the phased form: the calibrated model's crossover
# on two M3 Ultras (benchmarks/speed/published_fit.py "defaults"; tests/test_speed_defaults.py)
LOCAL_FROM_TOKENS = 128


def resolve_form(form: str) -> str:
    """``auto``: on Metal the phased form (decode sync-free: a host sync per layer cost the
    published graded build 2.06x decode there; prefill chunks local, fewer FLOPs: the
    calibrated table's choice, docs/speed.md), local-only on CPU (benchmarks/speed/moe_step.py)."""
    if form not in ("auto", *MOE_FORMS):
        raise ValueError(f"moe form must be 'auto' or one of {MOE_FORMS}, not {form!r}")
    if form != "auto":
        return form
    return METAL_FORM if mx.metal.is_available() else "local"


METAL_FORM = "phased"  # what auto resolves to on Metal (the table's choice)


def form_for(form: str, tokens: int) -> str:
    """The form one call of ``tokens`` tokens runs in: ``phased`` resolved by its size."""
    if form != "phased":
        return form
    return "local" if tokens >= LOCAL_FROM_TOKENS else "placeholder"


def split_length(n: int, sizes: list[int]) -> list[int]:
    """``n`` as a sum of the allowed sizes, largest first."""
    parts = []
    for s in sizes:
        while n >= s:
            parts.append(s)
            n -= s
    return parts
