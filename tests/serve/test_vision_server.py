"""The 2-rank server with vision on (issue 15): an image chat request is served with
the processor's token count, and bad images get a 4xx before any rank works (the
ranks' token logs do not grow); the server keeps serving. One server start."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import pytest

pytest.importorskip(
    "mlx_vlm", reason="vision tests need the extra: pip install 'k3dist[vision]' (CI installs it)"
)

from k3dist.serve import vision  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.utils import load_tokenizer  # noqa: E402
from mlx_vlm.models.kimi_k3 import Processor  # noqa: E402
from mlx_vlm.utils import load_model as vlm_load_model  # noqa: E402
from PIL import Image  # noqa: E402
from serving import CHAT, SHARED, check_alive, post_raw, token_log  # noqa: E402

_FLAGS = SHARED["vision"][0]
MAX_PIXELS = int(_FLAGS[_FLAGS.index("--max-image-pixels") + 1])  # the served cap


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _forged_png(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h (a bomb's header; the data is a few bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def _chat(*urls: str, text: str = "What is this?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        "max_tokens": 3,
        "temperature": 0,
    }


@pytest.fixture(scope="module")
def vsrv(shared):
    s = shared.get("vision", __name__)  # read also by test_fuzz (serving.SHARED)
    yield s
    check_alive(s, f"after {__name__}")


def test_images_served_and_bad_images_refused_before_any_rank(vsrv, mini_src, mini_build):
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (45, 80, 3), dtype=np.uint8))
    good = _png(img)

    # served, with the processor's own token count (one pad per feature row), and the
    # first token's logprob is mlx-vlm's single-process kimi_k3 with the same image
    got, raw = post_raw(
        vsrv.url + CHAT, json.dumps({**_chat(_data_url(good)), "logprobs": True}).encode(), 120
    )
    assert got == 200, raw[:500]
    reply = json.loads(raw)
    tok = load_tokenizer(mini_build)
    cfg = json.loads((mini_build / "config.json").read_text())
    proc = vision.K3Processor(cfg["vision_config"])
    msgs = _chat(_data_url(good))["messages"]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    want = vision.prompt_tokens(tok, proc, text, [img])
    assert reply["usage"]["prompt_tokens"] == len(want)
    assert want.count(tok.convert_tokens_to_ids(vision.MEDIA_PAD)) == proc.count(img) > 0

    ref = vlm_load_model(mini_src)
    ref.set_dtype(mx.float32)
    out = Processor.from_pretrained(str(mini_src))(images=[img], text=text)
    assert np.array(out["input_ids"])[0].tolist() == want
    logits = ref(out["input_ids"], out["pixel_values"], grid_thws=out["grid_thws"]).logits
    lp = np.array(logits[0, -1] - mx.logsumexp(logits[0, -1]))
    first = reply["choices"][0]["logprobs"]["content"][0]
    assert first["id"] == int(lp.argmax())
    assert abs(first["logprob"] - float(lp.max())) < 1e-4
    # the pads as plain tokens (no image) would give another distribution
    plain = np.array(ref.language_model(out["input_ids"]).logits[0, -1])
    assert np.abs(plain - np.array(logits[0, -1])).max() > 1e-2
    served = len(token_log(vsrv, 0))

    truncated = good[: len(good) // 2]
    black = Image.new("L", (1200, 1200))  # 1.44 M pixels in a ~5 kB PNG
    assert img.width * img.height <= MAX_PIXELS < black.width * black.height
    bad = {
        "corrupt bytes": (
            CHAT,
            _chat(_data_url(b"\x89PNG\r\n\x1a\n" + b"x" * 200)),
            "not a readable image",
        ),
        "truncated": (CHAT, _chat(_data_url(truncated)), "corrupt"),
        "zero bytes": (CHAT, _chat("data:image/png;base64,"), "empty"),
        "bad base64": (CHAT, _chat("data:image/png;base64,@@@"), "base64"),
        "huge header (bomb)": (
            CHAT,
            _chat(_data_url(_forged_png(60000, 60000))),
            "before decoding",
        ),
        "over the pixel cap": (CHAT, _chat(_data_url(_png(black))), "before decoding"),
        "bmp": (CHAT, _chat(_data_url(_png(img, "BMP"), "image/bmp")), "not supported"),
        "too many images": (CHAT, _chat(*[_data_url(good)] * 3), "at most 2"),
        "remote url": (CHAT, _chat("http://127.0.0.1:9/x.png"), "remote image URLs"),
        "local path (off)": (CHAT, _chat("/etc/hosts"), "local image paths are off"),
        "text completion": (
            "/v1/completions",
            {"prompt": [{"type": "image_url", "image_url": {"url": "x"}}], "max_tokens": 3},
            "/v1/chat/completions",
        ),
        "images field": (
            "/v1/completions",
            {"prompt": "hi", "images": [_data_url(good)]},
            "/v1/chat/completions",
        ),
    }
    for name, (path, body, words) in bad.items():
        got, raw = post_raw(vsrv.url + path, json.dumps(body).encode())
        assert 400 <= got < 500, (name, got, raw[:300])
        msg = json.loads(raw)["error"]["message"]
        assert words in msg, (name, msg)
    assert len(token_log(vsrv, 0)) == served and len(token_log(vsrv, 1)) == served  # no rank worked

    # still serving: text and images
    got, raw = post_raw(
        vsrv.url + CHAT,
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(),
        60,
    )
    assert got == 200, raw[:300]
    other = _png(Image.fromarray(rng.integers(0, 256, (45, 80, 3), dtype=np.uint8)))
    got, raw = post_raw(vsrv.url + CHAT, json.dumps(_chat(_data_url(other))).encode(), 120)
    assert got == 200, raw[:300]
    assert set(vsrv.rank_pids()) == {0, 1}


def test_image_inside_an_anthropic_tool_result_is_an_image_of_the_tool_message(vsrv, mini_build):
    from k3dist.serve import anthropic_api

    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, (45, 80, 3), dtype=np.uint8))
    src = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(_png(img)).decode(),
    }
    body = {
        "model": "kimi-k3",
        "max_tokens": 3,
        "temperature": 0,
        "tools": [
            {
                "name": "Read",
                "description": "Read a file",
                "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
            }
        ],
        "messages": [
            {"role": "user", "content": "What is in shot.png?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Read",
                        "input": {"path": "shot.png"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [
                            {"type": "image", "source": src},
                            {"type": "text", "text": "shot.png"},
                        ],
                    }
                ],
            },
        ],
    }
    got, raw = post_raw(vsrv.url + "/v1/messages", json.dumps(body).encode(), 120)
    assert got == 200, raw[:500]
    reply = json.loads(raw)

    # the prompt: the tool message's image expanded into the processor's pads
    chat = anthropic_api.to_chat(body)
    tool = chat["messages"][-1]
    assert tool["role"] == "tool" and [p["type"] for p in tool["content"]] == ["image_url", "text"]
    tok = load_tokenizer(mini_build)
    proc = vision.K3Processor(json.loads((mini_build / "config.json").read_text())["vision_config"])
    text = tok.apply_chat_template(
        chat["messages"],
        tools=chat["tools"],
        add_generation_prompt=True,
        tokenize=False,
        **chat["chat_template_kwargs"],
    )
    want = vision.prompt_tokens(tok, proc, text, [img])
    assert want.count(tok.convert_tokens_to_ids(vision.MEDIA_PAD)) == proc.count(img) > 0
    assert reply["usage"]["input_tokens"] == len(want)

    # the same conversation through chat completions gives the same greedy answer
    got, raw = post_raw(vsrv.url + CHAT, json.dumps(chat).encode(), 120)
    assert got == 200, raw[:500]
    served = json.loads(raw)
    assert served["usage"]["prompt_tokens"] == len(want)
    assert (
        "".join(b.get("text", "") for b in reply["content"])
        == served["choices"][0]["message"]["content"]
    )

    # an image in a tool_result is an image like any other: checked before any rank works
    bad = json.loads(json.dumps(body))
    bad["messages"][2]["content"][0]["content"][0]["source"]["data"] = "@@@"
    got, raw = post_raw(vsrv.url + "/v1/messages", json.dumps(bad).encode())
    assert got == 400 and "base64" in json.loads(raw)["error"]["message"], raw[:300]
