"""K3's XTML chat format: the Python renderer, the Jinja template (identical output), and a
converted build served through mlx-lm's tokenizer loader end to end."""

from __future__ import annotations

import copy
import json

from k3dist.format import tokens as tk

import chat_render as chat
import pytest
from jinja2.exceptions import TemplateError
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from mlx_lm.tool_parsers import kimi_k3 as kimi_k3_parser
from mlx_lm.utils import load_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Suche im Web — 検索",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}


def call(i: int, name: str, arguments) -> dict:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


TYPED_ARGS = {
    "city": "Paris",
    "days": 2,
    "metric": True,
    "extra": None,
    "ratio": 0.5,
    "opts": {"b": [1, 2], "a": "x"},
    "tags": ["新", "y"],
}

# name -> (messages, render kwargs)
CASES = {
    "single_user": ([{"role": "user", "content": "Hello!"}], {}),
    "system_user": (
        [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "hi"}],
        {},
    ),
    "empty_system": ([{"role": "system", "content": ""}, {"role": "user", "content": "hi"}], {}),
    "no_generation_prompt": (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}],
        {"add_generation_prompt": False},
    ),
    "multi_turn_reasoning": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "add"},
            {"role": "user", "content": "times 3?"},
            {
                "role": "assistant",
                "content": "12",
                "reasoning_content": "   ",
            },  # blank: empty think
            {"role": "user", "content": "ok"},
        ],
        {},
    ),
    "instruct_mode": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "dropped in instruct mode"},
            {"role": "user", "content": "ok"},
        ],
        {"thinking": False},
    ),
    "non_ascii": (
        [
            {"role": "system", "content": "用中文回答。"},
            {"role": "user", "content": "你好，世界 🚀 naïve “quotes” Привет e\u0301"},
            {"role": "assistant", "content": "你好！👋", "reasoning": "用户在打招呼"},
            {"role": "user", "content": "مرحبا"},
        ],
        {},
    ),
    "names_escaped": (
        [
            {"role": "system", "content": "sys", "name": "ops"},
            {"role": "user", "content": "hi", "name": 'A "quoted" & co'},
        ],
        {},
    ),
    "content_parts_and_image": (
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look: "},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": " ok"},
                ],
            }
        ],
        {},
    ),
    "tools_declared": ([{"role": "user", "content": "weather?"}], {"tools": [WEATHER, SEARCH]}),
    "tool_call_and_result": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Tokyo for 3 days?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "need tool",
                "tool_calls": [call(1, "get_weather", {"city": "Tokyo", "days": 3})],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "22C, clear"},
        ],
        {"tools": [WEATHER]},
    ),
    "parallel_typed_calls": (
        [
            {"role": "user", "content": "do it"},
            {
                "role": "assistant",
                "content": "Calling.",
                "tool_calls": [
                    call(1, "get_weather", TYPED_ARGS),
                    call(2, "search", {"q": 'a "quoted" <b>&</b>\nnext line'}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {
                "role": "tool",
                "tool_call_id": "call_2",
                "content": [{"type": "text", "text": "results…"}],
            },
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "thanks"},
        ],
        {"tools": [WEATHER, SEARCH]},
    ),
    "results_out_of_order": (
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call(1, "get_weather", {"city": "A"}),
                    call(2, "search", {"q": "b"}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_2", "content": "B"},
            {"role": "tool", "tool_call_id": "call_1", "content": "A"},
        ],
        {"tools": [WEATHER, SEARCH]},
    ),
    "results_by_position": (
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call(1, "get_weather", {"city": "A"}),
                    call(2, "search", {"q": "b"}),
                ],
            },
            {"role": "tool", "content": "A"},
            {"role": "tool", "name": "search", "content": "B"},
        ],
        {},
    ),
    "flat_call_and_json_block": (
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"name": "search", "arguments": "{not json"},
                    {"id": "x", "function": {"name": "search", "arguments": {}}},
                ],
            },
            {"role": "tool", "tool": "search", "content": "r1"},
            {"role": "tool", "tool": "search", "content": "r2"},
        ],
        {},
    ),
    "tools_added_mid_chat": (
        [
            {"role": "system", "content": "base"},
            {"role": "user", "content": "hi"},
            {"role": "system", "tools": [SEARCH]},
            {"role": "user", "content": "now search"},
        ],
        {"tools": [WEATHER]},
    ),
    "effort_low": ([{"role": "user", "content": "think a little"}], {"thinking_effort": "low"}),
    "effort_none": ([{"role": "user", "content": "no effort message"}], {"thinking_effort": None}),
    "tool_choice_required": (
        [{"role": "user", "content": "call something"}],
        {"tools": [WEATHER], "tool_choice": "required"},
    ),
    "tool_choice_none_instruct": (
        [{"role": "user", "content": "just talk"}],
        {"tools": [WEATHER], "tool_choice": "none", "thinking": False},
    ),
    "json_object": (
        [{"role": "user", "content": "json please"}],
        {"response_format": {"type": "json_object"}},
    ),
    "json_schema": (
        [{"role": "user", "content": "json please"}],
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {"z": {"type": "string"}, "a": {"type": "number"}},
                    },
                },
            }
        },
    ),
    "history_ends_with_calls": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "tool_calls": [call(7, "search", {"q": "q"})]},
        ],
        {"thinking": False, "add_generation_prompt": False},
    ),
    "control_text_in_content": ([{"role": "user", "content": "what is <|open|> and [EOS]?"}], {}),
}


