"""A Moonshot-format K3 checkpoint read through its headers: config, index, tensor
lookup checked against the layout its config implies, and the ``A_log`` padding check.

Nothing here reads tensor data except the bytes a check needs (the ``A_log`` tails); a
converter asks ``Source.info`` for a tensor and streams its byte range. The audit of a
whole checkpoint is ``k3dist.pipeline.audit``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from k3dist.format import layout
from k3dist.format.folder import CONFIG_NAME, INDEX_NAME, SINGLE_FILE, load_config, read_json
from k3dist.format.sfile import CheckpointError, Header, TensorInfo, read_bytes, read_header

import numpy as np

SUPPORTED_QUANT = "mxfp4-pack-quantized"


def quantization_format(config: dict) -> dict:
    """The source's expert quantization, checked: only Moonshot's release format
    (compressed-tensors mxfp4-pack-quantized, group 32) converts bit-exactly."""
    qc = config.get("quantization_config") or layout.text_config(config).get("quantization_config")
    if qc is None:
        raise CheckpointError(
            "config.json has no quantization_config; k3dist converts "
            "Moonshot's release (compressed-tensors mxfp4-pack-quantized)"
        )
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors" or fmt != SUPPORTED_QUANT:
        raise CheckpointError(
            f"config.json: unknown quantization format quant_method={method!r} "
            f"format={fmt!r}; k3dist converts compressed-tensors {SUPPORTED_QUANT!r} only"
        )
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if (
            w.get("num_bits", 4) != 4
            or w.get("group_size", 32) != 32
            or w.get("type", "float") != "float"
        ):
            raise CheckpointError(
                f"config.json: quantization group {name!r} is {w!r}; "
                "MXFP4 needs num_bits 4, group_size 32, type float"
            )
    return qc


class Source:
    """A checkpoint folder: config, index and lazily read shard headers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a folder")
        self.config_path = self.path / CONFIG_NAME
        self.config = load_config(self.path)
        self.text_config = layout.text_config(self.config)
        self.index_path = self.path / INDEX_NAME
        if self.index_path.exists():
            self._read_index(self.index_path)
        else:
            single = self.path / SINGLE_FILE
            if not single.exists():
                raise CheckpointError(
                    f"{self.path}: neither {INDEX_NAME} nor "
                    f"{SINGLE_FILE}; is this a checkpoint folder?"
                )
            h = read_header(single)
            self.weight_map = {n: single.name for n in h.tensors}
            self.index_metadata = {}
            self.index_sha256 = hashlib.sha256(
                json.dumps(sorted(self.weight_map)).encode()
            ).hexdigest()
        self._headers: dict[str, Header] = {}

    def _read_index(self, path: Path) -> None:
        """The index at ``path`` (maybe ``.gz``); ``index_sha256`` is the digest of its
        uncompressed bytes."""
        data, raw = read_json(path, "index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path}: malformed index (no weight_map object)")
        self.index_path = path
        self.weight_map: dict[str, str] = weight_map
        self.index_metadata = data.get("metadata") or {}
        self.index_sha256 = hashlib.sha256(raw).hexdigest()

    @property
    def shard_files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def header(self, fname: str) -> Header:
        if fname not in self._headers:
            self._headers[fname] = read_header(self.path / fname)
        return self._headers[fname]

    def info(self, name: str, spec: layout.TensorSpec | None = None) -> TensorInfo:
        """Where tensor ``name`` lives, checked against the index, header and spec."""
        fname = self.weight_map.get(name)
        if fname is None:
            raise CheckpointError(
                f"{self.index_path}: tensor {name!r} is missing from the "
                "index; the checkpoint is incomplete or another model's"
            )
        t = self.header(fname).tensors.get(name)
        if t is None:
            raise CheckpointError(
                f"{self.path / fname}: the index places tensor {name!r} "
                "here but the shard does not hold it; re-download the shard "
                "or the index"
            )
        if spec is not None:
            check_spec(t, spec)
        return t

    @classmethod
    def from_files(
        cls, config: str | Path, index: str | Path, root: str | Path | None = None
    ) -> Source:
        """A checkpoint whose config and index are named explicitly; either may be
        gzipped (``.gz``), as the real K3's ``kimi-k3-config.json`` and
        ``kimi-k3-model.safetensors.index.json.gz`` shipped in ``k3dist/data``. Shard
        files are looked for in ``root``, by default the index's folder;
        ``index_sha256`` is the digest of the uncompressed index."""
        self = cls.__new__(cls)
        index = Path(index)
        self.path = Path(root) if root is not None else index.parent
        self.config_path = Path(config)
        self.config, _ = read_json(self.config_path, "config")
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config}: not a JSON object; expected a config.json")
        self.text_config = layout.text_config(self.config)
        self._read_index(index)
        self._headers = {}
        return self


def check_spec(t: TensorInfo, spec: layout.TensorSpec) -> None:
    if t.dtype != spec.dtype or (spec.shape is not None and t.shape != spec.shape):
        raise CheckpointError(
            f"{t.path}: tensor {t.name!r} is {t.dtype}{list(t.shape)} but config.json "
            f"implies {spec.dtype}{list(spec.shape or ())}; the shard and config.json "
            "come from different models"
        )


def check_a_log_tail(t: TensorInfo, num_heads: int) -> None:
    """K3 stores A_log per head padded with zeros to head_dim. Read only the tail
    and refuse a non-zero one: it would mean the real heads are not the first ones."""
    if t.dtype != "F32" or len(t.shape) != 1:
        raise CheckpointError(
            f"{t.path}: {t.name!r} is {t.dtype}{list(t.shape)}, expected a 1-D F32 per-head vector"
        )
    if t.shape[0] < num_heads:
        raise CheckpointError(f"{t.path}: {t.name!r} has {t.shape[0]} values for {num_heads} heads")
    tail = np.frombuffer(read_bytes(t, 4 * num_heads), dtype=np.float32)
    if np.any(tail != 0):
        layer = layout.layer_of(t.name)
        bad = int(np.flatnonzero(tail != 0)[0]) + num_heads
        raise CheckpointError(
            f"{t.path}: layer {layer} {t.name!r} has a non-zero padding tail (value "
            f"{float(tail[bad - num_heads])!r} at index {bad}, num_heads={num_heads}); "
            "K3 pads A_log per head with zeros, so this checkpoint is corrupted or "
            "laid out differently; refusing to truncate it"
        )


def open_source(
    src: str | Path | None = None,
    *,
    config: str | Path | None = None,
    index: str | Path | None = None,
) -> Source:
    """``Source(src)``, or with ``config``/``index`` named explicitly (either may be
    ``.gz``; what is not named defaults to SRC/config.json and SRC's index)."""
    if config is None and index is None:
        if src is None:
            raise CheckpointError("no checkpoint given: pass a folder, or a config and an index")
        return Source(src)
    root = Path(src) if src is not None else None
    if root is None and (config is None or index is None):
        raise CheckpointError("without a checkpoint folder, pass both a config and an index")
    return Source.from_files(
        config if config is not None else root / CONFIG_NAME,
        index if index is not None else root / INDEX_NAME,
        root,
    )
