"""The two JSON files every checkpoint or build folder holds beside its safetensors
files: ``config.json`` and the index (``model.safetensors.index.json``, the tensor ->
file map; a one-file folder has ``model.safetensors`` and no index).

Moonshot's source, a k3dist build, a rank folder and a published mlx-lm build all read
them through here, so a missing or broken file is named the same way everywhere.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from k3dist import PACKAGE_DATA
from k3dist.format.sfile import CheckpointError, read_header

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"  # a folder without an index holds exactly this file

# The real Kimi K3's config.json and index, shipped (no weights) for plans and rehearsals.
REAL_K3_CONFIG = PACKAGE_DATA / "kimi-k3-config.json"
REAL_K3_INDEX = REAL_K3_CONFIG.with_name("kimi-k3-model.safetensors.index.json.gz")


def read_json(path: str | Path, what: str) -> tuple[object, bytes]:
    """A JSON file, gunzipped first when its name ends in ``.gz``: (value, raw bytes)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: missing; pass the checkpoint's {what} file")
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        return json.loads(raw), raw
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid {what} JSON file ({e})") from None


def load_config(folder: str | Path) -> dict:
    """``config.json`` as written. Not ``mlx_lm.utils.load_config``: that merges
    generation_config.json's ``eos_token_id`` in (a conversion would then write another
    config.json) and does not name the file when it is missing or broken."""
    path = Path(folder) / CONFIG_NAME
    if not path.exists():
        raise CheckpointError(f"{path}: missing; a K3 checkpoint or build folder has {CONFIG_NAME}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def read_index(path: str | Path) -> dict:
    """An index file (plain or ``.gz``, as ``k3dist/data`` ships the real K3's)."""
    data, _ = read_json(path, "index")
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise CheckpointError(f"{path}: malformed index (no weight_map object)")
    return data


def weight_map(folder: str | Path) -> dict[str, str]:
    """Tensor name -> file of a folder: its index, or the one ``model.safetensors``'s
    header when it has no index."""
    folder = Path(folder)
    if (folder / INDEX_NAME).exists():
        return read_index(folder / INDEX_NAME)["weight_map"]
    single = folder / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(
            f"{folder}: neither {INDEX_NAME} nor {SINGLE_FILE}; is this "
            "a checkpoint or build folder?"
        )
    return dict.fromkeys(read_header(single).tensors, SINGLE_FILE)
