"""Deployment settings: read once from YAML/flags at the edge, passed down as a
dataclass. Nothing below the entry points reads files or the environment for them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from k3dist.model.forms import MOE_FORMS  # noqa: F401 (read by launch/ through here)

import yaml

DEFAULT_DEPLOYMENT = Path("deploy/local.yaml")
# how attention is laid out across ranks (k3dist.format.layout.split_layers)
ATTENTION_MODES = ("split", "replicated")
# compute dtypes a deployment may ask for (MLX names)
DTYPES = ("float32", "bfloat16", "float16")
# largest max_batch: each batch size up to it is one warm-up decode shape
MAX_BATCH = 256


@dataclass
class Deployment:
    # MLX build folder (k3dist.build.convert output) or Moonshot-format source to slice
    build: str = "runs/mini-build"
    # per-rank folders; "{rank}" is replaced by the rank
    rank_dir: str = "runs/ranks/rank{rank}"
    size: int = 2
    # routing counts (.npz / .json) for a load-aware placement; None: contiguous
    placement_counts: str | None = None
    # compute dtype: float32 on CPU (bf16 matmuls are ~10x slower there), bfloat16 on Metal
    dtype: str = "float32"
    # how non-owned (token, expert) pairs are handled: "placeholder" (sync-free),
    # "local" (host sync per MoE layer, only owned pairs computed) or "auto":
    # placeholder on Metal, local on CPU (benchmarks/moe_step.py measured it faster)
    moe_form: str = "auto"
    # attention across ranks: "split" (each rank holds and computes its share of the
    # heads of every layer whose heads divide evenly, plus one all_sum per layer) or
    # "replicated" (every rank all of it). One rank: always replicated. Rank folders
    # are sliced for one mode (slicing/rank_split.py --attention)
    attention: str = "split"
    # OpenBLAS threads per rank (Linux CPU); None leaves OpenBLAS's default (all cores),
    # which oversubscribes a box that runs several ranks
    blas_threads: int | None = None
    # rank-folder content check before serving (k3dist.format.verify): "stamp" hashes only
    # files whose stat changed since they last matched, "full" every file, "size" none
    verify: str = "stamp"
    # -- serving (launch/serve.py) --
    host: str = "127.0.0.1"
    port: int = 8080
    model_id: str = "kimi-k3"
    # prompt + completion tokens a request may use; longer prompts get a 400 at once
    max_context: int = 4096
    # prefill runs in power-of-two chunks up to this; all of them are warmed up
    prefill_chunk: int = 256
    max_tokens: int = 512
    # concurrent requests decoded together, in lockstep on every rank (mlx-lm's
    # BatchGenerator); every batch size 1..max_batch is warmed up. More requests wait
    # (up to max_queued_requests in flight). 1: one request at a time.
    max_batch: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    warmup: bool = True
    # per-rank JSONL of generated tokens ("{rank}" allowed); None: off
    token_log: str | None = None
    # device keep-awake op (side stream) while idle
    heartbeat_s: float = 5.0
    # side-channel peer watchdog: a silent peer is declared lost after this long
    watchdog_timeout_s: float = 10.0
    # stop every rank when this rank's launcher (its parent process) exits: killing
    # mlx.launch alone would otherwise leave the ranks serving, orphaned
    stop_with_launcher: bool = True
    # port of rank 0's watchdog listener; None: first ring port + 1000
    watchdog_port: int | None = None
    # GiB kept beside the weights: start only if the folder fits in free memory with this
    # much to spare, and only if this holds the KV cache and state of max_batch requests
    # at max_context tokens plus the prompt cache's bound and the activations of one
    # prefill_chunk at max_context, or the copy of the batch's caches a joining prompt makes
    # if that is larger (k3dist.serve.preflight, k3dist.format.kvmemory.need_bytes). The
    # K3 cache: 24 MLA layers keep 576 values x 2 B = 27,648 B/token (128K tokens: 3.6 GB),
    # 69 KDA layers a fixed 0.45 GB state (0.22 GB a rank, attention split); a 256-token
    # chunk at 128K: 10.0 GB a rank. deploy/tb5.yaml: 44 for 4 requests at 128K (40.1 GB
    # needed: the batch-join copy, 15.4 GB, outgrows its 256-token chunks). The mini-K3 at
    # these defaults needs 74 MB (float32).
    memory_headroom_gb: float = 2.0
    # completions in flight (queued or generating); past this a request gets 429 with
    # Retry-After instead of waiting
    max_queued_requests: int = 64
    # HTTP handler threads; further connections wait in the listen backlog (1024)
    max_connections: int = 2048
    # origins a web page may call the API from ("*": any); empty: no CORS headers
    cors_origins: list[str] = field(default_factory=list)
    # -- images (k3dist.serve.vision; needs pip install 'k3dist[vision]') --
    # serve image_url parts of chat requests: the tower runs on rank 0
    vision: bool = False
    max_images: int = 4
    # decoded pixels per image, checked from the header before decoding. The default
    # keeps the vision tower's running peak within memory_headroom_gb (2 GB): measured
    # (benchmarks/vision_memory.py --activations) 1.48 GB at 64x64 patches with the
    # real tower's width on CPU float32, where attention's scores grow as patches^2
    # (48.5 B per patch pair); 1008x1008 px (5,184 patches) fits, the old 4096x4096
    # would take ~219 GB
    max_image_pixels: int = 1008 * 1008
    # local image paths are read only under this directory; None: data URLs only
    image_dir: str | None = None
    # -- access --
    # API key every endpoint but /health asks for (Authorization: Bearer / x-api-key);
    # a file holding it (first line) keeps it out of `ps` and shell history: prefer it
    api_key: str | None = None
    api_key_file: str | None = None
    # serve a non-loopback host with no API key anyway (launch/serve.py refuses otherwise:
    # anyone who can reach the port could use the model); say so only on a trusted network
    allow_no_api_key: bool = False
    # tokens the prompt cache may hold (reused across turns); None: 4 x max_context. The
    # newest entry is always kept, so it holds up to max(this, max_context) tokens
    prompt_cache_tokens: int | None = None
    # -- prefix caches on disk (k3dist.serve.prefix_store): survive restarts --
    # folder of per-rank prefix caches (a chat's system prompt + tools, and each prompt's
    # snapshot), restored after a restart; None: memory only. Each rank writes its own
    # subfolder; on two boxes each box needs this path on its own disk
    prefix_cache_dir: str | None = None
    # GB (1e9 B) each rank's folder may hold (least recently used entries go first)
    prefix_cache_gb: float = 20.0
    # shorter prefixes are not written (prefilling them again is cheap)
    prefix_cache_min_tokens: int = 1024

    def rank_path(self, rank: int) -> Path:
        return Path(self.rank_dir.format(rank=rank))

    def to_dict(self) -> dict:
        return asdict(self)


def load_deployment(path: str | Path | None = None, **overrides) -> Deployment:
    """YAML (if any) then flags (``overrides`` that are not None) on top."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"deployment file {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of settings, got {type(values)}")
        known = {f.name for f in fields(Deployment)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    d = Deployment(**values)
    if d.moe_form not in ("auto", *MOE_FORMS):
        raise ValueError(f"moe_form must be auto, placeholder or local, not {d.moe_form!r}")
    if d.attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be split or replicated, not {d.attention!r}")
    if d.verify not in ("stamp", "full", "size"):
        raise ValueError(f"verify must be stamp, full or size, not {d.verify!r}")
    if d.max_queued_requests < 1 or d.max_connections < 1:
        raise ValueError(f"max_queued_requests ({d.max_queued_requests}) and max_connections "
                         f"({d.max_connections}) must be at least 1")
    if not 1 <= d.max_batch <= MAX_BATCH:
        raise ValueError(f"max_batch must be 1 to {MAX_BATCH}, not {d.max_batch} (every "
                         "batch size up to it is warmed up before serving)")
    if not isinstance(d.cors_origins, list) or not all(isinstance(o, str)
                                                       for o in d.cors_origins):
        raise ValueError(f"cors_origins must be a list of origins, not {d.cors_origins!r}")
    if d.api_key and d.api_key_file:
        raise ValueError("give api_key or api_key_file, not both")
    if d.prefix_cache_dir is not None and not (d.prefix_cache_gb > 0
                                                and d.prefix_cache_min_tokens >= 1):
        raise ValueError(f"prefix_cache_gb ({d.prefix_cache_gb}) must be positive and "
                         f"prefix_cache_min_tokens ({d.prefix_cache_min_tokens}) at least 1")
    if d.dtype not in DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, not {d.dtype!r}")
    return d
