"""The deployment file (``deploy/*.yaml``): one typed definition of every key, its type,
default, range and help, read once at the edge (YAML, then flags on top) and passed
down. The command-line flags of ``launch/serve.py``, ``launch/generate.py`` and
``slicing/rank_split.py`` are made from it (:func:`add_arguments`, :func:`from_args`).

It lives in the config layer, below serving and the build pipeline, so both read it
(the planner plans for a deployment's limits) and the build imports no serving code."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

from k3dist.format.layout import ATTENTION_MODES
from k3dist.format.placement import MOE_FORMS, RING_CONNECT_S
from k3dist.format.sfile import COMPUTE_DTYPES
from k3dist.format.verify import MODES as VERIFY_MODES

import yaml
from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from k3dist.config.box import Box

DEFAULT_DEPLOYMENT = Path("deploy/local.yaml")
# compute dtypes a deployment may ask for (MLX names)
DTYPES = COMPUTE_DTYPES
# largest max_batch: each batch size up to it is one warm-up decode shape
MAX_BATCH = 256


# keys renamed (old -> new): the old name is still read, with a notice, for one release
RENAMED = {"memory_headroom_gb": "memory_headroom_gib"}


def _renamed(values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` with renamed keys under their new names, each said once on stderr."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out:
            print(
                f"k3dist: {where}: {old} is deprecated, it is now {new} (same value, GiB); "
                f"rename it",
                file=sys.stderr,
                flush=True,
            )
            out.setdefault(new, out.pop(old))
    return out


class DeploymentError(ValueError):
    """A deployment key with a value it cannot take; the message names where it came
    from (the file or the flag), the key, what is allowed and the fix."""


def _key(default: Any, help: str, section: str, flag: str | None = None, **range_: Any) -> Any:
    """One deployment key: its default, help text (the flag's --help) and range;
    ``section`` groups the flags in --help and picks the keys a script takes."""
    extra = {"section": section} | ({"flag": flag} if flag else {})
    return Field(default, description=help, json_schema_extra=extra, **range_)


class BoxSpec(BaseModel):
    """One box of a deployment's ``boxes``: its memory and the wired limit set on it."""

    model_config = ConfigDict(extra="forbid")

    memory_gib: float = Field(gt=0, allow_inf_nan=False)  # 512 for a "512 GB" M3 Ultra
    # sysctl iogpu.wired_limit_mb as set on that Mac; None: memory - 24 GiB
    wired_limit_mb: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _wired_within_memory(self) -> BoxSpec:
        if self.wired_limit_mb is not None and self.wired_limit_mb > self.memory_gib * 1024:
            raise ValueError(
                f"wired_limit_mb {self.wired_limit_mb} is more than the box's "
                f"{self.memory_gib:g} GiB ({int(self.memory_gib * 1024)} MB)"
            )
        return self


class Deployment(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    # -- the build and its rank folders --
    build: str = _key(
        "runs/mini-build",
        "MLX build folder (k3dist.pipeline.convert output) or Moonshot-format source to slice",
        "build",
    )
    size: int = _key(2, "number of ranks", "build", ge=1)
    placement_counts: str | None = _key(
        None, "routing counts (.npz / .json) for a load-aware placement; none: contiguous", "build"
    )
    boxes: list[BoxSpec] | None = _key(
        None,
        "each box's memory in GiB, one per rank in rank order (e.g. 512,256,256), each "
        "optionally with the iogpu.wired_limit_mb set on it (512,256:237568,256; in YAML "
        "also {memory_gib: 256, wired_limit_mb: 237568}; default memory - 24 GiB): "
        "routed experts placed per layer in proportion to what each box has left after its "
        "non-expert bytes (k3dist.format.placement.split_by_memory; k3dist-plan "
        "--deployment plans for these boxes); rank folders are sliced for one list of "
        "memories and refused under another; none: equal counts",
        "build",
    )
    # -- one rank's model --
    rank_dir: str = _key(
        "runs/ranks/rank{rank}", "per-rank folders; {rank} is replaced by the rank", "rank"
    )
    dtype: Literal[DTYPES] = _key(
        "float32",
        "compute dtype: float32 on CPU (bf16 matmuls are ~10x slower there), bfloat16 on Metal",
        "rank",
    )
    moe_form: Literal[("auto", *MOE_FORMS)] = _key(
        "auto",
        "how non-owned (token, expert) pairs are handled: placeholder (sync-free), "
        "local (one host sync per MoE layer, only owned pairs computed), phased (placeholder "
        "for decode steps, local for prefill chunks) or auto: phased on Metal (the calibrated "
        "table's choice, docs/speed.md), local on CPU (benchmarks/speed/moe_step.py measured it "
        "faster)",
        "rank",
    )
    attention: Literal[ATTENTION_MODES] = _key(
        "split",
        "attention across ranks: split (each rank holds and computes its share of "
        "the heads of every layer whose heads divide evenly, one all_sum per layer) or "
        "replicated (every rank all of it); one rank: always replicated; rank folders are "
        "sliced for one mode",
        "rank",
    )
    blas_threads: int | None = _key(
        None,
        "OpenBLAS threads per rank (Linux CPU); none leaves "
        "OpenBLAS's default (all cores), which oversubscribes a "
        "box that runs several ranks",
        "rank",
        ge=1,
    )
    ring_connect_s: float = _key(
        RING_CONNECT_S,
        "how long a rank keeps trying to join the group: MLX's ring backend gives up on "
        "a peer that is not yet listening after ~30 s, and a rank that starts late (a "
        "loaded machine, a second Mac slower to start) is tried again up to this bound",
        "rank",
        ge=0,
    )
    verify: Literal[VERIFY_MODES] = _key(
        "stamp",
        "rank-folder content check before loading (k3dist.format.verify): stamp "
        "hashes only files whose stat changed since they last matched, full every file, "
        "size none",
        "rank",
    )
    # -- serving (launch/serve.py) --
    host: str = _key("127.0.0.1", "address the API listens on", "serving")
    port: int = _key(8080, "port the API listens on (rank 0)", "serving", ge=1, le=65535)
    model_id: str = _key(
        "kimi-k3", "the served model name (requests for another get 404)", "serving"
    )
    max_context: int = _key(
        4096,
        "prompt + completion tokens a request may use; longer prompts get a 400 at once",
        "serving",
        ge=1,
    )
    prefill_chunk: int = _key(
        256,
        "prefill runs in power-of-two chunks up to this; all of them are warmed up",
        "serving",
        ge=1,
    )
    max_tokens: int = _key(512, "completion tokens of a request that names none", "serving", ge=1)
    max_batch: int = _key(
        8,
        "concurrent requests decoded together, in lockstep on every rank "
        "(mlx-lm's BatchGenerator); every batch size up to it is warmed up; "
        "more wait (up to max_queued_requests); 1: one at a time",
        "serving",
        ge=1,
        le=MAX_BATCH,
    )
    temperature: float = _key(
        0.0, "sampling temperature of a request that names none", "serving", ge=0
    )
    keepalive_s: float = _key(
        5.0,
        "a streamed request with nothing to send for this long (its prefill, a wait "
        "for the loop) gets a keep-alive in its API's form: Anthropic ping, Responses "
        "response.in_progress, an SSE comment on chat/completions (docs/agents.md)",
        "serving",
        gt=0,
        le=60,
    )
    top_p: float = _key(1.0, "top-p of a request that names none", "serving", gt=0, le=1)
    warmup: bool = _key(
        True,
        "warm up every prefill chunk and decode batch shape before "
        "serving (--no-warmup: tests only)",
        "serving",
    )
    metrics: bool = _key(
        True,
        "count requests, tokens, latencies, memory and sampled expert routes for "
        "GET /metrics and the /status page (--no-metrics: off, for benchmarks)",
        "serving",
    )
    token_log: str | None = _key(
        None, "per-rank JSONL of generated tokens ({rank} allowed); none: off", "serving"
    )
    heartbeat_s: float = _key(
        5.0, "seconds between device keep-awake ops (side stream) while idle", "serving", gt=0
    )
    watchdog_timeout_s: float = _key(
        10.0,
        "side-channel peer watchdog: a silent peer is declared lost after this many seconds",
        "serving",
        gt=0,
    )
    stop_with_launcher: bool = _key(
        True,
        "stop every rank when this rank's launcher (its "
        "parent process) exits: killing mlx.launch alone would "
        "otherwise leave the ranks serving, orphaned",
        "serving",
    )
    watchdog_port: int | None = _key(
        None,
        "port of rank 0's watchdog listener; none: first ring port + 1000",
        "serving",
        ge=1,
        le=65535,
    )
    # The K3 cache: 24 MLA layers keep 576 values x 2 B = 27,648 B/token (128K tokens:
    # 3.6 GB), 69 KDA layers a fixed 0.45 GB state (0.22 GB a rank, attention split); a
    # 256-token chunk at 128K: 10.0 GB a rank. deploy/tb5.yaml: 44 for 4 requests at 128K
    # (40.1 GB needed: the batch-join copy, 15.4 GB, outgrows its 256-token chunks). The
    # mini-K3 at these defaults needs 74 MB (float32).
    memory_headroom_gib: float = _key(
        2.0,
        "GiB (2^30 B) kept beside the weights: start only if the folder fits in free memory with "
        "this much to spare, and only if this holds the KV cache and state of max_batch "
        "requests at max_context tokens plus the prompt cache's bound and the larger of the "
        "activations of one prefill_chunk at max_context and the copy of the batch's caches a "
        "joining prompt makes (k3dist.serve.preflight)",
        "serving",
        ge=0,
    )
    max_queued_requests: int = _key(
        64,
        "completions in flight (queued or generating); past "
        "this a request gets 429 with Retry-After",
        "serving",
        ge=1,
    )
    max_connections: int = _key(
        2048,
        "HTTP handler threads; further connections wait in the listen backlog (1024)",
        "serving",
        ge=1,
    )
    cors_origins: list[str] = _key(
        [],
        "an origin web pages may call the API from ('*': any); repeatable; none: no CORS headers",
        "serving",
        flag="--cors-origin",
    )
    prompt_cache_tokens: int | None = _key(
        None,
        "tokens the prompt cache may hold (reused across turns); none: 4 x max_context. "
        "The newest entry is always kept, so it holds up to max(this, max_context)",
        "serving",
        ge=1,
    )
    # -- images (k3dist.serve.vision; needs pip install 'k3dist[vision]') --
    vision: bool = _key(
        False,
        "serve image_url parts of chat requests: the tower runs on "
        "rank 0 (pip install 'k3dist[vision]')",
        "images",
    )
    max_images: int = _key(4, "images a request may hold", "images", ge=0)
    # The default keeps the vision tower's running peak within memory_headroom_gib (2 GiB):
    # measured (benchmarks/memory/vision_memory.py --activations) 1.48 GB at 64x64 patches with
    # the real tower's width on CPU float32, where attention's scores grow as patches^2
    # (48.5 B per patch pair); 1008x1008 px (5,184 patches) fits, 4096x4096 would take
    # ~219 GB
    max_image_pixels: int = _key(
        1008 * 1008,
        "decoded pixels per image, checked from the header before decoding",
        "images",
        ge=1,
    )
    image_dir: str | None = _key(
        None, "local image paths are read only under this directory; none: data URLs only", "images"
    )
    # -- access --
    api_key: str | None = _key(
        None,
        "API key every endpoint but /health asks for "
        "(Authorization: Bearer / x-api-key); prefer api_key_file: a "
        "flag shows in ps and shell history",
        "access",
    )
    api_key_file: str | None = _key(None, "a file holding the API key (first line)", "access")
    allow_no_api_key: bool = _key(
        False,
        "serve a non-loopback host with no API key anyway "
        "(refused otherwise: anyone who can reach the port could "
        "use the model); only on a trusted network",
        "access",
    )
    # -- prefix caches on disk (k3dist.serve.prefix_store): survive restarts --
    prefix_cache_dir: str | None = _key(
        None,
        "folder of per-rank prefix caches (a chat's system prompt + tools, and each "
        "prompt's snapshot), restored after a restart; none: memory only. On two boxes each "
        "needs this path on its own disk",
        "prefix cache",
    )
    prefix_cache_gb: float = _key(
        20.0,
        "GB (1e9 B) each rank's prefix folder may hold (least recently used entries go first)",
        "prefix cache",
        gt=0,
    )
    prefix_cache_min_tokens: int = _key(
        1024,
        "shorter prefixes are not written (prefilling them again is cheap)",
        "prefix cache",
        ge=1,
    )
    prefix_cache_preload_gb: float = _key(
        2.0,
        "GB (1e9 B) of the most recently used prefix entries each rank loads into memory "
        "at start, before the first request (a restarted server's first matching turn is "
        "then a memory hit); 0: restored from disk at the first matching turn",
        "prefix cache",
        ge=0,
    )
    prefix_cache_drain_s: float = _key(
        3.0,
        "a stop (SIGTERM) waits at most this many seconds for each rank's queued prefix "
        "writes, then exits anyway (what is unwritten is swept at the next start); keep "
        "it under the supervisor's --grace-s",
        "prefix cache",
        ge=0,
        le=300,
    )

    @field_validator("prefill_chunk")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(
                f"must be a power of two (e.g. {1 << (v.bit_length() - 1)} or "
                f"{1 << v.bit_length()})"
            )
        return v

    @field_validator("boxes", mode="before")
    @classmethod
    def _box_list(cls, v: Any) -> Any:
        """``512,256:237568,256`` (a flag, or YAML's string) or a list of numbers, such
        strings or mappings; repeated flags append."""
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list):
            return v
        from k3dist.config.box import box_item  # the planner's parser: not at serving import

        items = [p for x in v for p in (x.split(",") if isinstance(x, str) else [x])]
        return [box_item(x) for x in items if not isinstance(x, str) or x.strip()]

    @field_validator("boxes")
    @classmethod
    def _not_empty(cls, v: list[BoxSpec] | None) -> list[BoxSpec] | None:
        if v is not None and not v:
            raise ValueError("boxes must name one box per rank")
        return v

    @model_validator(mode="after")
    def _one_key_source(self) -> Deployment:
        if self.api_key and self.api_key_file:
            raise ValueError("give api_key or api_key_file, not both")
        return self

    @model_validator(mode="after")
    def _size_of_boxes(self) -> Deployment:
        """``boxes`` names the ranks: ``size`` follows it, or must agree when given."""
        if self.boxes is not None and len(self.boxes) != self.size:
            if "size" in self.model_fields_set:
                raise ValueError(
                    f"size is {self.size} but boxes names {len(self.boxes)} boxes "
                    f"({', '.join(f'{b:g}' for b in self.box_gib or [])}); give size "
                    f"{len(self.boxes)} (--size {len(self.boxes)}) or one box per rank"
                )
            self.size = len(self.boxes)
        return self

    @property
    def box_gib(self) -> list[float] | None:
        """Each box's memory (GiB), rank order: what rank folders are placed by and the
        loader checks (the wired limits shape the plan, not the placement's shares)."""
        return None if self.boxes is None else [b.memory_gib for b in self.boxes]

    def box_list(self) -> tuple[Box, ...] | None:
        """The boxes as the planner takes them (``k3dist.config.box.Box``, rank order)."""
        from k3dist.config.box import parse_boxes

        return None if self.boxes is None else parse_boxes([b.model_dump() for b in self.boxes])

    def rank_path(self, rank: int) -> Path:
        return Path(self.rank_dir.format(rank=rank))

    def to_dict(self) -> dict:
        return self.model_dump()


FIELDS = Deployment.model_fields


def keys(*sections: str) -> tuple[str, ...]:
    """The keys of these sections (all of them with none), in definition order."""
    return tuple(
        k for k, f in FIELDS.items() if not sections or f.json_schema_extra["section"] in sections
    )


def flag(key: str) -> str:
    return FIELDS[key].json_schema_extra.get("flag") or "--" + key.replace("_", "-")


def allowed(key: str) -> str:
    """What a key may hold, in words: its choices or its range."""
    f = FIELDS[key]
    choices = _choices(f.annotation)
    if choices:
        return ", ".join(choices[:-1]) + " or " + choices[-1]
    bounds = []
    for m in f.metadata:
        if isinstance(m, Ge):
            bounds.append(f"at least {m.ge}")
        elif isinstance(m, Gt):
            bounds.append(f"more than {m.gt}")
        elif isinstance(m, Le):
            bounds.append(f"at most {m.le}")
    kind = _scalar(f.annotation)
    name = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        list: {float: "a list of numbers", BoxSpec: "a list of boxes (GiB[:wired_limit_mb])"}.get(
            _items(f.annotation), "a list of strings"
        ),
    }[kind]
    return (
        name
        + (" " + " and ".join(bounds) if bounds else "")
        + (", or null" if _optional(f.annotation) else "")
    )


