"""Images in K3 chat requests: mlx-vlm 0.7.10's ``kimi_k3`` tower, projector and
image processor in front of the expert-parallel text tower.

mlx-vlm is an optional extra (``pip install 'k3dist[vision]'``); it is imported only
when a deployment turns vision on, and a request without images runs no tower.

The image path, as mlx-vlm's own ``kimi_k3.Model`` runs it:

- the K3 chat template renders ``<|kimi_image_placeholder|>`` per image; the processor
  replaces it with ``<|media_begin|>image WxH<|media_content|>`` + one ``<|media_pad|>``
  per merged patch + ``<|media_end|>`` (one pad per image in a prompt that already
  has pads expands the same way), so the prompt holds one row per feature;
- MoonViT + the patch-merger projector turn each image into that many feature rows;
- the rows replace the pad rows of the token embeddings before the first layer.

Where the tower runs: rank 0 only. Its features reach every rank through one
``all_sum`` (the other ranks add zeros, so every rank holds rank 0's bits exactly:
ranks that computed the tower themselves could differ in the last bit and drift
apart in lockstep). The real tower + projector are 0.89 GB in BF16 (``tower_bytes``
on the reference config); only rank 0 holds them (``k3dist.pipeline.slicing``
``vision_ranks``). The other ranks still run the processor (CPU, no weights) to
tokenize the same prompt.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path

from k3dist.format.tokens import IMAGE_PLACEHOLDER, MEDIA_PAD

import mlx.core as mx
import mlx.nn as nn
import numpy as np

VISION_FILE = "model-vision.safetensors"
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def require():
    """mlx-vlm's kimi_k3 package, or an error that says how to get it."""
    try:
        from mlx_vlm.models import kimi_k3
    except ImportError as e:
        raise ImportError(
            f"vision needs mlx-vlm 0.7.10: pip install 'k3dist[vision]' ({e})"
        ) from None
    return kimi_k3


@dataclass(frozen=True)
class VisionLimits:
    """What a request's images may be; checked before any rank works."""

    max_images: int = 4
    # decoded pixels per image, checked from the header before decoding (a
    # decompression bomb is a small file with huge dimensions); the deployment's
    # default (k3dist.config.deployment: the tower's measured peak within the headroom)
    max_pixels: int = 1008 * 1008
    # local image paths: only files under this directory; None: refused
    image_dir: str | None = None


class ImageError(ValueError):
    """A request's image that cannot be served (the server answers 400)."""


# ---------------------------------------------------------------------------- request side


def _open_checked(data: bytes, limits: VisionLimits, where: str):
    from PIL import Image

    if not data:
        raise ImageError(f"{where}: the image is empty (zero bytes)")
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as e:  # PIL's own cap, past ours
        raise ImageError(
            f"{where}: the image's dimensions are too large; at most "
            f"{limits.max_pixels:,} pixels (refused before decoding: {e})"
        ) from None
    except Exception as e:
        raise ImageError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    if img.format not in IMAGE_FORMATS:
        raise ImageError(
            f"{where}: image format {img.format} is not supported; send one of "
            f"{', '.join(IMAGE_FORMATS)}"
        )
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"{where}: the image is {w}x{h} pixels (zero-size)")
    if w * h > limits.max_pixels:
        raise ImageError(
            f"{where}: the image is {w}x{h} = {w * h:,} pixels; at most "
            f"{limits.max_pixels:,} (refused before decoding)"
        )
    try:
        img.load()
    except Exception as e:
        raise ImageError(f"{where}: the image data is corrupt ({type(e).__name__}: {e})") from None
    return img


def _data_url_bytes(url: str, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageError(f"{where}: a data URL must be data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: the data URL is not valid base64 ({e})") from None


def _local_bytes(url: str, limits: VisionLimits, where: str) -> bytes:
    if limits.image_dir is None:
        raise ImageError(
            f"{where}: local image paths are off in this deployment; send the "
            "image as a data URL (data:image/png;base64,...)"
        )
    root = Path(limits.image_dir).resolve()
    path = Path(url.removeprefix("file://")).resolve()
    if not path.is_relative_to(root):
        raise ImageError(f"{where}: {url!r} is outside the deployment's image directory")
    if not path.is_file():
        raise ImageError(f"{where}: {url!r} is not a file under the image directory")
    return path.read_bytes()


def image_url(part: dict) -> str | None:
    """The URL of an OpenAI-style image part (mlx-lm's own reading of one)."""
    from mlx_lm import server as mlx_server

    return mlx_server._image_url(part)


def check_image_part(part: dict, limits: VisionLimits, where: str):
    """Validate one image part and normalise it to a data URL in place (every rank
    then reads the same bytes); returns the decoded PIL image."""
    url = image_url(part)
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where}: an image part needs image_url.url (a data URL)")
    if url.startswith(("http://", "https://")):
        raise ImageError(
            f"{where}: remote image URLs are refused (the server does not fetch "
            "for clients); send the image as a data URL "
            "(data:image/png;base64,...)"
        )
    if url.startswith("data:"):
        data = _data_url_bytes(url, where)
    elif "://" in url and not url.startswith("file://"):
        raise ImageError(
            f"{where}: unsupported image URL scheme {url.split(':', 1)[0]!r}; send a data URL"
        )
    else:
        data = _local_bytes(url, limits, where)
    img = _open_checked(data, limits, where)
    if not url.startswith("data:"):
        mime = f"image/{img.format.lower()}"
        part.clear()
        part.update(
            type="image_url",
            image_url={"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"},
        )
    return img


