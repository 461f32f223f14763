"""The chat stage (issue 41): chats in the model's own template whose answer ends the
message, and the mini it made (``data/mini-k3-chat``) ending its messages on chats it
never saw."""

from __future__ import annotations

import json

from k3dist import MINI_K3
from k3dist.factory import chat_train
from k3dist.factory.chat import ChatData, render
from k3dist.format import tokens as tk

import pytest
from util import REPO

CHAT_MINI = REPO / "data" / "mini-k3-chat"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return chat_train.load_chat_tokenizer(MINI_K3, tmp_path_factory.mktemp("chat-tokenizer"))


@pytest.fixture(scope="module")
def held(tokenizer):
    return ChatData(tokenizer, "eval")


def test_chats_end_with_the_stop_token_and_the_loss_is_on_the_answer(tokenizer, held):
    stop = tokenizer.eos_token_ids
    pad = tokenizer.convert_tokens_to_ids(tk.PAD)
    for i in range(12):
        chat = held.chat(0, i)
        full, start = held.example(0, i)
        assert full[-1] in stop and full[:start] == render(tokenizer, chat, prompt_only=True)
        answer = tokenizer.decode(full[start:])
        assert chat.messages[-1]["content"] in answer and answer.endswith(tk.END_OF_MSG)
        assert 4 <= len(full) - start <= 48, answer  # a short answer, its tags, the stop
    assert held.example(0, 5) == held.example(0, 5)  # a pure function of (seed, index)
    x, y, m = held.batch(0, 0, 4, 256, pad)
    for b in range(4):
        full, start = held.example(0, b)
        w = full[-257:]
        n = len(w) - 1
        assert list(x[b, :n]) == w[:-1] and list(y[b, :n]) == w[1:]
        assert m[b].sum() == len(full) - start and m[b, n - 1] == 1 and (x[b, n:] == pad).all()


def test_chat_mini_ends_its_messages(tokenizer, held):
    # the committed chat stage: greedy ends with the stop token within 48 tokens on
    # held-out chats (the corpus's eval split), think channel on and off
    record = json.loads((CHAT_MINI / "training.json").read_text())
    assert record["from"].endswith("k3dist/data/mini-k3") and record["steps"] >= 1
    model, _ = chat_train.load_model(CHAT_MINI, 0)
    got = chat_train.check(model, tokenizer, held, 6, 48)
    assert got["ended"] == 6, got