@pytest.fixture(scope="module")
def served(mini_build) -> TokenizerWrapper:
    return load_tokenizer(mini_build)


def jinja(tokenizer, messages, **kwargs) -> str:
    kwargs.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jinja_renders_like_python(served: TokenizerWrapper, name: str) -> None:
    messages, kwargs = CASES[name]
    want = chat.render(copy.deepcopy(messages), **kwargs)
    assert jinja(served, messages, **kwargs) == want
    # transformers' tokenizer directly (no wrapper: no enable_thinking injected)
    assert jinja(served._tokenizer, messages, **kwargs) == want


def test_format_spelled_out() -> None:
    """One chat written out by hand from the public descriptions of the format."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need the tool",
            "tool_calls": [call(1, "get_weather", {"city": "Tokyo", "days": 3})],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]
    end = "<|close|>message<|sep|><|end_of_msg|>"
    want = (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
        "Here are the available tools, described in JSONSchema.\n\n```json\n"
        '[{"function":{"name":"get_weather","parameters":{"properties":{"city":{"type":'
        '"string"}},"type":"object"}},"type":"function"}]\n```'
        + end
        + '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides'
        " on how much to think in your thinking channel (not including the response channel),"
        " supported values include `low`, `medium`, `high`, and `max`.\n"
        "Now the system is invoked with `thinking_effort=high`."
        + end
        + '<|open|>message role="system"<|sep|>Be brief.'
        + end
        + '<|open|>message role="user"<|sep|>Weather in Tokyo?'
        + end
        + '<|open|>message role="assistant"<|sep|>'
        "<|open|>think<|sep|>need the tool<|close|>think<|sep|>"
        "<|open|>response<|sep|><|close|>response<|sep|>"
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>"
        + end
        + '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>22C'
        + end
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert chat.render(messages, tools=[tool], thinking_effort="high") == want
    instruct = chat.render(messages[:2], thinking=False)
    assert instruct.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert "thinking-effort" not in instruct


def test_enable_thinking_selects_mode(served: TokenizerWrapper) -> None:
    messages = CASES["multi_turn_reasoning"][0]
    assert jinja(served, messages, enable_thinking=False) == chat.render(messages, thinking=False)
    # `thinking` (K3's own name) wins over the enable_thinking mlx-lm always passes
    assert jinja(served, messages, thinking=False, enable_thinking=True) == chat.render(
        messages, thinking=False
    )


def test_string_arguments(served: TokenizerWrapper) -> None:
    as_dict = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call(1, "search", {"q": "x"})]},
    ]
    as_text = copy.deepcopy(as_dict)
    as_text[1]["tool_calls"][0]["function"]["arguments"] = '{"q": "x"}'
    # Python parses a JSON-object string like the reference; mlx_lm.server json.loads it
    # before the template, which then sees the dict.
    assert chat.render(as_text) == chat.render(as_dict) == jinja(served, as_dict)
    # A template cannot parse JSON: a string reaches it as the JSON fallback block.
    assert '<|open|>json type="object"<|sep|>{"q": "x"}<|close|>json<|sep|>' in jinja(
        served, as_text
    )


@pytest.mark.parametrize(
    "messages, kwargs, match",
    [
        ([{"role": "developer", "content": "x"}], {}, "unknown message role"),
        ([{"role": "user", "content": "x"}], {"thinking_effort": "medium"}, "thinking_effort"),
        ([{"role": "tool", "content": "orphan"}], {}, "tool name"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [call(1, "f", [1, 2])]}],
            {},
            "arguments",
        ),
    ],
)
def test_bad_input_raises_in_both(served, messages, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        chat.render(messages, **kwargs)
    with pytest.raises(TemplateError, match=match):
        jinja(served, messages, **kwargs)


def test_tool_calls_parse_back_with_mlx_lm() -> None:
    calls = [
        call(1, "get_weather", TYPED_ARGS),
        call(2, "search", {"q": 'code: if a < b && c:\n    print("hi")'}),
    ]
    text = chat.render(
        [{"role": "assistant", "content": "", "tool_calls": calls}], add_generation_prompt=False
    )
    start = text.index(kimi_k3_parser.tool_call_start)
    body = text[
        start + len(kimi_k3_parser.tool_call_start) : text.index(kimi_k3_parser.tool_call_end)
    ]
    parsed = kimi_k3_parser.parse_tool_call(body)
    assert parsed == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
    ]


def _stream(detokenizer, ids: list[int]) -> str:
    detokenizer.reset()
    pieces = []
    for i in ids:
        detokenizer.add_token(i)
        piece = detokenizer.last_segment
        assert "\ufffd" not in piece  # partial UTF-8 is held back, never shown
        pieces.append(piece)
    detokenizer.finalize()
    pieces.append(detokenizer.last_segment)
    assert "".join(pieces) == detokenizer.text
    return detokenizer.text


def test_served_build_end_to_end(mini_build, served: TokenizerWrapper) -> None:
    config = json.loads((mini_build / "config.json").read_text())
    sp = tk.special_tokens(config["text_config"]["vocab_size"] - tk.NUM_CONTROL_TOKENS)
    assert sp[tk.END_OF_MSG] == config["eos_token_id"]
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "tiktoken.model",
    ):
        assert (mini_build / name).exists()

    # What mlx_lm.server relies on
    assert served.has_chat_template
    assert (served.think_start, served.think_end) == (
        "<|open|>think<|sep|>",
        "<|close|>think<|sep|>",
    )
    assert served.think_start_tokens[0] == sp[tk.OPEN]
    assert served.think_start_tokens[-1] == sp[tk.SEP]
    assert served.tool_parser is kimi_k3_parser.parse_tool_call
    assert served.tool_call_start == kimi_k3_parser.tool_call_start
    assert config["eos_token_id"] in served.eos_token_ids
    assert isinstance(served.detokenizer, BPEStreamingDetokenizer)

    # chat template -> ids -> streamed text
    messages, kwargs = CASES["parallel_typed_calls"]
    prompt = chat.render(messages, **kwargs)
    ids = served.apply_chat_template(copy.deepcopy(messages), add_generation_prompt=True, **kwargs)
    assert ids == tk.load_encoding(mini_build).encode(prompt, allowed_special="all")
    # the prompt ends inside the think channel: the server starts in its reasoning state
    assert tuple(ids[-len(served.think_start_tokens) :]) == served.think_start_tokens
    assert _stream(served.detokenizer, ids) == prompt

    # A completion as the model would write it: stops at <|end_of_msg|>, streams exactly
    # (multi-byte characters split over tokens), and its tool call parses back.
    args = {"city": "東京", "days": 3, "note": "🌸 naïve “x”"}
    completion = (
        "用户想知道天气 🌤<|close|>think<|sep|><|open|>response<|sep|>Sure — 查一下。"
        "<|close|>response<|sep|>"
        + chat.render(
            [{"role": "assistant", "content": "", "tool_calls": [call(1, "get_weather", args)]}],
            thinking=False,
            add_generation_prompt=False,
        ).split("<|close|>response<|sep|>", 1)[1]
    )
    out = served.encode(completion, add_special_tokens=False)
    assert out[-1] in served.eos_token_ids and out.count(sp[tk.END_OF_MSG]) == 1
    assert any("\ufffd" in served.decode([i]) for i in out)  # characters split over tokens
    text = _stream(served.detokenizer, out)
    assert text == completion
    start, end = served.tool_call_start, served.tool_call_end
    tool_text = text[text.index(start) + len(start) : text.index(end)]
    assert served.tool_parser(tool_text, [WEATHER]) == [{"name": "get_weather", "arguments": args}]
