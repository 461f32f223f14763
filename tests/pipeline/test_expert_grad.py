"""The expert-chunked bank gradient equals one mx.grad through the whole bank, and a
dense dequantized reference, exactly up to float32 summation order."""

from __future__ import annotations

from k3dist.pipeline.expert_grad import bank_grads, plain_grads, trained_keys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.kimi_k3 import SiTU
from mlx_lm.models.switch_layers import SwitchGLU

D, H, E, K = 64, 64, 16, 4  # H: down_proj.in must divide by g64
UNROUTED = (13, 14)  # never routed
ZERO_ONLY = 15  # routed only with weff 0


def make_bank(bits: int, group: int, mode: str = "affine") -> SwitchGLU:
    mx.random.seed(bits * 100 + group)
    bank = SwitchGLU(D, H, E, activation=SiTU(1.0, 2.0))
    nn.quantize(bank, group_size=group, bits=bits, mode=mode)
    mx.eval(bank.parameters())
    return bank


def make_routes(lead: tuple[int, ...], seed: int = 0):
    """Routes avoiding UNROUTED; expert ZERO_ONLY appears only with weight 0, and a few
    other routes have weight 0 too (another bank serves them)."""
    mx.random.seed(seed)
    x = mx.random.normal((*lead, D))
    ids = mx.random.randint(0, ZERO_ONLY, (*lead, K))
    w = mx.random.uniform(0.1, 1.0, (*lead, K))
    drop = mx.random.uniform(shape=(*lead, K)) < 0.2
    ids = mx.where(drop, ZERO_ONLY, ids).astype(mx.uint32)
    w = mx.where(drop, 0.0, w)
    ids = mx.where(ids == UNROUTED[0], 0, mx.where(ids == UNROUTED[1], 1, ids)).astype(mx.uint32)
    g = mx.random.normal((*lead, D))
    return x, ids, w, g


def autograd(bank: SwitchGLU, x, ids, w, g) -> dict[str, mx.array]:
    """mx.grad of sum(g * (bank(x, ids) * weff).sum(-2)) through the module itself."""
    bank.freeze()
    bank.apply_to_modules(
        lambda _, m: (
            m.unfreeze(keys=["scales", "biases"], recurse=False) if hasattr(m, "scales") else None
        )
    )

    def loss(model, x):
        return (g * (model(x, ids) * w[..., None]).sum(axis=-2)).sum()

    _, grads = nn.value_and_grad(bank, loss)(bank, x)
    return dict(tree_flatten(grads))


def dense_reference(bank: SwitchGLU, x, ids, w, g) -> dict[str, mx.array]:
    """Independent of gather_qmm: W = codes * scales + biases (per group), each route's
    expert applied with dense matmuls, differentiated w.r.t. scales/biases."""
    codes = {}
    for p in ("gate_proj", "up_proj", "down_proj"):
        m = getattr(bank, p)
        ones = mx.ones_like(m.scales)
        codes[p] = mx.dequantize(m.weight, ones, mx.zeros_like(ones), m.group_size, m.bits)
    xf, idsf, wf, gf = (a.reshape(-1, a.shape[-1]) for a in (x, ids, w, g))

    def weight(p, tr):
        s, b = tr[f"{p}.scales"], tr[f"{p}.biases"]
        gs = getattr(bank, p).group_size
        q = codes[p].reshape(*s.shape, gs)
        return (q * s[..., None] + b[..., None]).reshape(codes[p].shape)

    def loss(tr):
        wg, wu, wd = (weight(p, tr) for p in ("gate_proj", "up_proj", "down_proj"))
        total = mx.array(0.0)
        for r in range(K):
            e = idsf[:, r]
            h = bank.activation((wu[e] @ xf[:, :, None])[..., 0], (wg[e] @ xf[:, :, None])[..., 0])
            y = (wd[e] @ h[:, :, None])[..., 0]
            total = total + (gf * y * wf[:, r : r + 1]).sum()
        return total

    tr = {k: getattr(bank, k.split(".")[0])[k.split(".")[1]] for k in trained_keys()}
    return mx.grad(loss)(tr)


def close(a: mx.array, b: mx.array, rtol: float = 1e-5) -> bool:
    scale = max(mx.abs(b).max().item(), 1e-30)
    return mx.abs(a - b).max().item() <= rtol * scale


