"""MXFP4: the compressed-tensors -> MLX repack is a pure view, proven bitwise against MLX."""

from __future__ import annotations

from k3dist.format.mxfp4 import E2M1_VALUES, GROUP_SIZE, decode, encode, from_mlx, to_mlx

import mlx.core as mx
import numpy as np
import pytest

FINITE_SCALES = np.arange(255, dtype=np.uint8)  # E8M0 0..254; 255 is NaN


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _dequantize_mlx(packed, scales, dtype: mx.Dtype) -> mx.array:
    """MLX's own mxfp4 kernel on the repacked bytes (mxfp4 has no biases)."""
    weight, scales = to_mlx(packed, scales)
    return mx.dequantize(weight, scales, mode="mxfp4", group_size=GROUP_SIZE, bits=4, dtype=dtype)


def _mlx_f32(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return np.array(_dequantize_mlx(packed, scales, mx.float32))


def _every_byte_at_every_scale(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """[255, 256] bytes / [255, 16] scales: each scale 0..254 meets all 256 code pairs."""
    blocks = np.stack([rng.permutation(256).reshape(16, 16) for _ in FINITE_SCALES])
    block_scales = np.repeat(FINITE_SCALES, 16)
    order = rng.permutation(len(block_scales))  # mix scales along rows and groups
    packed = blocks.reshape(-1, 16)[order].reshape(255, 256).astype(np.uint8)
    scales = block_scales[order].reshape(255, 16).astype(np.uint8)
    return packed, scales


def _random_codes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 16, size=shape, dtype=np.uint8)


def _pack(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def test_constants_and_shapes():
    assert E2M1_VALUES.dtype == np.float32 and GROUP_SIZE == 32
    assert list(E2M1_VALUES[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert np.array_equal(E2M1_VALUES[8:], -E2M1_VALUES[:8])
    assert np.signbit(E2M1_VALUES[8]) and not np.signbit(E2M1_VALUES[0])


def test_decode_nibble_order_and_value():
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 0x72  # element 0 = code 2 (1.0), element 1 = code 7 (6.0)
    packed[0, 1] = 0x9F  # element 2 = code 15 (-6.0), element 3 = code 9 (-0.5)
    out = decode(packed, np.array([[128]], np.uint8))  # x 2
    assert out.dtype == np.float32 and out.shape == (1, 32)
    assert list(out[0, :4]) == [2.0, 12.0, -12.0, -1.0]
    assert not out[0, 4:].any()


def test_decode_validation_messages():
    p, s = np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.uint8)
    with pytest.raises(ValueError, match=r"uint8.*packed \(4, 16\) int8.*scales \(4, 1\)"):
        decode(p.astype(np.int8), s)
    with pytest.raises(ValueError, match=r"cols//32.*packed \(4, 16\) uint8, scales \(4, 2\)"):
        decode(p, np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match="leading dims"):
        decode(p, np.zeros((3, 1), np.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        decode(np.zeros((4, 8), np.uint8), np.zeros((4, 0), np.uint8))


def test_mlx_dequantize_is_bitwise_the_reference_for_every_finite_scale():
    rng = np.random.default_rng(0)
    packed, scales = _every_byte_at_every_scale(rng)
    assert set(np.unique(scales)) == set(range(255))
    assert set(np.unique(packed)) == set(range(256))
    ref, got = decode(packed, scales), _mlx_f32(packed, scales)
    assert got.dtype == np.float32 and got.shape == (255, 512)
    # Bitwise, so -0.0 vs +0.0 and subnormals count; no NaN can occur for scales <= 254.
    assert not np.isnan(ref).any()
    assert np.array_equal(_bits(got), _bits(ref))
    # MLX does not flush E8M0 0 (= 2**-127, a float32 subnormal) or its products.
    tiny = got[np.repeat(scales == 0, GROUP_SIZE, axis=1)]
    assert set(np.abs(tiny[tiny != 0]).tolist()) == {
        v * 2.0**-127 for v in (0.5, 1, 1.5, 2, 3, 4, 6)
    }
    # Overflow to inf happens only where float32 truly overflows: s >= 253.
    inf_rows_scales = np.repeat(scales, GROUP_SIZE, axis=1)[np.isinf(got)]
    assert inf_rows_scales.min() == 253
    # bfloat16 has float32's exponent range and every value has <= 2 mantissa bits: exact too.
    bf16 = _dequantize_mlx(packed, scales, mx.bfloat16)
    assert np.array_equal(_bits(np.array(bf16.astype(mx.float32))), _bits(ref))


def test_mlx_reads_scale_255_as_inf_reference_says_nan():
    codes = np.tile(np.arange(16, dtype=np.uint8), 2)[None]
    packed, scales = _pack(codes), np.array([[255]], np.uint8)
    assert np.isnan(decode(packed, scales)).all()  # OCP: E8M0 0xFF is NaN
    got = _mlx_f32(packed, scales)[0]
    vals = E2M1_VALUES[codes[0]]
    zero = vals == 0
    assert np.isnan(got[zero]).all()  # 0 * inf
    assert np.array_equal(got[~zero], np.copysign(np.inf, vals[~zero]))


def test_repack_is_byte_identity():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(3, 64, 128), dtype=np.uint8)  # experts, rows, cols//2
    scales = rng.integers(0, 255, size=(3, 64, 8), dtype=np.uint8)
    w, s = to_mlx(packed, scales)
    assert w.dtype == mx.uint32 and w.shape == (3, 64, 256 // 8)
    assert s.dtype == mx.uint8 and np.array_equal(np.array(s), scales)
    # little-endian uint32 of the same bytes
    assert np.array_equal(np.array(w), packed.view("<u4"))
    p2, s2 = from_mlx(w, s)
    assert p2.dtype == mx.uint8 and np.array_equal(np.array(p2), packed)
    assert np.array_equal(np.array(s2), scales)
    # mx inputs are accepted too, and the round trip is also exact from that side.
    w3, _ = to_mlx(mx.array(packed), mx.array(scales))
    assert np.array_equal(np.array(w3), np.array(w))
    with pytest.raises(ValueError, match="uint32"):
        from_mlx(mx.array(packed), s)
    with pytest.raises(ValueError, match="cols//32"):
        to_mlx(packed, scales[..., :4])


def test_quantized_matmul_uses_the_same_decoding():
    rng = np.random.default_rng(2)
    rows, cols = 64, 512
    packed = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(120, 135, size=(rows, cols // GROUP_SIZE), dtype=np.uint8)
    x = rng.standard_normal((8, cols)).astype(np.float32)
    w, s = to_mlx(packed, scales)
    y = mx.quantized_matmul(
        mx.array(x), w, s, transpose=True, group_size=GROUP_SIZE, bits=4, mode="mxfp4"
    )
    ref = x.astype(np.float64) @ decode(packed, scales).astype(np.float64).T
    assert np.allclose(np.array(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # A wrong nibble order would be caught: swapping nibbles changes the product.
    swapped = ((packed >> 4) | (packed << 4)).astype(np.uint8)
    ref_swapped = x @ decode(swapped, scales).T
    assert not np.allclose(np.array(y), ref_swapped, rtol=1e-3)


def test_encode_scale_rule_nearest_rounding_and_error():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 1024)).astype(np.float32)
    w *= np.exp2(rng.integers(-20, 20, size=(64, 32)).repeat(32, axis=1)).astype(np.float32)
    w[0, :32] = 0.0  # all-zero group -> scale 0, all +0 codes
    packed, scales = encode(w)
    assert packed.shape == (64, 512) and packed.dtype == np.uint8
    assert scales.shape == (64, 32) and scales.dtype == np.uint8
    assert scales[0, 0] == 0 and not packed[0, :16].any()
    amax = np.abs(w.reshape(64, 32, 32)).max(-1)
    nz = amax > 0
    expect = np.floor(np.log2(amax[nz].astype(np.float64))).astype(int) - 2 + 127
    assert np.array_equal(scales[nz].astype(int), expect)
    # Every element maps to a nearest E2M1 value of w / 2**e (nearest to |x| > 6 is 6).
    step = np.exp2(scales.astype(np.float64) - 127)[..., None]
    x = (w.reshape(64, 32, 32) / step).ravel()
    q = (decode(packed, scales).reshape(64, 32, 32) / step).ravel()
    assert np.array_equal(np.abs(x - q), np.abs(x[:, None] - E2M1_VALUES[None, :]).min(1))
    assert np.array_equal(np.signbit(q), np.signbit(x))
    rel = np.linalg.norm(decode(packed, scales) - w) / np.linalg.norm(w)
    assert 0.05 < rel < 0.13  # OCP MXFP4 on Gaussian groups: ~0.115


def test_encode_ties_saturation_and_signed_zero():
    # 4.0 in the group fixes e = floor(log2 4) - 2 = 0, so values below are the scaled ones.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = np.array([4.0, *ties, *[-t for t in ties], 7.9, -7.9, -0.0, -0.2, 0.2, 1e-30])
    w = np.zeros((1, 32), np.float32)
    w[0, : len(row)] = row
    packed, scales = encode(w)
    assert scales[0, 0] == 127
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(-1)[: len(row)]
    tie_codes = [0, 2, 2, 4, 4, 6, 6]  # half-to-even code
    assert list(codes) == [6, *tie_codes, *[c | 8 for c in tie_codes], 7, 15, 8, 8, 0, 0]
    with pytest.raises(ValueError, match="finite"):
        encode(np.full((1, 32), np.inf, np.float32))
    with pytest.raises(ValueError, match="divisible by 32"):
        encode(np.zeros((2, 40), np.float32))
    # E8M0 clamp at the bottom: tiny groups use scale 0 and keep their codes.
    p, s = encode(np.full((1, 32), 2.0**-130, np.float32))
    assert s[0, 0] == 0 and not p.any()  # 2**-130 / 2**-127 = 0.125 -> 0
    p, s = encode(np.full((1, 32), 2.0**-128, np.float32))
    assert s[0, 0] == 0 and np.all(p == 0x11)  # 0.5 -> code 1


def test_encode_accepts_mlx_arrays():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    for a, b in zip(encode(mx.array(w)), encode(w), strict=True):
        assert np.array_equal(a, b)


def test_reencode_canonical_groups_reproduces_bytes():
    rng = np.random.default_rng(5)
    rows, groups = 128, 16
    codes = _random_codes(rng, (rows, groups, GROUP_SIZE))
    # Canonical: the group's largest |code| is 4 or 6 (codes 6, 7 and their negatives).
    pos = rng.integers(0, GROUP_SIZE, size=(rows, groups))
    top = rng.choice(np.array([6, 7, 14, 15], np.uint8), size=(rows, groups))
    np.put_along_axis(codes, pos[..., None], top[..., None], axis=-1)
    packed = _pack(codes.reshape(rows, -1))
    scales = rng.integers(0, 253, size=(rows, groups), dtype=np.uint8)  # all finite
    scales[0, :3] = [0, 1, 252]
    p2, s2 = encode(decode(packed, scales))
    assert np.array_equal(s2, scales)
    assert np.array_equal(p2, packed)


def test_reencode_any_group_reproduces_values_and_bytes_iff_canonical():
    rng = np.random.default_rng(6)
    rows, groups = 256, 16
    codes = _random_codes(rng, (rows, groups, GROUP_SIZE))
    # Cap each group's largest magnitude code at a random 0..7 so all cases occur.
    cap = rng.integers(0, 8, size=(rows, groups, 1), dtype=np.uint8)
    codes = np.minimum(codes & 7, cap) | (codes & 8)
    packed = _pack(codes.reshape(rows, -1))
    scales = rng.integers(0, 253, size=(rows, groups), dtype=np.uint8)
    scales[:8] = rng.integers(0, 3, size=(8, groups), dtype=np.uint8)  # exercise the clamp
    vals = decode(packed, scales)
    p2, s2 = encode(vals)
    assert np.array_equal(_bits(decode(p2, s2)), _bits(vals))  # values always, incl. -0.0
    top = (codes & 7).max(-1)
    canonical = (top >= 6) | (scales == 0)
    same_bytes = (p2 == packed).reshape(rows, groups, GROUP_SIZE // 2).all(-1)
    same = (s2 == scales) & same_bytes
    assert canonical.any() and (~canonical).any()
    assert np.array_equal(same, canonical)
