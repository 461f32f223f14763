"""OpenAI chat completions and completions (``/v1/chat/completions``, ``/v1/completions``).

A request is validated (pydantic) before it is queued: every field mlx-lm 0.32.2's
server reads is bounded here, since a value that reaches the lockstep loop out of
range can crash both ranks (a ``logit_bias`` id past the vocabulary corrupts memory)
or fail after the response has begun. Errors are OpenAI's
(``{"error": {"message", "type", "param", "code"}}``, naming the field). An explicit
``null`` is the field's default. ``handler_fields`` then gives what mlx-lm's
``APIHandler`` reads for the request, so the body is parsed once, by the handler.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

ROLES = ("system", "user", "assistant", "tool", "developer")
# Bounds on what a request may carry into the generation loop (OpenAI's where it has
# one): each costs time or memory before the first token, or crashes out of range.
MAX_STOP = 4  # stop sequences (OpenAI: up to 4)
MAX_STOP_CHARS = 256  # characters per stop sequence
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI: 300)
MAX_TOOLS = 128  # tools (OpenAI: 128)
MAX_TOP_LOGPROBS = 11  # mlx-lm's own bound
MAX_TEMPLATE_KWARGS = 16
SEED_MAX = 2**64 - 1  # mx.random.seed takes a uint64
# A smaller top_p times the float32 probability mass is 0: mlx-lm's apply_top_p then drops
# every token and takes its threshold one past the vocabulary, an out-of-bounds read that
# gave each rank another first token (found by the fuzzer: benchmarks/faults/fuzz_requests.py).
MIN_TOP_P = 1e-30
MAX_JSON_DEPTH = 64  # the request is pickled to the other ranks: no deep recursion
MAX_JSON_VALUES = 100_000
# Keys mlx-lm passes to apply_chat_template itself: a request may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "tokenize",
        "add_generation_prompt",
        "chat_template",
        "return_dict",
        "return_tensors",
        "continue_final_message",
        "documents",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
    }
)
# OpenAI-style image parts (mlx-lm's reading of them)
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
# Fields mlx-lm reads that the expert-parallel server does not serve.
UNSUPPORTED = ("adapters", "draft_model", "num_draft_tokens", "images")
# Fields of chat completions only.
CHAT_ONLY = ("messages", "tools", "chat_template_kwargs", "role_mapping")


class RequestError(ValueError):
    """A request refused before it is queued, in OpenAI's error shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": str(self),
                "type": "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        }