@pytest.mark.parametrize("bits,group", [(2, 32), (4, 64)])
@pytest.mark.parametrize(
    "lead", [(40,), (2, 20), (10,)], ids=["T40-sorted", "B2xL20", "T10-unsorted"]
)
def test_chunked_equals_mx_grad(bits, group, lead):
    bank = make_bank(bits, group)
    x, ids, w, g = make_routes(lead)
    assert (ids.size >= 64) == (lead != (10,))  # SwitchGLU's sorted path vs not
    ref = plain_grads(bank, x, ids, w, g)
    auto = autograd(bank, x, ids, w, g)
    dense = dense_reference(bank, x, ids, w, g)
    assert sorted(ref) == sorted(auto) == sorted(trained_keys())
    for key in ref:
        assert close(ref[key], auto[key]), key
        assert close(ref[key], dense[key], rtol=1e-4), key  # different kernels
        assert mx.abs(ref[key]).max().item() > 0, key
    for chunk in (1, 5, E):
        got = bank_grads(bank, x, ids, w, g, chunk=chunk)
        assert sorted(got) == sorted(ref)
        for key in ref:
            own = getattr(bank, key.split(".")[0])[key.split(".")[1]]
            assert got[key].shape == own.shape and got[key].dtype == own.dtype, key
            assert close(got[key], ref[key]), (chunk, key)
            for e in (*UNROUTED, ZERO_ONLY):
                assert mx.all(got[key][e] == 0).item(), (chunk, key, e)
                assert mx.all(ref[key][e] == 0).item(), (chunk, key, e)


def test_bank_is_left_unchanged_and_grads_move_the_loss():
    bank = make_bank(2, 32)
    x, ids, w, g = make_routes((40,), seed=3)
    before = {k: mx.array(v) for k, v in tree_flatten(bank.parameters())}
    got = bank_grads(bank, x, ids, w, g, chunk=4)
    plain_grads(bank, x, ids, w, g)
    for k, v in tree_flatten(bank.parameters()):
        assert mx.array_equal(v, before[k]), k

    def probe():
        return (g * (bank(x, ids) * w[..., None]).sum(axis=-2)).sum().item()

    # a small step against the gradient lowers the probed scalar (first-order check)
    base = probe()
    for key, v in got.items():
        mod = getattr(bank, key.split(".")[0])
        mod[key.split(".")[1]] = mod[key.split(".")[1]] - 1e-4 * v
    assert probe() < base


def test_mxfp4_bank_is_refused():
    bank = make_bank(4, 32, mode="mxfp4")
    x, ids, w, g = make_routes((40,))
    for fn in (bank_grads, plain_grads):
        with pytest.raises(ValueError, match="mxfp4.*no gradient.*scales"):
            fn(bank, x, ids, w, g)


def test_unquantized_and_bad_inputs_are_refused():
    x, ids, w, g = make_routes((40,))
    with pytest.raises(TypeError, match="gate_proj.*QuantizedSwitchLinear"):
        bank_grads(SwitchGLU(D, H, E), x, ids, w, g)
    bank = make_bank(2, 32)
    with pytest.raises(ValueError, match="leading dims"):
        bank_grads(bank, x[:-1], ids, w, g)
    with pytest.raises(ValueError, match="outside"):
        bank_grads(bank, x, ids + E, w, g)
    with pytest.raises(ValueError, match="chunk"):
        bank_grads(bank, x, ids, w, g, chunk=0)


def test_unrouted_chunks_compute_nothing(monkeypatch):
    """Only experts with a nonzero-weight route get a backward (zero-weight routes belong
    to another bank); the rest are zeros without a graph."""
    import k3dist.pipeline.expert_grad as eg

    calls = []
    real = eg._chunk_grad

    def counted(bank, e0, e1, x, idx, w, g):
        calls.append((e0, e1, idx.size))
        return real(bank, e0, e1, x, idx, w, g)

    monkeypatch.setattr(eg, "_chunk_grad", counted)
    bank = make_bank(2, 32)
    x, ids, w, g = make_routes((40,))
    eg.bank_grads(bank, x, ids, w, g, chunk=1)
    pairs = zip(ids.reshape(-1).tolist(), w.reshape(-1).tolist(), strict=True)
    routed = {int(e) for e, v in pairs if v != 0}
    assert sorted(e0 for e0, _, _ in calls) == sorted(routed)
    assert not routed & {*UNROUTED, ZERO_ONLY}
    assert sum(n for *_, n in calls) == int((w != 0).sum().item())
