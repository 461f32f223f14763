"""Byte-level BPE training with K3's pre-tokenizer, for mini tokenizers in K3's layout
(``k3dist.format.tokens.write_tokenizer_files`` writes them)."""

from __future__ import annotations

import heapq
from collections import Counter

from k3dist.format.tokens import split_text


def _pairs(word: list[int]) -> Counter[tuple[int, int]]:
    return Counter(zip(word, word[1:], strict=False))


def train_bpe(text: str, vocab_size: int) -> dict[bytes, int]:
    """Deterministic byte-level BPE: bytes at ranks 0..255, then one rank per merge.

    Each step merges the most frequent adjacent pair inside K3 pre-tokenized chunks; ties
    go to the lexicographically smallest (left bytes, right bytes). Ranks follow merge
    order, so a merged token always outranks its parts, which is what tiktoken's
    lowest-rank-first merging needs to reproduce the training segmentation.
    Returns fewer than vocab_size tokens if the text runs out of pairs.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be >= 256, got {vocab_size}")
    token_bytes: list[bytes] = [bytes([b]) for b in range(256)]
    ranks: dict[bytes, int] = {tok: i for i, tok in enumerate(token_bytes)}

    # Unique chunks with counts: the work scales with distinct chunks, not text length.
    chunk_counts = Counter(split_text(text))
    words: list[list[int]] = []
    freqs: list[int] = []
    for chunk in sorted(chunk_counts):
        encoded = chunk.encode("utf-8")
        if len(encoded) > 1:
            words.append(list(encoded))
            freqs.append(chunk_counts[chunk])

    pair_count: Counter[tuple[int, int]] = Counter()
    pair_words: dict[tuple[int, int], set[int]] = {}
    for w, word in enumerate(words):
        for pair, n in _pairs(word).items():
            pair_count[pair] += n * freqs[w]
            pair_words.setdefault(pair, set()).add(w)

    # Lazy max-heap: stale entries are skipped when their count no longer matches.
    heap = [(-c, token_bytes[a], token_bytes[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)

    while len(ranks) < vocab_size and heap:
        neg, _, _, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -neg:
            continue
        merged = token_bytes[a] + token_bytes[b]
        new = ranks.get(merged)
        if new is None:  # the same bytes can be reachable by two different merges
            new = len(token_bytes)
            token_bytes.append(merged)
            ranks[merged] = new

        touched: set[tuple[int, int]] = set()
        for w in sorted(pair_words.pop((a, b), ())):
            word, freq = words[w], freqs[w]
            old_pairs = _pairs(word)
            out: list[int] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            words[w] = out
            new_pairs = _pairs(out)
            for pair in old_pairs.keys() | new_pairs.keys():
                delta = new_pairs.get(pair, 0) - old_pairs.get(pair, 0)
                if delta:
                    pair_count[pair] += delta * freq
                    touched.add(pair)
                if pair not in new_pairs:
                    pair_words.get(pair, set()).discard(w)
                elif pair not in old_pairs:
                    pair_words.setdefault(pair, set()).add(w)
        pair_count.pop((a, b), None)
        for pair in touched:
            c = pair_count.get(pair, 0)
            if c > 0:
                heapq.heappush(heap, (-c, token_bytes[pair[0]], token_bytes[pair[1]], *pair))
            else:
                pair_count.pop(pair, None)
    return ranks


def mini_tokenizer(vocab_size: int = 512) -> dict[bytes, int]:
    """Base-vocab ranks (vocab_size tokens) trained on MINI_TEXT."""
    ranks = train_bpe(MINI_TEXT, vocab_size)
    if len(ranks) != vocab_size:
        raise ValueError(f"MINI_TEXT supports only {len(ranks)} tokens, asked {vocab_size}")
    return ranks


def padded_ranks(ranks: dict[bytes, int], vocab_size: int) -> dict[bytes, int]:
    """``ranks`` grown to ``vocab_size`` tokens, each new one the concatenation of two
    earlier ones (in order, skipping those present): a valid BPE merge, so the
    tokenizer is a real one of that size (K3's 163,584 base tokens), cheap to make."""
    out = dict(ranks)
    base = sorted(ranks, key=ranks.__getitem__)
    for a in base:
        for b in base:
            if len(out) >= vocab_size:
                return out
            tok = a + b
            if tok not in out:
                out[tok] = len(out)
    if len(out) < vocab_size:
        raise ValueError(f"{len(ranks)} tokens pair up to only {len(out)}, asked {vocab_size}")
    return out


# Written for this project so mini checkpoints do not depend on any external corpus.
MINI_TEXT = '''\
The Kimi K3 model is a large mixture-of-experts language model. Each token is routed to a
small number of experts, so most of the weights stay idle for any single step. This makes it
possible to spread the experts over two machines and let each machine compute only the
experts that live in its memory. The attention layers and the shared expert run on every
machine, while the routed experts are split by index.

A tokenizer turns text into integers. Byte pair encoding starts from the 256 possible bytes
and repeatedly joins the most frequent neighbouring pair into a new token. After a few
thousand merges, common words such as "the", "model", "expert" and "token" become single
tokens, while rare words are still written as several smaller pieces. Nothing is ever lost:
every byte sequence can be encoded, and decoding the ids gives back exactly the same bytes.

When the server receives a chat request, it renders the messages into the model's own
format, encodes the result, and starts generating. Generation stops when the model emits its
end-of-message token or when the requested number of tokens has been produced. The reply is
decoded incrementally, so partial characters are held back until they are complete.

Questions we keep asking ourselves: How fast is one decoding step? Where does the time go?
Is the network the bottleneck, or the memory bandwidth? What happens when two requests
arrive at once? Can we keep both machines busy without making either one wait?

Numbers matter. A step that takes 45 ms gives about 22 tokens per second; 30 ms gives 33.
With 384 experts and 8 active per token, only 2% of the expert weights are read each step.
On 2 machines with 512 GB each, the 1,024 GB of memory holds the weights with room to spare.

def route(scores, top_k=8):
    """Return the indices and weights of the top_k experts for each token."""
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    chosen = order[:top_k]
    total = sum(scores[i] for i in chosen)
    return chosen, [scores[i] / total for i in chosen]


class ExpertShard:
    """The experts that live on one machine."""

    def __init__(self, rank: int, world_size: int, num_experts: int = 384) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local = [e for e in range(num_experts) if e % world_size == rank]

    def owns(self, expert: int) -> bool:
        return expert in self.local

    def __repr__(self) -> str:
        return f"ExpertShard(rank={self.rank}, experts={len(self.local)})"


def encode_all(tokenizer, texts):
    results = []
    for text in texts:
        ids = tokenizer.encode(text)
        if not ids:
            continue
        results.append(ids)
    return results


for step in range(10):
    loss = 1.0 / (step + 1)
    print(f"step {step:02d}: loss={loss:.4f}")

config = {
    "hidden_size": 7168,
    "num_layers": 61,
    "num_experts": 384,
    "experts_per_token": 8,
    "vocab_size": 163840,
}
if config["num_experts"] % 2 == 0:
    print("experts split evenly across two machines")
else:
    raise ValueError("odd number of experts")

try:
    with open("weights.safetensors", "rb") as f:
        header = f.read(8)
except FileNotFoundError as exc:
    print("missing weights:", exc)
finally:
    print("done")

The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! It's, they're, we've,
I'm, you'll, she'd: contractions are split the way the pre-tokenizer expects. Mixed case
such as HTTPServer, camelCase, snake_case and kebab-case shows how words are cut apart.
Punctuation runs like "...", "->", "!=", "==", "<=" and ">=" appear in code all the time,
and so do brackets: (), [], {}, and <>. Tabs\tand spaces   both count as whitespace.

In short: keep the tokenizer small, deterministic and faithful to the real layout, so that
every test exercises the same code path the full model will use.
'''
