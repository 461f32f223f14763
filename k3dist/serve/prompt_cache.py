"""Prompt reuse across turns, the same on every rank.

mlx-lm's ``LRUPromptCache`` keeps the cache of each finished request under its prompt
plus generated tokens. K3's KDA layers keep a recurrent state (``ArraysCache``), which
cannot be trimmed back: a cached entry is reusable only when its tokens are an exact
prefix of the new prompt (mlx-lm then prefills the rest). A resent conversation rarely
extends prompt + generated tokens exactly (the template renders the assistant turn
its own way), so this cache also keeps a copy taken when the prefill reaches the
prompt's last token but one: that prefix is what the next turn's prompt starts with.
The last token is left out so that an identical prompt still has a token to prefill.
That copy is taken on mlx-lm's single path (``stream_generate`` fills the request's own
cache list); on the batch path mlx-lm keeps the same point itself (``insert_segments``
splits off the last token, and the segment before it is extracted from the batch's
cache), while the request's own list is never filled there, so no copy is taken
(``k3dist.serve.lockstep``): before, every batched request logged "prefill copy of N
tokens holds M: not kept". A turn that appends a second user message without an
assistant turn between (``benchmarks/agents/agent_clients.py``'s warm session) diverges from
the previous prompt inside its generation header (``<|open|>response<|sep|>`` ...), so
only the system segment is reused there; a real next turn (assistant reply, then user)
extends the previous prompt and reuses all of it but its last token.

Lockstep: every rank runs the same requests through the same cache, so each decision
(hit, miss, what to evict) must depend only on the request stream. Eviction is by entry
count and by the tokens the entries hold (``max_tokens``), never by bytes
(``max_bytes`` is left unlimited): per-rank bytes differ when a rank holds a share of
the attention heads. Memory is bounded through tokens and entries
(``k3dist.format.kvmemory``, which preflight checks against ``memory_headroom_gib``): K3's
MLA layers keep 27,648 B/token, so 4 x 4,096 tokens is ~0.45 GB per rank, 4 x 128K
~14.5 GB; every entry also holds a whole KDA state (0.45 GB, 0.22 GB a rank with attention
split), up to 8 entries and one more while it is inserted.

A request whose client went away during its prefill leaves what its prefill did as an
entry (``keep_abandoned``, called by ``k3dist.serve.lockstep`` at the same chunk on every
rank): the tokens of the whole chunks processed, kept as a ``user`` entry, so the
client's retry of the same prompt, or a longer one that starts with it, prefills only
the rest (at most one chunk of the work done is lost: the one in flight when the ranks
stopped). An abandoned entry that a later entry extends is dropped: the retry that
resumed from it holds all of it. The same bounds and eviction apply as to any entry;
the store (below) takes it when it is long enough, so a restart mid-prefill resumes too.

Segments (``segment_system``): mlx-lm cuts a chat's prompt into segments whose ends are
kept (system prompt and tools as a ``system`` entry, the rest but the generation header as
``user``) only when the chat ends with a user message. Claude Code's default mode ends its
first turn with a ``system`` message (its environment, git status: ~3,300 tokens), and on
each of its max-token recoveries (or retries) it changes the first user message, which
comes before it: no entry ever ended before that change, and the KDA state cannot be
trimmed back to it, so each recovery of a 17K-token request prefilled from zero
(benchmarks/results/2026-12-05/agent-resume.json). Such a chat is cut here as mlx-lm cuts
one that ends with a user message, so its system prompt and tools are kept too. mlx-lm's
single path (``max_batch`` 1) keeps no segment at all; there the lockstep core prefills a
chat's ``system`` segment first and keeps a copy of it (``keep_system``), so both paths
reuse a chat's system prompt and tools.

With a ``store`` (``k3dist.serve.prefix_store.PrefixStore``, deployment
``prefix_cache_dir``), the prefixes mlx-lm keeps as ``system`` entries (a chat's system
prompt and tools) and this cache's ``user`` snapshots are also written to disk, and a
prompt whose memory hit is shorter than a stored prefix (after a restart: all of them)
restores it, every rank the same or none (the store agrees across ranks).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

# Where a prompt's cached tokens came from (``K3PromptCache.last_fetch``).
MEMORY, ABANDONED, STORE = "prompt cache", "an abandoned prefill", "prefix store"


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def segment_system(tokenizer: Any, messages: list[dict], template_kwargs: dict, tokenized: tuple):
    """mlx-lm's ``_tokenize`` result (prompt, segments, types, state, vision) for a chat
    that does not end with a user message, cut as mlx-lm cuts one that does: the leading
    system messages with the tools (``system``), then the rest up to the think tag of the
    generation header (``user``), then that tail (``assistant``). Anything else (a chat
    mlx-lm cut already, one with images or no system message) is returned as it is.
    ``template_kwargs``: what the prompt was rendered with (tools included)."""
    prompt, segments, _, state, vision = tokenized
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if vision is not None or len(segments) != 1 or messages[-1]["role"] == "user":
        return tokenized
    if not 0 < n_system < len(messages):
        return tokenized
    head = tokenizer.apply_chat_template(
        messages[:n_system] + [{"role": "user", "content": ""}],
        add_generation_prompt=False,
        **{**template_kwargs, "tokenize": True},
    )
    sys_end = _common(head, prompt)
    if not 0 < sys_end < len(prompt) - 1:
        return tokenized
    tail = len(prompt)
    if tokenizer.has_thinking:  # mlx-lm's tail: a think tag in the last 11 tokens
        start = tokenizer.rfind_think_start(prompt, start=len(prompt) - 11)
        if start > sys_end:
            tail = start
    cut = [(prompt[:sys_end], "system"), (prompt[sys_end:tail], "user")]
    cut.append((prompt[tail:], "assistant"))
    cut = [(seg, kind) for seg, kind in cut if seg]
    return prompt, [seg for seg, _ in cut], [kind for _, kind in cut], state, vision


def cache_tokens(cache: list) -> int | None:
    """Tokens a model's cache list holds: its KV layers' (MLA) offset, the same in each;
    None when it has none (the KDA state alone does not say) or they differ."""
    offsets = {int(c.offset) for c in cache if hasattr(c, "offset")}
    return offsets.pop() if len(offsets) == 1 else None


class K3PromptCache(LRUPromptCache):
    def __init__(
        self, max_size: int, make_cache: Callable[[], list], max_tokens: int, store: Any = None
    ):
        super().__init__(max_size)  # no byte bound: it would differ between ranks
        self.make_cache, self.max_tokens = make_cache, max_tokens
        self.store = store  # prefix caches on disk (PrefixStore) or None
        self._current: tuple[Any, list[int], int, list] | None = None
        self._abandoned: set[tuple[int, ...]] = set()  # keys of abandoned prefills
        # the last fetch: (tokens found cached, where from: MEMORY, ABANDONED or STORE)
        self.last_fetch: tuple[int, str] | None = None

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and not rest:  # an exact hit leaves nothing to prefill
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = tokens[-1:]
            else:
                cache, rest = self._shorter(model, tokens)
        n = len(tokens) - len(rest) if cache is not None else 0
        source = ABANDONED if tuple(tokens[:n]) in self._abandoned else MEMORY
        if self.store is not None:  # every rank, every request: the store agrees
            stored, n_stored = self.store.lookup(tokens, n)
            if stored is not None:
                cache, rest, n, source = stored, tokens[n_stored:], n_stored, STORE
        if cache is None:
            cache, rest = self.make_cache(), tokens
        self._current = (model, list(tokens), len(tokens) - len(rest), cache)
        self.last_fetch = (n, source)
        return cache, rest

    def preload(self, model: Any, max_bytes: int) -> int:
        """Server start, every rank, before the first request: the store's most recently
        used entries (at most ``max_bytes`` a rank, and within this cache's own entry and
        token bounds, one entry left free for the next request) into memory as
        ``system`` entries, so a restarted server's first matching turn is a memory hit
        instead of a restore from disk. The store decides the same on every rank."""
        if self.store is None:
            return 0
        got = self.store.preload(max_bytes, self.max_size - 1, self.max_tokens)
        for tokens, cache in got:  # least recently used first
            LRUPromptCache.insert_cache(self, model, tokens, cache, cache_type="system")
        return len(got)

    def _shorter(self, model: Any, tokens: list[int]):
        """The longest entry strictly shorter than ``tokens`` that prefixes them."""
        result = self._trie.search(model, tokens[:-1])
        if result.exact is not None:
            entry = self._trie.get(result.model, result.exact)
            return copy.deepcopy(entry.prompt_cache), tokens[len(result.exact) :]
        if result.shorter:
            entry = self._trie.get(result.model, result.shorter)
            return copy.deepcopy(entry.prompt_cache), tokens[len(result.shorter) :]
        return None, tokens

    def tokens(self) -> int:
        """Tokens held by all entries (the same on every rank)."""
        return sum(len(t) for lru in self._lru._lrus.values() for _, t in lru)

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        key = tuple(tokens)
        self._abandoned.discard(key)  # whatever it was, it is now this entry
        for old in [k for k in self._abandoned if key[: len(k)] == k]:
            self._drop(model, old)  # superseded: what resumed from it holds all of it
        if self.store is not None and cache_type in ("system", "user"):
            self.store.save(list(tokens), prompt_cache)
        while len(self) > 1 and self.tokens() > self.max_tokens:
            self.trim_to(n_sequences=len(self) - 1)  # in mlx-lm's eviction order
        self._abandoned = {k for k in self._abandoned if self._holds(model, k)}

    def _holds(self, model: Any, key: tuple[int, ...]) -> bool:
        return self._trie.search(model, list(key)).exact is not None

    def _drop(self, model: Any, key: tuple[int, ...]) -> None:
        """Remove one entry (as mlx-lm's eviction removes one)."""
        self._abandoned.discard(key)
        if not self._holds(model, key):
            return
        entry = self._trie.pop(model, list(key))
        self._lru.remove(model, list(key))
        self._n_bytes -= entry.nbytes
        self._n_bytes_by_type[entry.cache_type] -= entry.nbytes

    def keep_abandoned(self, model: Any, tokens: list[int], cache: list) -> bool:
        """Keep the cache of a prefill its client abandoned: ``cache`` holds the state
        after ``tokens`` (whole chunks; the request is gone, so it is kept as it is, not
        copied). Every rank calls it at the same request and chunk; returns whether it
        was kept (the same answer on every rank)."""
        held = cache_tokens(cache)
        if not tokens or self._agreed_stale(held is not None and held != len(tokens)):
            logging.warning(
                "prompt cache: abandoned prefill of %d tokens holds %s: not kept", len(tokens), held
            )
            return False
        self.insert_cache(model, list(tokens), cache, cache_type="user")
        if self._holds(model, tuple(tokens)):
            self._abandoned.add(tuple(tokens))
        return True

    def keep_system(self, model: Any, tokens: list[int], cache: list) -> bool:
        """The single path's copy of a chat's system segment (``tokens``, which ``cache``
        holds now; every rank at the same request): kept as a ``system`` entry, as mlx-lm's
        batch path keeps it. Returns whether it was kept (the same on every rank)."""
        held = cache_tokens(cache)
        if self._agreed_stale(held is not None and held != len(tokens)):
            logging.warning(
                "prompt cache: system segment of %d tokens holds %s: not kept", len(tokens), held
            )
            return False
        self.insert_cache(model, list(tokens), copy.deepcopy(cache), cache_type="system")
        return True

    def prefill_abandoned(self, processed: int) -> None:
        """The single path's abandoned prefill (``processed`` tokens past the cache hit,
        every rank at the same chunk): its own cache list, which the prefill filled."""
        if self._current is None or processed <= 0:
            return
        model, tokens, start, cache = self._current
        self._current = None
        if start + processed < len(tokens):
            self.keep_abandoned(model, tokens[: start + processed], cache)

    @staticmethod
    def _agreed_stale(stale: bool) -> bool:
        """Whether any rank found its copy stale (every rank keeps a copy or none does)."""
        group = mx.distributed.init()
        if group.size() > 1:
            return mx.distributed.all_sum(mx.array(int(stale)), group=group).item() > 0
        return stale

    def prefill_progress(self, processed: int, total: int) -> None:
        """mlx-lm's prompt progress: at the last token but one, keep a copy of the cache
        under the prompt's prefix (each rank at the same request and token)."""
        if self._current is None or total < 2 or processed != total - 1:
            return
        model, tokens, start, cache = self._current
        self._current = None
        held = cache_tokens(cache)
        if self._agreed_stale(held is not None and held != start + processed):
            # the request's cache object did not follow the prefill (seen on the batch
            # path: 4,044 tokens holding 4,014, or 0): kept under these tokens it would
            # serve a later prompt with tokens skipped
            logging.warning(
                "prompt cache: prefill copy of %d tokens holds %s: not kept",
                start + processed,
                held,
            )
            return
        self.insert_cache(
            model, tokens[: start + processed], copy.deepcopy(cache), cache_type="user"
        )
