"""Storage formats of a weight matrix and their exact bytes: what MLX 0.32.4 stores in
every quantization mode — affine 1–8 bits at group 32/64/128 (packed uint32 codes + one
scale and one bias per group, in the model dtype: bf16 on disk), ``mxfp4`` (4-bit, group
32, one uint8 E8M0 scale), ``mxfp8`` (8-bit, group 32, uint8 scale), ``nvfp4`` (4-bit,
group 16, uint8 E4M3 scale). ``tests/pipeline/test_plan.py`` checks each against ``mx.quantize``
output sizes. The planner, the converter and the grader all count and name formats here.
"""

from __future__ import annotations

from dataclasses import dataclass

AFFINE_BITS = (1, 2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# the formats whose bits and group size are fixed by their mode
FIXED = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}


@dataclass(frozen=True)
class QFormat:
    """How one weight matrix is stored. ``mode`` "source" keeps the source dtype."""

    mode: str  # "affine" | "mxfp4" | "mxfp8" | "nvfp4" | "source"
    bits: int = 16
    group_size: int = 0
    scale_bytes: int = 2  # affine: scale and bias in the model dtype (bf16 on disk)

    def __post_init__(self):
        if self.mode == "affine":
            if self.bits not in AFFINE_BITS or self.group_size not in GROUP_SIZES:
                raise ValueError(
                    f"affine needs bits in {AFFINE_BITS} and group size in "
                    f"{GROUP_SIZES}, not {self.bits}-bit g{self.group_size}"
                )
        elif self.mode in FIXED:
            if (self.bits, self.group_size) != FIXED[self.mode]:
                raise ValueError(
                    f"{self.mode} is {FIXED[self.mode][0]}-bit group "
                    f"{FIXED[self.mode][1]}, not {self.bits}-bit "
                    f"g{self.group_size}"
                )
        elif self.mode != "source":
            raise ValueError(
                f"unknown format mode {self.mode!r}; one of affine, mxfp4, mxfp8, nvfp4, source"
            )

    @property
    def name(self) -> str:
        if self.mode == "affine":
            return f"{self.bits}bit-g{self.group_size}"
        return self.mode

    @property
    def quantized(self) -> bool:
        return self.mode != "source"

    def fits(self, cols: int) -> bool:
        """Whether a matrix with ``cols`` input columns can be stored this way."""
        if not self.quantized:
            return True
        return cols % self.group_size == 0 and (cols * self.bits) % 32 == 0

    def nbytes(self, rows: int, cols: int) -> int:
        """Exact bytes of a ``[rows, cols]`` matrix (``mx.quantize``'s outputs)."""
        if not self.fits(cols):
            raise ValueError(
                f"{self.name} cannot store {cols} columns (group "
                f"{self.group_size}, {self.bits}-bit words)"
            )
        codes = rows * cols * self.bits // 8
        groups = rows * cols // self.group_size
        per_group = 2 * self.scale_bytes if self.mode == "affine" else 1
        return codes + groups * per_group

    def for_cols(self, cols: int) -> QFormat | None:
        """This format for a matrix with ``cols`` columns: the same bits at the largest
        group size up to this one that divides ``cols`` (``6bit-g64`` on 96 columns is
        ``6bit-g32``); ``None`` when no group size fits (the matrix keeps its dtype).
        The converter and :meth:`Accounting.class_bytes` both apply it."""
        if self.fits(cols) or not self.quantized:
            return self
        if self.mode != "affine":
            return None
        for g in sorted((g for g in GROUP_SIZES if g < self.group_size), reverse=True):
            f = QFormat("affine", self.bits, g, self.scale_bytes)
            if f.fits(cols):
                return f
        return None

    @property
    def bpw(self) -> float:
        if not self.quantized:
            return 16.0
        per_group = 2 * self.scale_bytes if self.mode == "affine" else 1
        return self.bits + 8 * per_group / self.group_size

    def qconfig(self) -> dict:
        """The per-path block mlx-lm's loader reads from config.json ``quantization``."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    @classmethod
    def parse(cls, s: str) -> QFormat:
        """``2bit-g64`` | ``mxfp4`` | ``mxfp8`` | ``nvfp4`` | ``bf16``/``source``."""
        s = s.strip().lower()
        if s in ("bf16", "source", "16"):
            return cls("source")
        if s in FIXED:
            return cls(s, *FIXED[s])
        try:
            b, g = s.split("bit-g")
            return cls("affine", int(b), int(g))
        except ValueError:
            raise ValueError(
                f"format {s!r}: write <bits>bit-g<group> (e.g. 2bit-g64), "
                "mxfp4, mxfp8, nvfp4 or bf16"
            ) from None


MXFP4 = QFormat.parse("mxfp4")
SOURCE = QFormat("source")


def all_formats() -> list[QFormat]:
    """Every storage format MLX 0.32.4 offers for a weight matrix."""
    out = [QFormat("affine", b, g) for b in AFFINE_BITS for g in GROUP_SIZES]
    return out + [QFormat(m, *FIXED[m]) for m in FIXED]