def _optional(annotation: Any) -> bool:
    return type(None) in get_args(annotation)


def _items(annotation: Any) -> type | None:
    """The item type of a list key (``list[float] | None`` -> float), else None."""
    for a in (annotation, *get_args(annotation)):
        if get_origin(a) is list:
            return get_args(a)[0]
    return None


def _choices(annotation: Any) -> tuple[str, ...]:
    return get_args(annotation) if get_origin(annotation) is Literal else ()


def _scalar(annotation: Any) -> type:
    """What a flag parses: str for choices, list for a list of strings, else the type
    (without None)."""
    if get_origin(annotation) in (Literal, list):
        return str if get_origin(annotation) is Literal else list
    args = [a for a in get_args(annotation) if a is not type(None)]
    if args and get_origin(args[0]) is list:  # an optional list
        return list
    return args[0] if args else annotation


_SAID = {"literal_error", "greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _message(e: ValidationError, path: Path | None, flags: dict[str, Any]) -> str:
    """Each error: where (the file or the flag), the key and its value, what is allowed,
    and the fix."""
    lines = []
    for err in e.errors():
        # range and choice errors say no more than allowed(); the others (a type, a
        # power of two) add what was wrong
        why = "" if err["type"] in _SAID else f" ({err['msg'].removeprefix('Value error, ')})"
        key = str(err["loc"][0]) if err["loc"] else None
        if key is None:  # a check across keys
            where = f"{path} and flags" if path and flags else (path or "flags")
            lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        elif err["type"] == "extra_forbidden" and len(err["loc"]) > 1:  # inside an item
            lines.append(
                f"{path or 'flags'}: {key} item {err['loc'][1]}: unknown setting "
                f"{err['loc'][-1]!r}; known: {', '.join(BoxSpec.model_fields)}"
            )
        elif err["type"] == "extra_forbidden":
            near = difflib.get_close_matches(key, FIELDS, n=1)
            lines.append(
                f"{path}: unknown setting {key!r}"
                + (f" (did you mean {near[0]!r}?)" if near else "")
                + f"; known: {', '.join(FIELDS)}"
            )
        elif key in flags:
            lines.append(
                f"{flag(key)} {err['input']!r}: {key} must be {allowed(key)}, not "
                f"{err['input']!r}{why}; give {flag(key)} such a value"
            )
        else:
            lines.append(
                f"{path or 'the default deployment'}: {key} must be {allowed(key)}, "
                f"not {err['input']!r}{why}; set {key} in "
                f"{path or 'a deployment YAML'} to such a value, or give {flag(key)}"
            )
    return "\n".join(lines)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"deployment file {path} does not exist; give --config an "
            f"existing YAML (e.g. {DEFAULT_DEPLOYMENT})"
        )
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise DeploymentError(
            f"{path}: expected a mapping of settings (key: value lines), "
            f"got {type(values).__name__}"
        )
    return values


