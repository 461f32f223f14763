"""The gradient of a MoE layer's routed sum w.r.t. a quantized expert bank's affine
scales and biases, computed a chunk of experts at a time.

DWQ trains the ``scales`` / ``biases`` of the lo-bank ``SwitchGLU``. ``mx.grad`` through
``mx.gather_qmm`` w.r.t. them is exact, but its backward materialises a dense
``(E, out, in)`` float32 weight gradient plus a full dequantize of the stack however few
experts are routed: ~40 GB dense (~120 GB transient) for one real K3 projection
(896 x 3072 x 3584). The loss depends on the bank only through the routed sum

    y_t = sum_r weff[t, r] * E_{ids[t, r]}(x_t),

so with ``g = dL/dy`` held fixed the bank gradient is the gradient of the scalar
``sum_t g_t . y_t``, which is a sum over experts. A chunk of experts ``[e0, e1)`` gets
the gradient of its own partial sum (only the routes into the chunk, selected on the
host) w.r.t. its own slices of the parameters, evaluated before the next chunk: peak is
one chunk's dense gradient, never the stack's. Chunks nobody routes to get zeros
without any compute.

    grads = bank_grads(layer.mlp.switch_mlp, x_latent, ids, weff, g, chunk=64)
"""

from __future__ import annotations

from collections.abc import Callable

from k3dist.format.layout import MLP_PROJS

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

TRAINED = ("scales", "biases")


def trained_keys() -> list[str]:
    """The gradient's keys, named like ``bank.parameters()`` flattened."""
    return [f"{p}.{t}" for p in MLP_PROJS for t in TRAINED]


def _check_bank(bank: SwitchGLU) -> None:
    """Refuse what has no (or no trainable) gradient here, naming the tensor and why."""
    for p in MLP_PROJS:
        proj = getattr(bank, p, None)
        if not isinstance(proj, QuantizedSwitchLinear):
            raise TypeError(
                f"{p}: expected a QuantizedSwitchLinear, got {type(proj).__name__}; only a "
                "quantized expert bank has scales/biases to train (quantize it first)"
            )
        if proj.mode != "affine" or proj.get("biases") is None:
            raise ValueError(
                f"{p}.scales: mode {proj.mode!r} has no gradient w.r.t. its scales (only "
                "affine banks are trained; an MXFP4 hi bank stays frozen — pass the lo "
                "bank, mlp.switch_mlp)"
            )
        if proj.get("global_scale") is not None:
            raise ValueError(f"{p}: a global_scale bank is not affine; it stays frozen")


def _flatten(x: mx.array, ids: mx.array, weff: mx.array, g: mx.array):
    lead = ids.shape[:-1]
    if x.shape[:-1] != lead or weff.shape != ids.shape or g.shape[:-1] != lead:
        raise ValueError(
            f"bank_grads: leading dims differ: x {x.shape}, ids {ids.shape}, weff "
            f"{weff.shape}, g {g.shape} (want x [..., D], ids/weff [..., k], g [..., D_out])"
        )
    k = ids.shape[-1]
    return (
        x.reshape(-1, x.shape[-1]),
        ids.reshape(-1, k),
        weff.reshape(-1, k),
        g.reshape(-1, g.shape[-1]),
    )


def _glu(bank: SwitchGLU, params: dict[str, mx.array], x: mx.array, idx: mx.array) -> mx.array:
    """SwitchGLU's sorted path on (sliced) parameters: x [n, D], idx [n] sorted ->
    [n, D_out]. The projections are called as QuantizedSwitchLinear calls them."""

    def proj(name: str, h: mx.array) -> mx.array:
        mod = getattr(bank, name)
        out = mx.gather_qmm(
            h,
            params[f"{name}.weight"],
            params[f"{name}.scales"],
            params[f"{name}.biases"],
            rhs_indices=idx,
            transpose=True,
            group_size=mod.group_size,
            bits=mod.bits,
            mode=mod.mode,
            sorted_indices=True,
        )
        if f"{name}.bias" in params:
            out = out + mx.expand_dims(params[f"{name}.bias"][idx], -2)
        return out

    h = mx.expand_dims(x, -2)  # [n, 1, D]: one row per route
    x_up = proj("up_proj", h)
    x_gate = proj("gate_proj", h)
    return proj("down_proj", bank.activation(x_up, x_gate)).squeeze(-2)


def _chunk_params(bank: SwitchGLU, e0: int, e1: int) -> tuple[dict, dict]:
    """(trained, frozen) slices of experts [e0, e1), keyed like the bank's parameters."""
    trained, frozen = {}, {}
    for p in MLP_PROJS:
        mod = getattr(bank, p)
        for t in TRAINED:
            trained[f"{p}.{t}"] = mod[t][e0:e1]
        frozen[f"{p}.weight"] = mod["weight"][e0:e1]
        if "bias" in mod:
            frozen[f"{p}.bias"] = mod["bias"][e0:e1]
    return trained, frozen


