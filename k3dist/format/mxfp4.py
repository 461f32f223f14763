"""MXFP4 weights: compressed-tensors ``mxfp4-pack-quantized`` <-> MLX ``mode="mxfp4"``.

Kimi K3's routed experts ship per weight matrix ``[rows, cols]`` as

* ``weight_packed`` uint8 ``[rows, cols // 2]``: OCP MXFP4 E2M1 codes, two per byte,
  the LOW nibble holding the even (first) element;
* ``weight_scale`` uint8 ``[rows, cols // 32]``: one E8M0 exponent per 32 consecutive
  values along ``cols``, value ``2 ** (s - 127)``.

MLX's mxfp4 (group_size 32, bits 4) stores uint32 ``[rows, cols // 8]`` where element ``j``
of a word sits in bits ``4j .. 4j + 3``, and the same uint8 E8M0 scales. On a little-endian
machine that is exactly the byte layout above, so the repack is a dtype *view*: no
arithmetic, no rounding, nothing to get wrong. ``tests/format/test_mxfp4.py`` proves it bitwise
against MLX's own dequantize and quantized_matmul.

How MLX 0.32.4 reads a scale byte (checked on CPU by the tests; the Metal ``fp8_e8m0``
conversion uses the same bit construction):

* ``0 .. 254``: exactly ``2 ** (s - 127)`` in float32. ``s == 0`` is the float32
  subnormal ``2 ** -127`` (bits ``0x400000``); it is *not* flushed, and products such as
  ``0.5 * 2 ** -127`` stay exact subnormals.
* ``255``: MLX builds ``0x7F800000`` = +inf, so it yields ``±inf`` for nonzero codes and
  NaN for ``±0`` codes. The OCP spec says E8M0 ``0xFF`` is NaN; :func:`decode` follows the
  spec (all NaN). Checkpoints never contain 255.
* Float32 overflow is genuine, not a format limit: ``6 * 2 ** 126`` (``s = 253``) is
  already inf, in MLX and in :func:`decode` alike. All codes decode finite for ``s <= 252``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

GROUP_SIZE = 32

# OCP E2M1 code -> value; bit 3 is the sign, so code 8 is -0.0.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_EMAX = 2  # largest E2M1 value 6 = 1.5 * 2**2

# Round-to-nearest boundaries between consecutive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
# A tie goes to the even code (IEEE round-half-even on the mantissa bit), so the
# comparison is ">" where the lower neighbour is even and ">=" where the upper one is.
_MIDPOINTS_UP_IF_GREATER = (0.25, 1.25, 2.5, 5.0)  # lower code 0, 2, 4, 6 is even
_MIDPOINTS_UP_IF_EQUAL = (0.75, 1.75, 3.5)  # upper code 2, 4, 6 is even


def _check_cols(cols: int) -> None:
    if cols % GROUP_SIZE != 0:
        raise ValueError(f"MXFP4 needs cols divisible by {GROUP_SIZE}, got cols={cols}")


def _is_u8(dtype: np.dtype | mx.Dtype) -> bool:
    return dtype == mx.uint8 if isinstance(dtype, mx.Dtype) else np.dtype(dtype) == np.uint8


def _check_pair(packed_shape_: tuple, packed_dtype, scales_shape_: tuple, scales_dtype) -> None:
    """Raise on anything that is not (uint8 [..., cols//2], uint8 [..., cols//32])."""
    packed_desc = f"packed {tuple(packed_shape_)} {packed_dtype}"
    shapes = f"{packed_desc}, scales {tuple(scales_shape_)} {scales_dtype}"
    if not (_is_u8(packed_dtype) and _is_u8(scales_dtype)):
        raise ValueError(f"MXFP4 packed and scales must both be uint8; got {shapes}")
    if len(packed_shape_) < 1 or len(packed_shape_) != len(scales_shape_):
        raise ValueError(f"MXFP4 packed and scales must have the same ndim >= 1; got {shapes}")
    if tuple(packed_shape_[:-1]) != tuple(scales_shape_[:-1]):
        raise ValueError(f"MXFP4 packed and scales leading dims differ; got {shapes}")
    expected = packed_shape_[-1] * 2 // GROUP_SIZE
    if packed_shape_[-1] % (GROUP_SIZE // 2) != 0 or scales_shape_[-1] != expected:
        raise ValueError(
            f"MXFP4 expects packed [..., cols//2] and scales [..., cols//{GROUP_SIZE}] with "
            f"cols % {GROUP_SIZE} == 0 (packed last dim a multiple of {GROUP_SIZE // 2}, "
            f"scales last dim = packed last dim * 2 / {GROUP_SIZE}); got {shapes}"
        )


def decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Reference float32 dequantizer in plain numpy, the ground truth for MLX's kernels.

    Exact: every result is a code value (<= 2 mantissa bits) times a power of two, which
    float32 represents exactly down to ``0.5 * 2**-127`` (a subnormal). Scale 255 -> NaN.
    """
    packed = np.asarray(packed)
    scales = np.asarray(scales)
    _check_pair(packed.shape, packed.dtype, scales.shape, scales.dtype)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1)  # low nibble = even element
    values = E2M1_VALUES[codes].reshape(*packed.shape[:-1], -1, GROUP_SIZE)
    exps = np.minimum(scales, E8M0_NAN - 1).astype(np.int32) - E8M0_BIAS
    scale = np.ldexp(np.float32(1.0), exps)
    scale = np.where(scales == E8M0_NAN, np.float32(np.nan), scale).astype(np.float32)
    with np.errstate(over="ignore"):  # s >= 253 overflows float32 to inf, as MLX does
        out = values * scale[..., None]
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _round_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code of each already-scaled value; ties to even code, saturating at 6."""
    mag = np.abs(x)
    code = np.zeros(x.shape, dtype=np.uint8)
    for m in _MIDPOINTS_UP_IF_GREATER:
        code += mag > m
    for m in _MIDPOINTS_UP_IF_EQUAL:
        code += mag >= m
    return code | (np.signbit(x).astype(np.uint8) << 3)  # keeps -0.0 and tiny negatives as -0


def encode(w: np.ndarray | mx.array) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float weights ``[..., cols]`` to OCP MXFP4 ``(packed u8, scales u8)``.

    Per group of 32 the shared exponent is ``floor(log2(max|w|)) - 2`` (OCP MX v1.0),
    clamped to E8M0's ``[-127, 127]``; an all-zero group gets the clamped minimum, scale 0.
    Each ``w / 2**e`` is then rounded to nearest E2M1 (ties to even code, i.e. 0.25 -> 0,
    0.75 -> 1, 2.5 -> 2, 5 -> 4) and saturated at +-6; the sign bit is kept, so negative
    values that round to zero encode as -0 (code 8).

    ``encode(decode(p, s))`` always reproduces the decoded *values*. It reproduces the
    *bytes* exactly iff every group is canonical: its largest |code| is 4 or 6, or s == 0
    with a nonzero code (clamped), or it is all zero codes with s == 0. Otherwise the
    exponent drops and the codes scale up by the same power of two (e.g. max code 2 at
    s becomes max code 4 at s - 1). The MLX ``mx.quantize(mode="mxfp4")`` rounds the
    scale *up* instead, so its bytes differ from this OCP encoder; both decode the same way.
    """
    if isinstance(w, mx.array):
        w = np.array(w.astype(mx.float32))
    w = np.asarray(w)
    if w.ndim < 1:
        raise ValueError(f"MXFP4 encode needs at least 1 dim [..., cols], got shape {w.shape}")
    _check_cols(w.shape[-1])
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"MXFP4 encode needs float weights, got {w.dtype}")
    w64 = w.astype(np.float64).reshape(*w.shape[:-1], -1, GROUP_SIZE)
    if not np.isfinite(w64).all():
        raise ValueError("MXFP4 encode needs finite weights (E8M0 NaN is not produced)")
    amax = np.abs(w64).max(axis=-1)
    _, exp = np.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1) -> floor(log2) = exp - 1
    e = np.where(amax > 0, exp - 1 - E2M1_EMAX, -E8M0_BIAS)
    e = np.clip(e, -E8M0_BIAS, E8M0_BIAS)
    x = np.ldexp(w64, -e[..., None])  # exact: power-of-two scaling in float64
    codes = _round_e2m1(x).reshape(*w.shape[:-1], -1, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.astype(np.uint8), (e + E8M0_BIAS).astype(np.uint8)


def _as_mx_u8(a: np.ndarray | mx.array) -> mx.array:
    return a if isinstance(a, mx.array) else mx.array(np.ascontiguousarray(a))


def to_mlx(
    packed: np.ndarray | mx.array, scales: np.ndarray | mx.array
) -> tuple[mx.array, mx.array]:
    """Compressed-tensors bytes -> MLX mxfp4 ``(uint32 [..., cols//8], uint8 scales)``.

    Zero arithmetic: the weight is the same bytes viewed as little-endian uint32, and the
    E8M0 scales are passed through unchanged.
    """
    packed, scales = _as_mx_u8(packed), _as_mx_u8(scales)
    _check_pair(packed.shape, packed.dtype, scales.shape, scales.dtype)
    return packed.view(mx.uint32), scales


def from_mlx(weight: mx.array, scales: mx.array) -> tuple[mx.array, mx.array]:
    """MLX mxfp4 ``(uint32, uint8)`` -> compressed-tensors uint8 bytes; inverse of to_mlx."""
    weight, scales = _as_mx_u8(weight), _as_mx_u8(scales)
    if weight.dtype != mx.uint32:
        raise ValueError(f"MLX mxfp4 weight must be uint32, got {weight.dtype} {weight.shape}")
    packed = weight.view(mx.uint8)
    _check_pair(packed.shape, packed.dtype, scales.shape, scales.dtype)
    return packed, scales