# ---------------------------------------------------------------------------- processor


@dataclass
class Pixels:
    """One image as the tower takes it."""

    patches: mx.array  # [t*h*w, 3, p, p] float32
    grid: tuple[int, int, int]  # (t, h, w) patches
    tokens: int  # merged feature rows = pads in the prompt


class K3Processor:
    """The processor mlx-lm's server calls for chat requests with images:
    ``(text, images) -> (expanded text, pixel values)``. The pixels and the token
    count are mlx-vlm's ``KimiK3ImageProcessor``; the expansion is what mlx-vlm's
    ``KimiK3Processor`` writes (its tokenizer is not ours, so it is not called)."""

    image_token = MEDIA_PAD

    def __init__(self, vision_config: dict):
        kimi = require()
        self.ip = kimi.ImageProcessor(
            patch_size=vision_config["patch_size"],
            merge_kernel_size=list(vision_config["merge_kernel_size"]),
        )
        self.make_image_prompt = kimi.Processor.make_image_prompt.__get__(self)
        mk = self.ip.merge_kernel_size
        self.merge = mk[0] * mk[1]

    def count(self, image) -> int:
        """Feature rows (pads) of one PIL image, as the image processor sizes it."""
        w, h = self.ip.rescale(image).size
        p = self.ip.patch_size
        return (h // p) * (w // p) // self.merge

    def expand(self, text: str, images: list) -> str:
        """One placeholder (or one pad) per image -> the image's full pad block."""
        counts = [self.count(im) for im in images]
        if text.count(MEDIA_PAD):
            if IMAGE_PLACEHOLDER in text or text.count(MEDIA_PAD) != len(images):
                raise ImageError(
                    f"the prompt holds {text.count(MEDIA_PAD)} {MEDIA_PAD} for "
                    f"{len(images)} images; write none (the template adds them)"
                )
            parts = text.split(MEDIA_PAD)
            out = parts[0] + "".join(
                MEDIA_PAD * n + s for n, s in zip(counts, parts[1:], strict=True)
            )
        else:
            parts = text.split(IMAGE_PLACEHOLDER)
            if len(parts) - 1 != len(images):
                raise ImageError(
                    f"the prompt has {len(parts) - 1} image placeholders for {len(images)} images"
                )
            out = parts[0] + "".join(
                self.make_image_prompt(*im.size, n) + s
                for im, n, s in zip(images, counts, parts[1:], strict=True)
            )
        if out.count(MEDIA_PAD) != sum(counts):  # the expanded length, asserted
            raise ImageError(
                f"expanded prompt has {out.count(MEDIA_PAD)} pads; the images take {sum(counts)}"
            )
        return out

    def pixels(self, image) -> Pixels:
        feat = self.ip.preprocess([image])
        t, h, w = (int(v) for v in np.array(feat["grid_thws"])[0])
        return Pixels(feat["pixel_values"], (t, h, w), t * h * w // self.merge)

    def __call__(self, text: str, images: list) -> tuple[str, list[Pixels]]:
        from PIL import Image

        pil = [
            im if isinstance(im, Image.Image) else Image.fromarray(np.asarray(im)) for im in images
        ]
        return self.expand(text, pil), [self.pixels(im) for im in pil]


def prompt_tokens(tokenizer, processor: K3Processor, text: str, images: list) -> list[int]:
    """The prompt ids of a rendered chat with images; the pad count is asserted."""
    ids = tokenizer.encode(processor.expand(text, images), add_special_tokens=False)
    pad = tokenizer.convert_tokens_to_ids(MEDIA_PAD)
    want = sum(processor.count(im) for im in images)
    if ids.count(pad) != want:
        raise ImageError(
            f"the tokenized prompt holds {ids.count(pad)} {MEDIA_PAD} ids; the "
            f"images take {want} (is {MEDIA_PAD} a single token here?)"
        )
    return ids


# ---------------------------------------------------------------------------- tower


def _model_config(config: dict):
    kimi = require()
    return kimi.ModelConfig.from_dict(
        {
            **config,
            "text_config": kimi.TextConfig.from_dict(config["text_config"]),
            "vision_config": kimi.VisionConfig.from_dict(config["vision_config"]),
        }
    )


class VisionTower(nn.Module):
    """MoonViT and the projector of mlx-vlm's kimi_k3, nothing of its text model."""

    def __init__(self, config: dict):
        super().__init__()
        kimi = require()
        from mlx_vlm.models.kimi_k3.kimi_k3 import KimiK3MultiModalProjector

        mc = _model_config(config)
        self.vision_tower = kimi.VisionModel(mc.vision_config)
        self.mm_projector = KimiK3MultiModalProjector(mc)

    def __call__(self, images: list[Pixels]) -> mx.array:
        """[sum of tokens, hidden] features, as mlx-vlm's get_input_embeddings."""
        patches = mx.concatenate([p.patches for p in images])
        dtype = self.mm_projector.post_norm.weight.dtype
        hidden = self.vision_tower(
            patches.transpose(0, 2, 3, 1).astype(dtype), grid_thws=[list(p.grid) for p in images]
        )
        return self.mm_projector(hidden)


def tower_bytes(config: dict) -> int:
    """BF16 bytes of the tower + projector a config implies (reference layout)."""
    from k3dist.format import layout

    return sum(s.nbytes for s in layout.vision_specs(config))


def load_tower(folder: str | Path, config: dict, dtype: mx.Dtype = mx.float32) -> VisionTower:
    """The tower from a build or rank folder's vision file."""
    path = Path(folder) / VISION_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no vision tensors in this folder; vision runs on a "
            "rank whose folder holds them (rank 0: k3dist.pipeline.slicing."
            "vision_ranks), from a build converted with its vision tower"
        )
    tower = VisionTower(config)
    weights = tower.vision_tower.sanitize(mx.load(str(path)))
    tower.load_weights(list(weights.items()), strict=True)
    tower.set_dtype(dtype)
    mx.eval(tower.parameters())
    return tower


# ---------------------------------------------------------------------------- injection


class Vision:
    """The EP model's image side on one rank: the tower where it lives (rank 0),
    the ``all_sum`` that gives every rank its features, the pad id."""

    def __init__(self, tower: VisionTower | None, pad_id: int, group: mx.distributed.Group | None):
        self.tower, self.pad_id = tower, pad_id
        self.group = group if group is not None and group.size() > 1 else None
        if tower is None and self.group is None:
            raise ValueError("a single rank needs the vision tower itself")

    def features(self, images: list[Pixels], hidden: int, dtype: mx.Dtype) -> mx.array:
        n = sum(p.tokens for p in images)
        if self.tower is not None:
            feats = self.tower(images).astype(dtype)
        else:
            feats = mx.zeros((n, hidden), dtype)
        if self.group is not None:
            feats = mx.distributed.all_sum(feats, group=self.group)  # x + 0: rank 0's bits
        return feats

    def inject(self, h: mx.array, inputs: mx.array, images: list[Pixels]) -> mx.array:
        """Token embeddings ``h`` [..., T, H] of ``inputs`` with the pad rows replaced."""
        ids = np.array(inputs).reshape(-1)
        pos = np.flatnonzero(ids == self.pad_id)
        n = sum(p.tokens for p in images)
        if len(pos) != n:
            raise ValueError(
                f"{len(pos)} {MEDIA_PAD} tokens in the prompt for {n} image "
                "features; each image's pad block must be expanded in full"
            )
        feats = self.features(images, h.shape[-1], h.dtype)
        flat = h.reshape(-1, h.shape[-1])
        flat[mx.array(pos)] = feats
        return flat.reshape(h.shape)


# The rank that holds and runs the tower (k3dist.pipeline.slicing.vision_ranks gives
# the vision tensors to this rank only).
TOWER_RANK = 0


def attach(
    model,
    folder: str | Path,
    config: dict,
    tokenizer,
    group: mx.distributed.Group | None,
    dtype: mx.Dtype = mx.float32,
) -> K3Processor:
    """Give a loaded EP model its image side: the tower is read from ``folder`` on
    ``TOWER_RANK`` only; every rank gets the processor (all ranks tokenize). Returns
    the processor for the server."""
    if not config.get("vision_config"):
        raise ValueError(
            f"{folder}/config.json has no vision_config: this build has no vision tower"
        )
    rank = group.rank() if group is not None else 0
    tower = load_tower(folder, config, dtype) if rank == TOWER_RANK else None
    model.vision = Vision(tower, tokenizer.convert_tokens_to_ids(MEDIA_PAD), group)
    return K3Processor(config["vision_config"])