def _chunk_grad(
    bank: SwitchGLU, e0: int, e1: int, x: mx.array, idx: mx.array, w: mx.array, g: mx.array
) -> dict[str, mx.array]:
    trained, frozen = _chunk_params(bank, e0, e1)

    def partial_sum(tr: dict[str, mx.array]) -> mx.array:
        y = _glu(bank, {**tr, **frozen}, x, idx)
        return (g * (y * w[:, None]).astype(g.dtype)).sum()

    return mx.grad(partial_sum)(trained)


def bank_grads(
    bank: SwitchGLU, x: mx.array, ids: mx.array, weff: mx.array, g: mx.array, chunk: int = 64
) -> dict[str, mx.array]:
    """Exact d(sum_t g_t . y_t)/d(scales, biases) of every projection of the quantized
    SwitchGLU `bank`, keyed like bank.parameters() flattened ("gate_proj.scales",
    "gate_proj.biases", "up_proj.scales", ...), each [E, out, in/group] with the bank's
    own scales/biases shape and dtype, computed `chunk` experts at a time.

    x [..., D], ids/weff [..., k], g [..., D_out] share leading dims. Routes with weff 0
    (not this bank's) contribute nothing and are skipped. Each chunk is evaluated before
    the next, so the transient is one chunk's dense (chunk, out, in) gradient."""
    _check_bank(bank)
    if chunk < 1:
        raise ValueError(f"bank_grads: chunk must be >= 1, got {chunk}")
    x, ids, weff, g = _flatten(x, ids, weff, g)
    num_experts = bank.gate_proj.num_experts
    # host-side route selection (training, not decode): every (token, route) with a
    # nonzero weight, sorted by expert so each chunk is one contiguous run
    ids_np = np.array(ids.astype(mx.int64))
    w_np = np.array(weff.astype(mx.float32))
    if ids_np.size and (ids_np.min() < 0 or ids_np.max() >= num_experts):
        raise ValueError(f"bank_grads: ids outside [0, {num_experts}) of this bank")
    tok, rt = np.nonzero(w_np != 0)
    exp = ids_np[tok, rt]
    order = np.argsort(exp, kind="stable")
    tok, rt, exp = tok[order], rt[order], exp[order]

    out: dict[str, list[mx.array]] = {k: [] for k in trained_keys()}
    for e0 in range(0, num_experts, chunk):
        e1 = min(e0 + chunk, num_experts)
        lo, hi = np.searchsorted(exp, [e0, e1])
        if hi == lo:  # nobody routes here: zeros, nothing computed
            for key in out:
                p, t = key.split(".")
                ref = getattr(bank, p)[t]
                out[key].append(mx.zeros((e1 - e0, *ref.shape[1:]), dtype=ref.dtype))
            mx.eval([v[-1] for v in out.values()])
            continue
        sel_t = mx.array(tok[lo:hi])
        sel_r = mx.array(rt[lo:hi])
        grads = _chunk_grad(
            bank,
            e0,
            e1,
            x[sel_t],
            mx.array(exp[lo:hi] - e0, dtype=mx.uint32),
            weff[sel_t, sel_r],
            g[sel_t],
        )
        mx.eval(grads)
        for key, v in grads.items():
            out[key].append(v)
    return _concat(out)


def _concat(parts: dict[str, list[mx.array]]) -> dict[str, mx.array]:
    """One key at a time, dropping its chunks as it goes (peak: one projection twice)."""
    result = {}
    for key in list(parts):
        result[key] = mx.concatenate(parts.pop(key), axis=0)
        mx.eval(result[key])
    return result


def plain_grads(
    bank: SwitchGLU, x: mx.array, ids: mx.array, weff: mx.array, g: mx.array, chunk: int = 64
) -> dict[str, mx.array]:
    """The reference: one ``mx.grad`` through ``bank(x, ids)`` over the whole stack (what
    bank_grads replaces; its backward holds a dense (E, out, in) gradient). `chunk` is
    ignored; it is there so the two are interchangeable."""
    _check_bank(bank)
    x, ids, weff, g = _flatten(x, ids, weff, g)
    trained = {k: getattr(bank, k.split(".")[0])[k.split(".")[1]] for k in trained_keys()}
    return _grad_through_bank(bank, trained, lambda: bank(x, ids), weff, g)


def _grad_through_bank(
    bank: SwitchGLU,
    trained: dict[str, mx.array],
    forward: Callable[[], mx.array],
    weff: mx.array,
    g: mx.array,
) -> dict[str, mx.array]:
    """Gradient of sum(g * (forward() * weff).sum(-2)) w.r.t. `trained`, set into the
    bank's own modules for the call and put back after (the bank is left unchanged)."""
    saved = {k: getattr(bank, k.split(".")[0])[k.split(".")[1]] for k in trained}

    def loss(tr: dict[str, mx.array]) -> mx.array:
        for k, v in tr.items():
            p, t = k.split(".")
            getattr(bank, p)[t] = v
        y = (forward() * weff[..., None]).sum(axis=-2)
        return (g * y.astype(g.dtype)).sum()

    try:
        grads = mx.grad(loss)(trained)
        mx.eval(grads)
    finally:
        for k, v in saved.items():
            p, t = k.split(".")
            getattr(bank, p)[t] = v
    return grads
