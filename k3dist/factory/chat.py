"""Chats for the mini-K3's chat stage (issue 41): conversations as coding agents send them,
rendered in the model's own chat template, whose last assistant turn is a short answer
that ends its message.

The pretrained mini saw only the corpus (standard-library code and docstrings): it never
saw K3's XTML tags, so it never ends a message and an agent's turn runs to its output cap.
Each chat here is drawn from the corpus, a pure function of (seed, index):

* tools: standard-library functions as function tools (name, docstring as description,
  arguments as a JSON schema), a few to twenty, the way agents declare theirs;
* system prompt: corpus prose of a random length, in one of three shapes: Claude Code's
  (system prompt, a first user message with a reminder, then a closing ``system`` message
  with the environment), Codex's (developer messages, an environment message, the task)
  or a plain chat; sometimes an earlier turn with a tool call and its result;
* the question: what a function does (sometimes with its code), or a task as agents pass
  their user's; the answer: the first sentence of that function's docstring, short
  (``MAX_ANSWER_CHARS``), after a short thought when the think channel is on.

``encode`` renders a chat with the tokenizer's ``apply_chat_template`` (the template the
server renders with) and returns its tokens and where the answer starts: the training
loss is on the answer only (its tokens, the closing tags and ``<|end_of_msg|>``, the stop
token). A chat longer than the training window keeps its last tokens.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from k3dist.factory import corpus

import numpy as np

MAX_ANSWER_CHARS = 48  # the answer, a docstring's first sentence: a few tokens
MIN_ANSWER_CHARS = 12
STYLES = ("claude", "codex", "plain")
THOUGHTS = ("Ok.", "Short answer.", "Brief.", "Answer.", "Simple.", "Yes.")
TASKS = (
    "List the files here and say what each one is for.",
    "What does this project do?",
    "Say hello.",
    "Summarize the code in one sentence.",
    "Explain this briefly.",
    "What should I look at first?",
)
QUESTIONS = (
    "What does `{name}` do?",
    "In one sentence, what is {module}.{name} for?",
    "Explain {name}.",
    "What is `{name}`?",
    "Describe {name} briefly.",
)
ENVIRONMENT = (
    "# Environment\nYou have been invoked in the following environment: \n"
    " - Primary working directory: /tmp/work{n}\n - Is a git repository: {git}\n"
    " - Platform: linux\n - Shell: bash\n"
)
CODEX_ENV = (
    "<environment_context>\n  <cwd>/tmp/work{n}</cwd>\n  <shell>bash</shell>\n"
    "</environment_context>"
)


@dataclass(frozen=True)
class Function:
    """A documented standard-library function: the answer its docstring gives."""

    module: str
    name: str
    args: tuple[str, ...]
    doc: str
    code: str
    summary: str | None  # the docstring's first sentence, when short enough


@dataclass
class Chat:
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)  # chat-template keyword arguments


def first_sentence(doc: str) -> str | None:
    """A docstring's first sentence, one line, if it is an answer's length."""
    para = " ".join(doc.strip().split("\n\n", 1)[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    text = m.group(1) if m else para
    if not MIN_ANSWER_CHARS <= len(text) <= MAX_ANSWER_CHARS or "`" in text:
        return None
    return text if text[-1] in ".!?" else text + "."


def functions(docs: list[corpus.Document]) -> list[Function]:
    """Every function with a docstring in the code documents, in corpus order."""
    out = []
    for d in docs:
        if d.domain != "code":
            continue
        try:
            tree = ast.parse(d.text)
        except SyntaxError:
            continue
        lines = d.text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node, clean=True)
            if not doc or node.name.startswith("__"):
                continue
            code = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            args = tuple(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
            out.append(Function(d.source, node.name, args, doc, code[:3000], first_sentence(doc)))
    return out


def tool_spec(f: Function, rng: np.random.Generator) -> dict:
    """``f`` as a function tool (the form the APIs translate every agent's tools to)."""
    desc = f.doc if rng.random() < 0.5 else f.doc.split("\n\n")[0]
    props = {a: {"type": "string", "description": f"The {a}."} for a in f.args[:6]}
    name = f.name if rng.random() < 0.6 else "".join(p.title() for p in f.name.split("_"))
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc[:2000],
            "parameters": {"type": "object", "properties": props, "required": list(props)[:2]},
        },
    }


def _prose(rng: np.random.Generator, prose: list[str], chars: int) -> str:
    """About ``chars`` characters of corpus prose, whole paragraphs from a random place."""
    out, n = [], 0
    while n < chars:
        doc = prose[int(rng.integers(len(prose)))]
        paras = [p for p in doc.split("\n\n") if p.strip()]
        start = int(rng.integers(len(paras)))
        for p in paras[start : start + 4]:
            out.append(p.strip())
            n += len(p)
    return "\n\n".join(out)[: max(chars, 1)]


def _question(rng: np.random.Generator, f: Function) -> str:
    q = QUESTIONS[int(rng.integers(len(QUESTIONS)))].format(name=f.name, module=f.module[:-3])
    if rng.random() < 0.35:
        q = f"```python\n{f.code}\n```\n\n{q}"
    return q


def _answer(rng: np.random.Generator, f: Function, think: bool) -> dict:
    msg = {"role": "assistant", "content": f.summary}
    if think:
        msg["reasoning_content"] = THOUGHTS[int(rng.integers(len(THOUGHTS)))]
    return msg