def _refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", message)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Open(_Model):
    """A part of a message: its other keys go to the chat template as sent."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImagePart(_Open):
    """Checked by k3dist.serve.vision; accepted only where the deployment serves images."""

    type: Literal["image_url", "input_image", "image"]


class Function(_Open):
    name: str
    arguments: dict = {}

    @field_validator("arguments", mode="before")
    @classmethod
    def _parsed(cls, v: Any) -> Any:
        """A JSON string is parsed here, as mlx-lm would later, past the checks."""
        if v is None or v == "":
            return {}
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise _refuse(f"arguments is not JSON: {v[:80]!r}") from None
        if not isinstance(v, dict):
            raise _refuse(f"arguments must be a JSON object, not {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _always_arguments(self) -> Function:
        self.arguments = self.arguments  # set: dumped even when the request left it out
        return self


class ToolCall(_Open):
    function: Function


class Message(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    tool_calls: list[ToolCall] | None = None

    def chars(self) -> int:
        c = self.content
        n = (
            len(c or "")
            if not isinstance(c, list)
            else sum(len(p.text) for p in c if isinstance(p, TextPart))
        )
        if self.tool_calls is not None:  # rendered into the prompt
            n += len(
                json.dumps(
                    [t.model_dump(exclude_unset=True) for t in self.tool_calls], ensure_ascii=False
                )
            )
        return n


_Unit = Annotated[float, Field(ge=0, le=1)]
_Penalty = Annotated[float, Field(ge=-2, le=2)]
_Size = Annotated[int, Field(ge=0)]  # at most the context: checked with it (validate)


class StreamOptions(_Model):
    include_usage: bool = False  # mlx-lm reads it unguarded at the end


class Sampling(_Model):
    """The fields both endpoints share: what mlx-lm's handler reads from a request."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: _Unit | None = None
    top_k: _Size | None = None  # below the vocabulary: checked with it (validate)
    min_p: _Unit | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: Annotated[float, Field(ge=0, le=10)] | None = None
    repetition_context_size: _Size | None = None
    presence_context_size: _Size | None = None
    frequency_context_size: _Size | None = None
    xtc_probability: _Unit | None = None
    xtc_threshold: Annotated[float, Field(ge=0, le=0.5)] | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    adapters: Any = None
    draft_model: Any = None
    num_draft_tokens: Any = None
    images: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise _refuse(f"n must be 1 (one choice per request), not {v!r}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p_floor(cls, v: float | None) -> float | None:
        if v is not None and 0 < v < MIN_TOP_P:
            raise _refuse(
                f"top_p must be 0 or at least {MIN_TOP_P:g}, not {v!r} (in float32 "
                "it rounds to 0, and mlx-lm's top-p filter then reads past the "
                f"vocabulary); {MIN_TOP_P:g} already keeps only the top token"
            )
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise _refuse(f"stop has {len(stops)} sequences; at most {MAX_STOP}")
        for s in stops:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise _refuse(
                    f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters, not {len(s)}"
                )
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise _refuse(f"logit_bias has {len(v)} entries; at most {MAX_LOGIT_BIAS}")
        for k, b in v.items():  # ids against the vocabulary: validate
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise _refuse(f"logit_bias key {k[:32]!r} is not a token id")
            if not -100 <= b <= 100:
                raise _refuse(f"logit_bias[{k}] must be a number in [-100, 100], not {b!r}")
        return {str(int(k)): b for k, b in v.items()}

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, v: Any, info) -> Any:
        if v is not None:
            raise _refuse(f"{info.field_name} is not supported by the expert-parallel server")
        return v

    @property
    def asked(self) -> int | None:
        """The completion length the client asked for (None: the server's default)."""
        return self.max_completion_tokens or self.max_tokens

    def stop_words(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    role_mapping: Any = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kw: dict | None) -> dict | None:
        if kw is None:
            return kw
        if len(kw) > MAX_TEMPLATE_KWARGS:
            raise _refuse(
                f"chat_template_kwargs must be an object of at most {MAX_TEMPLATE_KWARGS} entries"
            )
        for k, v in kw.items():
            if not k.isidentifier() or k in RESERVED_TEMPLATE_KWARGS:
                raise _refuse(f"chat_template_kwargs may not set {k[:32]!r}")
            if not (
                v is None
                or isinstance(v, (bool, int, float))
                or (isinstance(v, str) and len(v) <= 256)
            ):
                raise _refuse(
                    f"chat_template_kwargs[{k!r}] must be a number, a bool, null "
                    "or a string of at most 256 characters"
                )
        return kw

    @field_validator("role_mapping")
    @classmethod
    def _no_role_mapping(cls, v: Any) -> Any:
        if v is not None:
            raise _refuse("role_mapping is not supported (the model has a chat template)")
        return v

    def chars(self) -> int:
        """The prompt's characters before rendering (for the cheap length pre-check)."""
        n = sum(m.chars() for m in self.messages)
        if self.tools is not None:
            n += len(json.dumps(self.tools, ensure_ascii=False))  # rendered into the prompt
        return n

    def body(self) -> dict:
        """The request as mlx-lm's handler reads it (``self.body``)."""
        return {
            "messages": [m.model_dump(exclude_unset=True) for m in self.messages],
            "tools": self.tools,
        }


class TextRequest(Sampling):
    prompt: str
    messages: Any = None
    tools: Any = None
    chat_template_kwargs: Any = None
    role_mapping: Any = None

    @field_validator(*CHAT_ONLY)
    @classmethod
    def _chat_only(cls, v: Any, info) -> Any:
        if v is not None:
            raise _refuse(f"{info.field_name} belongs to /v1/chat/completions")
        return v

    def chars(self) -> int:
        return len(self.prompt)

    def body(self) -> dict:
        return {"prompt": self.prompt}


def _json_shape(value: Any) -> tuple[int, int]:
    """(deepest nesting, number of values) of parsed JSON, without recursion; stops
    counting past the limits (the request is refused then anyway)."""
    depth, count = 0, 0
    stack = [(value, 1)]
    while stack and depth <= MAX_JSON_DEPTH and count <= MAX_JSON_VALUES:
        v, d = stack.pop()
        count += 1
        if isinstance(v, dict):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in v)
    return depth, count


def _where(loc: tuple) -> str:
    """A pydantic location as the request spells it: ``messages[0].content[1]``; the
    tags of union members (``str``, ``list[...]``, ``function-after[...]``) left out."""
    out = ""
    for i, x in enumerate(loc):
        if isinstance(x, int):
            out += f"[{x}]"
        elif x in ("str", "int", "float", "bool", "dict", "list") or "[" in x:
            continue
        elif i and isinstance(loc[i - 1], int) and x in ("text", *IMAGE_PART_TYPES):
            continue  # a content part's type: the tag of its union member
        else:
            out += f".{x}" if out else x
    return out