def load_deployment(path: str | Path | None = None, **overrides: Any) -> Deployment:
    """The YAML at ``path`` (if any), then ``overrides`` (flags) that are not None on
    top. DeploymentError (a ValueError) names the file or flag, key, range and fix."""
    path = Path(path) if path is not None else None
    values = _renamed(read_yaml(path), str(path)) if path is not None else {}
    flags = _renamed({k: v for k, v in overrides.items() if v is not None}, "flags")
    if "boxes" in flags and "size" not in flags:  # --boxes names the ranks the YAML's size did
        values.pop("size", None)
    try:
        return Deployment(**{**values, **flags})
    except ValidationError as e:
        raise DeploymentError(_message(e, path, flags)) from None


# ----------------------------------------------------------------------------- flags


def add_arguments(
    parser: argparse.ArgumentParser,
    keys_: tuple[str, ...] | None = None,
    names: dict[str, str] | None = None,
) -> None:
    """``--config`` and one flag per deployment key in ``keys_`` (all with None), with the
    key's type, choices and help; ``names`` renames a key's flag (``{"rank_dir":
    "--out"}``). Every flag defaults to None: an absent flag leaves the YAML's value."""
    parser.add_argument(
        "--config",
        help=f"deployment YAML (default {DEFAULT_DEPLOYMENT} "
        "if it exists); flags override its keys",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key in keys_ or keys():
        f = FIELDS[key]
        section = f.json_schema_extra["section"]
        group = groups.get(section) or groups.setdefault(
            section, parser.add_argument_group(f"deployment: {section}")
        )
        notes = [allowed(key)] if f.metadata else []  # a range (choices show anyway)
        notes += [] if f.default in (None, []) else [f"default {f.default}"]
        suffix = f" ({'; '.join(notes)})" if notes else ""
        kw: dict[str, Any] = {
            "dest": key,
            "default": None,
            "help": (f.description + suffix).replace("%", "%%"),
        }
        kind = _scalar(f.annotation)
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif kind is list:
            kw.update(action="append", type=str)
        elif _choices(f.annotation):
            kw["choices"] = _choices(f.annotation)
        else:
            kw.update(type=kind, metavar=key.upper())
        group.add_argument((names or {}).get(key, flag(key)), **kw)
        for old in (o for o, n in RENAMED.items() if n == key):  # still read, with a notice
            group.add_argument(
                flag(key).replace(key.replace("_", "-"), old.replace("_", "-")),
                **(kw | {"dest": old, "help": argparse.SUPPRESS}),
            )


def from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, keys_: tuple[str, ...] | None = None
) -> Deployment:
    """The deployment of ``--config`` (or deploy/local.yaml when it exists) with the
    flags in ``keys_`` on top; a bad value ends the command with the parser's error."""
    path = args.config or (DEFAULT_DEPLOYMENT if DEFAULT_DEPLOYMENT.exists() else None)
    try:
        given = {k: getattr(args, k) for k in keys_ or keys()}
        given |= {old: getattr(args, old) for old in RENAMED if hasattr(args, old)}
        return load_deployment(path, **given)
    except (DeploymentError, FileNotFoundError) as e:
        parser.error(str(e))


def add_renamed_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: str, **kw: Any
) -> None:
    """Flag ``new`` (``kw``: its add_argument keywords, ``dest`` included) and, for one
    release, its old name ``old``: hidden from --help, same value, a notice on stderr."""

    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(
                f"{parser.prog}: {old} is deprecated, it is now {new} (same value); use {new}",
                file=sys.stderr,
                flush=True,
            )
            setattr(namespace, self.dest, values)

    parser.add_argument(new, **kw)
    parser.add_argument(
        old,
        dest=kw["dest"],
        type=kw.get("type"),
        action=Renamed,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
