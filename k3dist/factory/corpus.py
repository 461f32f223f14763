"""The mini-K3 training corpus: real, redistributable text that exists offline here.

Two labelled domains, both from this interpreter's own files (CPython 3.11.7, PSF licence):

* ``code``  — every top-level standard-library module (``lib/python3.11/*.py``), verbatim;
* ``prose`` — English: the docstrings of those modules (module, classes, functions,
  ``ast.get_docstring`` cleaned), and the 79 Python Language Reference topics shipped in
  ``pydoc_data/topics.py`` (the text ``help("assert")`` prints).

Split **by document group** into ``train`` / ``calib`` / ``eval``: a module's code and its
docstrings form one group and always land in the same split, so no held-out text was seen
in training through the other domain. Groups are ordered by a salted SHA-256 of their
name and dealt greedily until each split holds its byte share of every domain it touches;
the result depends on nothing but the texts. ``eval`` is held out: never used for
training, calibration or DWQ (``train.py`` reads ``train`` only).

The built corpus is committed as ``data/corpus/corpus.jsonl.xz`` (one document a line)
with ``manifest.json`` (counts, bytes, tokens, digest), so a checkout needs no Python
sources to train. Rebuilding from the same interpreter reproduces it byte for byte.

    python -m k3dist.factory.corpus build              # sources -> data/corpus/
    python -m k3dist.factory.corpus tokenizer          # train split -> data/tokenizer/ (K3 layout)
    python -m k3dist.factory.corpus report             # sizes and token counts; updates manifest
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import lzma
import sys
import sysconfig
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from k3dist import DATA_DIR
from k3dist.factory import bpe
from k3dist.format import tokens as tokenizer

CORPUS_DIR = DATA_DIR / "corpus"
TOKENIZER_DIR = DATA_DIR / "tokenizer"
CORPUS_FILE = "corpus.jsonl.xz"
MANIFEST_FILE = "manifest.json"

DOMAINS = ("code", "prose")
SPLITS = ("train", "calib", "eval")
# Byte share of each domain per split; train takes the rest.
FRACTIONS = {"eval": 0.08, "calib": 0.08}
SALT = "k3dist-corpus-v1"
BASE_VOCAB = 4096  # + 256 control tokens = 4352 ids


@dataclass(frozen=True)
class Document:
    id: str  # unique: "<domain>:<source>"
    group: str  # split unit: documents of one group share a split
    domain: str  # "code" | "prose"
    split: str  # "train" | "calib" | "eval"
    source: str  # path under the interpreter's lib dir (+ "#topic")
    text: str


# ----------------------------------------------------------------------------- build


def stdlib_dir() -> Path:
    """This interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _docstrings(src: str) -> str:
    """Module, class and function docstrings in source order, one paragraph each."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                out.append((getattr(node, "lineno", 0), doc.strip()))
    return "\n\n".join(d for _, d in sorted(out, key=lambda x: x[0])) + "\n" if out else ""


def _topics(lib: Path) -> dict[str, str]:
    """pydoc_data/topics.py's ``topics`` dict, read without importing it."""
    tree = ast.parse((lib / "pydoc_data" / "topics.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "topics":
            return ast.literal_eval(node.value)
    raise ValueError(f"{lib}/pydoc_data/topics.py: no 'topics' assignment")


def collect(lib: Path | None = None) -> list[dict]:
    """Unsplit documents (no 'split' key yet), sorted by id."""
    lib = Path(lib) if lib is not None else stdlib_dir()
    docs = []
    for path in sorted(lib.glob("*.py")):
        src = path.read_text(encoding="utf-8")
        name = path.name
        docs.append(
            dict(id=f"code:{name}", group=f"module:{name}", domain="code", source=name, text=src)
        )
        prose = _docstrings(src)
        if prose:
            docs.append(
                dict(
                    id=f"prose:{name}",
                    group=f"module:{name}",
                    domain="prose",
                    source=name,
                    text=prose,
                )
            )
    for topic, text in sorted(_topics(lib).items()):
        src = f"pydoc_data/topics.py#{topic}"
        docs.append(
            dict(id=f"prose:{src}", group=f"topic:{topic}", domain="prose", source=src, text=text)
        )
    if not docs:
        raise ValueError(f"{lib}: no *.py files; pass the interpreter's stdlib folder")
    return sorted(docs, key=lambda d: d["id"])


def assign_splits(
    docs: list[dict], fractions: dict[str, float] = FRACTIONS, salt: str = SALT
) -> list[Document]:
    """Deal whole groups to eval, then calib, until each holds its byte share of every
    domain the group touches; everything else is train. Order: salted SHA-256 of the
    group name, so the outcome depends only on the group names and texts."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for d in docs:
        groups[d["group"]].append(d)
    total = defaultdict(int)
    for d in docs:
        total[d["domain"]] += len(d["text"].encode())
    filled = {s: defaultdict(int) for s in fractions}

    def key(g: str) -> str:
        return hashlib.sha256(f"{salt}:{g}".encode()).hexdigest()

    split_of = {}
    for g in sorted(groups, key=key):
        size = defaultdict(int)
        for d in groups[g]:
            size[d["domain"]] += len(d["text"].encode())
        split_of[g] = "train"
        for s, frac in fractions.items():
            if all(filled[s][dom] < frac * total[dom] for dom in size):
                split_of[g] = s
                for dom, n in size.items():
                    filled[s][dom] += n
                break
    return [Document(split=split_of[d["group"]], **d) for d in docs]


def build(lib: Path | None = None) -> list[Document]:
    return assign_splits(collect(lib))


def _jsonl(docs: list[Document]) -> bytes:
    return "".join(json.dumps(asdict(d), ensure_ascii=False) + "\n" for d in docs).encode()


def write(docs: list[Document], out: Path = CORPUS_DIR, lib: Path | None = None) -> Path:
    """corpus.jsonl.xz (deterministic bytes) + manifest.json (no token counts yet)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = _jsonl(docs)
    (out / CORPUS_FILE).write_bytes(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    lib = Path(lib) if lib is not None else stdlib_dir()
    manifest = {
        "source": f"CPython {sys.version.split()[0]} standard library: {lib.name}/*.py "
        "and pydoc_data/topics.py",
        "licence": "PSF License Agreement for Python (LICENSE.PSF.txt)",
        "salt": SALT,
        "fractions": FRACTIONS,
        "sha256_jsonl": hashlib.sha256(raw).hexdigest(),
        "stats": stats(docs),
    }
    _write_manifest(out, manifest)
    return out / CORPUS_FILE


def _write_manifest(out: Path, manifest: dict) -> None:
    (Path(out) / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


# ----------------------------------------------------------------------------- load


def load(path: Path = CORPUS_DIR) -> list[Document]:
    """All documents of a committed corpus folder (or a corpus.jsonl.xz path)."""
    path = Path(path)
    if path.is_dir():
        path = path / CORPUS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no corpus; run `python -m k3dist.factory.corpus build`")
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [Document(**json.loads(line)) for line in f]


def load_split(split: str, domain: str | None = None, path: Path = CORPUS_DIR) -> list[Document]:
    """The documents of one split (and domain), in id order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if domain is not None and domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    return [d for d in load(path) if d.split == split and (domain is None or d.domain == domain)]


def stats(docs: list[Document], encoding=None) -> dict:
    """{split: {domain: {docs, bytes[, tokens]}}}; tokens when an encoding is given."""
    out: dict = {s: {dom: {"docs": 0, "bytes": 0} for dom in DOMAINS} for s in SPLITS}
    for d in docs:
        row = out[d.split][d.domain]
        row["docs"] += 1
        row["bytes"] += len(d.text.encode())
        if encoding is not None:
            row["tokens"] = row.get("tokens", 0) + len(encoding.encode_ordinary(d.text))
    return out


def format_stats(st: dict) -> str:
    lines = [f"{'split':<6} {'domain':<6} {'docs':>5} {'bytes':>10} {'tokens':>9} {'B/tok':>6}"]
    for s in SPLITS:
        for dom in DOMAINS:
            r = st[s][dom]
            tok = r.get("tokens")
            ratio = f"{r['bytes'] / tok:6.2f}" if tok else f"{'-':>6}"
            lines.append(
                f"{s:<6} {dom:<6} {r['docs']:>5} {r['bytes']:>10,} "
                f"{tok if tok is not None else '-':>9} {ratio}"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- tokenizer


def training_text(docs: list[Document]) -> str:
    """What the BPE sees: the train split only, documents separated by a blank line."""
    bad = sorted({d.split for d in docs} - {"train"})
    if bad:
        raise ValueError(f"tokenizer text must come from the train split only, got {bad}")
    return "\n\n".join(d.text for d in docs)


def train_tokenizer(
    docs: list[Document], out_dir: Path = TOKENIZER_DIR, vocab_size: int = BASE_VOCAB
) -> int:
    """BPE on the train documents, written in K3's layout; returns the full vocab size
    (base + 256 control tokens)."""
    ranks = bpe.train_bpe(training_text(docs), vocab_size)
    if len(ranks) != vocab_size:
        raise ValueError(f"the text supports only {len(ranks)} tokens, asked {vocab_size}")
    return tokenizer.write_tokenizer_files(Path(out_dir), ranks)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="The mini-K3 corpus (CPython stdlib, PSF).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="collect + split this interpreter's sources")
    b.add_argument("--lib", type=Path, default=None, help="stdlib folder (default: ours)")
    b.add_argument("--out", type=Path, default=CORPUS_DIR)
    t = sub.add_parser("tokenizer", help="train the BPE on the train split")
    t.add_argument("--corpus", type=Path, default=CORPUS_DIR)
    t.add_argument("--out", type=Path, default=TOKENIZER_DIR)
    t.add_argument("--vocab", type=int, default=BASE_VOCAB, help="base vocab size")
    r = sub.add_parser("report", help="docs/bytes/tokens per split and domain")
    r.add_argument("--corpus", type=Path, default=CORPUS_DIR)
    r.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR)
    args = ap.parse_args(argv)

    if args.cmd == "build":
        path = write(build(args.lib), args.out, args.lib)
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
        print(format_stats(json.loads((args.out / MANIFEST_FILE).read_text())["stats"]))
    elif args.cmd == "tokenizer":
        t0 = time.perf_counter()
        n = train_tokenizer(load_split("train", path=args.corpus), args.out, args.vocab)
        print(f"wrote {args.out} (vocab {n}) in {time.perf_counter() - t0:.1f} s")
    else:
        enc = tokenizer.load_encoding(args.tokenizer)
        st = stats(load(args.corpus), enc)
        manifest_path = Path(args.corpus) / MANIFEST_FILE
        manifest = json.loads(manifest_path.read_text())
        manifest["stats"] = st
        manifest["tokenizer_vocab"] = enc.n_vocab
        _write_manifest(args.corpus, manifest)
        print(format_stats(st))


if __name__ == "__main__":
    main()