def _error(e: ValidationError) -> RequestError:
    errs = e.errors()
    err = max(errs, key=lambda x: len(x["loc"]))  # the deepest: a union's member
    param = str(err["loc"][0]) if err["loc"] else None
    where = _where(err["loc"])
    msg = err["msg"]
    if err["type"] == "union_tag_invalid" or "discriminator" in err["type"]:
        msg = (
            f"has type {err.get('input', {}).get('type')!r}; this deployment serves text only"
            if isinstance(err.get("input"), dict)
            else msg
        )
    return RequestError(
        400, f"{where}: {msg}" if where and not msg.startswith(where) else msg, param
    )


def validate(
    path: str, body: Any, *, model_id: str, max_context: int, vocab_size: int, images: bool = False
) -> ChatRequest | TextRequest:
    """The request of ``path`` (a chat or a text completion), checked; RequestError
    (OpenAI's 4xx, naming the field) if it is refused."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    depth, count = _json_shape(body)
    if depth > MAX_JSON_DEPTH or count > MAX_JSON_VALUES:
        raise RequestError(
            400,
            f"request body is nested deeper than {MAX_JSON_DEPTH} or has "
            f"more than {MAX_JSON_VALUES} values",
        )
    chat = path.endswith("chat/completions")
    if not chat:
        prompt = body.get("prompt")
        if body.get("images") is not None or (
            isinstance(prompt, list)
            and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in prompt)
        ):
            raise RequestError(
                400,
                "images are accepted only as image_url parts of /v1/chat/completions messages",
                "prompt",
            )
    try:
        req = (ChatRequest if chat else TextRequest).model_validate(body)
    except ValidationError as e:
        raise _error(e) from None
    model = req.model if req.model is not None else model_id
    if model not in (model_id, "default_model"):
        raise RequestError(
            404,
            f"model {model!r} does not exist; this server serves {model_id!r}",
            "model",
            "model_not_found",
        )
    if chat and not images:
        for i, m in enumerate(req.messages):
            for j, p in enumerate(m.content if isinstance(m.content, list) else []):
                if isinstance(p, ImagePart):
                    raise RequestError(
                        400,
                        f"messages[{i}].content[{j}] has type {p.type!r}; "
                        "this deployment serves text only",
                        "messages",
                    )
    # the bounds that depend on the deployment
    for key, hi in (
        ("max_tokens", max_context),
        ("max_completion_tokens", max_context),
        ("repetition_context_size", max_context),
        ("presence_context_size", max_context),
        ("frequency_context_size", max_context),
        ("top_k", vocab_size - 1),
    ):  # mlx-lm: k < vocab
        v = getattr(req, key)
        if v is not None and v > hi:
            lo = 1 if key.startswith("max") else 0
            raise RequestError(400, f"{key} must be an integer in [{lo}, {hi}], not {v!r}", key)
    for k in req.logit_bias or {}:
        if int(k) >= vocab_size:
            raise RequestError(
                400, f"logit_bias key {k!r} is not a token id in [0, {vocab_size})", "logit_bias"
            )
    return req


def handler_fields(req: ChatRequest | TextRequest, cli_args) -> dict[str, Any]:
    """What mlx-lm 0.32.2's ``APIHandler.do_POST`` sets on the handler for this request,
    with its defaults (``cli_args``' where it takes them from there; the others are
    pinned against its own in tests/model/test_compat.py): ``handle_completion`` reads these."""
    so = req.stream_options
    return {
        "stream": bool(req.stream),
        "stream_options": so.model_dump() if so else None,
        "requested_model": req.model or "default_model",
        "requested_draft_model": "default_model",
        "num_draft_tokens": cli_args.num_draft_tokens,
        "adapter": None,
        "max_tokens": req.asked or cli_args.max_tokens,
        "temperature": _or(req.temperature, cli_args.temp),
        "top_p": _or(req.top_p, cli_args.top_p),
        "top_k": _or(req.top_k, cli_args.top_k),
        "min_p": _or(req.min_p, cli_args.min_p),
        "repetition_penalty": _or(req.repetition_penalty, 0.0),
        "repetition_context_size": _or(req.repetition_context_size, 20),
        "presence_penalty": _or(req.presence_penalty, 0.0),
        "presence_context_size": _or(req.presence_context_size, 20),
        "frequency_penalty": _or(req.frequency_penalty, 0.0),
        "frequency_context_size": _or(req.frequency_context_size, 20),
        "xtc_probability": float(_or(req.xtc_probability, 0.0)),  # mlx-lm wants floats
        "xtc_threshold": float(_or(req.xtc_threshold, 0.1)),
        "logit_bias": None
        if req.logit_bias is None
        else {int(k): float(v) for k, v in req.logit_bias.items()},
        "logprobs": bool(req.logprobs),
        "top_logprobs": _or(req.top_logprobs, -1),
        "seed": req.seed,
        "chat_template_kwargs": getattr(req, "chat_template_kwargs", None),
    }


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v
