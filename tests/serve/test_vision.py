"""Images through expert parallelism (issue 15): token accounting against mlx-vlm's
own kimi_k3 processor, and a 2-rank EP forward with an image against mlx-vlm's
single-process kimi_k3 (float32 logits)."""

from __future__ import annotations

import json

from k3dist.format import layout, placement
from k3dist.pipeline import slicing

import numpy as np
import pytest
from util import failed_ranks, mlx_launch

pytest.importorskip(
    "mlx_vlm", reason="vision tests need the extra: pip install 'k3dist[vision]' (CI installs it)"
)

from k3dist.serve import vision  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.utils import load_tokenizer  # noqa: E402
from mlx_vlm.models.kimi_k3 import Processor  # noqa: E402
from mlx_vlm.utils import load_model as vlm_load_model  # noqa: E402
from PIL import Image  # noqa: E402

TEXT = f"What is in {vision.IMAGE_PLACEHOLDER}? Answer:"
# mlx-vlm's text tower and mlx-lm's give bit-identical text-only logits here; with the
# EP partial sums in another order, a few ULPs (see test_ep_parity).
ATOL = 1e-4


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def processors(mini_src, mini_build):
    cfg = json.loads((mini_src / "config.json").read_text())
    return (
        Processor.from_pretrained(str(mini_src)),
        vision.K3Processor(cfg["vision_config"]),
        load_tokenizer(mini_build),
    )


@pytest.mark.parametrize("w,h", [(13, 9), (60, 40), (100, 100), (30, 200), (1000, 20)])
def test_token_accounting_matches_processor(processors, w, h):
    ref, ours, tok = processors
    img = _image(w, h, w * h)
    out = ref(images=[img], text=TEXT)
    want = np.array(out["input_ids"])[0].tolist()
    t, gh, gw = (int(v) for v in np.array(out["grid_thws"])[0])
    n = t * gh * gw // 4
    ids = vision.prompt_tokens(tok, ours, TEXT, [img])
    pad = tok.convert_tokens_to_ids(vision.MEDIA_PAD)
    assert ids == want
    assert ids.count(pad) == n == ours.count(img) > 0
    # expanded length: the unexpanded prompt's tokens minus the placeholder, plus the
    # image block (begin, "image WxH", content, n pads, end)
    block = tok.encode(ref.make_image_prompt(w, h, n), add_special_tokens=False)
    assert len(ids) == len(
        tok.encode(TEXT.replace(vision.IMAGE_PLACEHOLDER, ""), add_special_tokens=False)
    ) + len(block)
    # one pad per image in a prompt expands to the full block too
    one = ours.expand(f"a{vision.MEDIA_PAD}b", [img])
    assert one.count(vision.MEDIA_PAD) == n
    with pytest.raises(vision.ImageError):
        ours.expand(f"a{vision.MEDIA_PAD}{vision.MEDIA_PAD}b", [img])


def test_two_rank_forward_with_image_matches_mlx_vlm(mini_src, mini_build, tmp_path):
    imgs = [_image(70, 50, 1), _image(70, 50, 2)]  # same size: same ids, other pixels
    paths = []
    for i, im in enumerate(imgs):
        paths.append(tmp_path / f"img{i}.png")
        im.save(paths[-1])

    ref_model = vlm_load_model(mini_src)
    ref_model.set_dtype(mx.float32)
    proc = Processor.from_pretrained(str(mini_src))
    oracle = []
    for im in imgs:
        out = proc(images=[im], text=TEXT)
        logits = ref_model(out["input_ids"], out["pixel_values"], grid_thws=out["grid_thws"]).logits
        oracle.append((np.array(out["input_ids"])[0], np.array(logits[0])))

    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    plc = placement.contiguous(tc["num_experts"], 2, layout.moe_layers(tc))
    for r in range(2):
        slicing.slice_rank(mini_build, tmp_path / "ranks" / f"rank{r}", r, 2, plc, progress=False)
    assert (tmp_path / "ranks/rank0" / vision.VISION_FILE).exists()
    assert not (tmp_path / "ranks/rank1" / vision.VISION_FILE).exists()

    r = mlx_launch(
        2,
        "tests/scripts/vision_forward.py",
        "--rank-dir",
        str(tmp_path / "ranks" / "rank{rank}"),
        "--images",
        ",".join(map(str, paths)),
        "--text",
        TEXT,
        "--dump",
        str(tmp_path / "out" / "rank{rank}.npz"),
    )
    assert r.returncode == 0 and not failed_ranks(r), r.stdout[-2000:] + r.stderr[-4000:]
    runs = [np.load(tmp_path / "out" / f"rank{i}.npz") for i in range(2)]
    assert runs[0]["has_tower"] and not runs[1]["has_tower"]
    diffs = []
    for i, (ids, logits) in enumerate(oracle):
        for x in runs:
            assert x[f"ids{i}"].tolist() == ids.tolist()
            assert np.array_equal(x[f"logits{i}"], runs[0][f"logits{i}"])  # ranks bitwise
            assert x[f"tokens{i}"].tolist() == runs[0][f"tokens{i}"].tolist()
        diffs.append(float(np.abs(runs[0][f"logits{i}"] - logits).max()))
        # the greedy continuation starts from the prompt's last logits
        assert int(runs[0][f"tokens{i}"][0]) == int(logits[-1].argmax())
    print(f"\nmax |logit - mlx-vlm single process|: {max(diffs):.3g}")
    assert max(diffs) < ATOL
    # two images: different logits at the end; the text before the first pad is
    # untouched by the image (causal)
    a, b = runs[0]["logits0"], runs[0]["logits1"]
    assert np.abs(a[-1] - b[-1]).max() > 1e-3
    pad = load_tokenizer(mini_build).convert_tokens_to_ids(vision.MEDIA_PAD)
    first = int(np.flatnonzero(runs[0]["ids0"] == pad)[0])
    assert first > 0 and np.array_equal(a[:first], b[:first])


def test_local_images_only_under_the_deployment_directory(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    _image(40, 30, 3).save(root / "a.png")
    (tmp_path / "outside.png").write_bytes((root / "a.png").read_bytes())
    (root / "link.png").symlink_to(tmp_path / "outside.png")
    on = vision.VisionLimits(image_dir=str(root))
    part = {"type": "image_url", "image_url": {"url": str(root / "a.png")}}
    assert vision.check_image_part(part, on, "p").size == (40, 30)
    assert part["image_url"]["url"].startswith("data:image/png;base64,")  # ranks get bytes
    for url in (
        str(tmp_path / "outside.png"),
        str(root / "link.png"),
        str(root / ".." / "outside.png"),
        f"file://{tmp_path}/outside.png",
    ):
        with pytest.raises(vision.ImageError, match="outside"):
            vision.check_image_part({"type": "image_url", "image_url": {"url": url}}, on, "p")
    with pytest.raises(vision.ImageError, match="off in this deployment"):
        vision.check_image_part(
            {"type": "image_url", "image_url": {"url": str(root / "a.png")}},
            vision.VisionLimits(),
            "p",
        )