def _history(rng: np.random.Generator, funcs: list[Function], tools: list[dict], think: bool):
    """An earlier turn: a question and its answer, or a tool call and its result."""
    g = funcs[int(rng.integers(len(funcs)))]
    turn = [{"role": "user", "content": _question(rng, g)}]
    if tools and rng.random() < 0.5:
        tool = tools[int(rng.integers(len(tools)))]["function"]
        args = {k: "x" for k in list(tool["parameters"]["properties"])[:2]}
        call = {"id": "call_1", "type": "function", "function": {"name": tool["name"]}}
        call["function"]["arguments"] = args
        turn.append({"role": "assistant", "content": "", "tool_calls": [call]})
        turn.append({"role": "tool", "tool_call_id": "call_1", "content": g.code[:1500]})
    turn.append(_answer(rng, g, think))
    return turn


def make_chat(
    rng: np.random.Generator, funcs: list[Function], prose: list[str], answers: list[Function]
) -> Chat:
    """One chat whose last message is a short answer (``answers``: functions with one)."""
    style = STYLES[int(rng.choice(3, p=[0.45, 0.3, 0.25]))]
    think = rng.random() < 0.75
    kwargs: dict = {"thinking": think}
    if think and rng.random() < 0.3:
        kwargs["thinking_effort"] = ("low", "high")[int(rng.integers(2))]
    n_tools = int(rng.integers(8, 22)) if style != "plain" else int(rng.integers(0, 4))
    tools = [tool_spec(funcs[int(rng.integers(len(funcs)))], rng) for _ in range(n_tools)]
    f = answers[int(rng.integers(len(answers)))]
    ask = _question(rng, f) if rng.random() < 0.7 else TASKS[int(rng.integers(len(TASKS)))]
    chars = int(np.exp(rng.uniform(np.log(200), np.log(12000))))
    n = int(rng.integers(1000))
    messages: list[dict] = []
    if style == "claude":
        messages.append({"role": "system", "content": _prose(rng, prose, chars)})
        if rng.random() < 0.3:
            messages += _history(rng, funcs, tools, think)
        reminder = _prose(rng, prose, int(rng.integers(100, 1500)))
        messages.append(
            {"role": "user", "content": f"<system-reminder>\n{reminder}\n</system-reminder>\n{ask}"}
        )
        env = ENVIRONMENT.format(n=n, git=("true", "false")[n % 2])
        messages.append({"role": "system", "content": env + _prose(rng, prose, chars // 8)})
    elif style == "codex":
        messages.append({"role": "system", "content": _prose(rng, prose, chars)})
        messages.append({"role": "system", "content": _prose(rng, prose, chars // 4)})
        if rng.random() < 0.3:
            messages += _history(rng, funcs, tools, think)
        messages.append({"role": "user", "content": CODEX_ENV.format(n=n)})
        messages.append({"role": "user", "content": ask})
    else:
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": _prose(rng, prose, chars // 10)})
        if rng.random() < 0.3:
            messages += _history(rng, funcs, tools, think)
        messages.append({"role": "user", "content": ask})
    messages.append(_answer(rng, f, think))
    return Chat(messages, tools, kwargs)


def render(tokenizer, chat: Chat, *, prompt_only: bool = False) -> list[int]:
    """The chat's tokens as the server renders it (``prompt_only``: without its last
    message, with the generation header)."""
    messages = chat.messages[:-1] if prompt_only else chat.messages
    return tokenizer.apply_chat_template(
        messages,
        tools=chat.tools or None,
        add_generation_prompt=prompt_only,
        tokenize=True,
        **chat.kwargs,
    )


def encode(tokenizer, chat: Chat) -> tuple[list[int], int]:
    """(the whole chat's tokens, where its answer starts): the prompt as served, then
    the answer the model should give and the stop token."""
    prompt = render(tokenizer, chat, prompt_only=True)
    full = render(tokenizer, chat)
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat's answer does not extend its prompt as rendered")
    return full, len(prompt)


class ChatData:
    """Chats of one corpus split, encoded on demand: a pure function of (seed, index)."""

    def __init__(self, tokenizer, split: str = "train", corpus_dir=corpus.CORPUS_DIR):
        docs = corpus.load_split(split, path=corpus_dir)
        self.tokenizer = tokenizer
        self.funcs = functions(docs)
        self.answers = [f for f in self.funcs if f.summary]
        self.prose = [d.text for d in docs if d.domain == "prose"]
        if not self.answers or not self.prose:
            raise ValueError(f"split {split!r} has no documented functions or prose")

    def chat(self, seed: int, index: int) -> Chat:
        rng = np.random.default_rng([seed, index])
        return make_chat(rng, self.funcs, self.prose, self.answers)

    def example(self, seed: int, index: int) -> tuple[list[int], int]:
        return encode(self.tokenizer, self.chat(seed, index))

    def batch(
        self, seed: int, step: int, batch: int, seq: int, pad: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``batch`` chats as (inputs, targets, loss mask) [batch, seq]: each chat's last
        ``seq + 1`` tokens (padded on the right), the mask on its answer's targets."""
        x = np.full((batch, seq), pad, np.int32)
        y = np.full((batch, seq), pad, np.int32)
        m = np.zeros((batch, seq), np.float32)
        for b in range(batch):
            tokens, start = self.example(seed, step * batch + b)
            cut = max(0, len(tokens) - (seq + 1))
            w = tokens[cut:]
            start = max(start - cut, 1)
            x[b, : len(w) - 1] = w[:-1]
            y[b, : len(w) - 1] = w[1:]
            m[b, start - 1 : len(w) - 1] = 1.0
        return x, y, m
