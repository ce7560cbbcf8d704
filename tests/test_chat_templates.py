"""Chats through the real daemon with the real chat templates of other model
families (tests/data/templates), each put on the embedded model's weights in
an mlx-lm directory. Five turns each: every turn prefills only what the
template puts after the conversation so far (the previous reply's closing,
the new message, the generation prompt), and the session's history is the
template's pieces tokenized as they were appended plus the replies' ids as
generated, decoding to exactly the family's format (tests/chat_formats.py).

SmolLM2's vocabulary has none of the other families' special tokens: they
tokenize as plain text, which changes nothing here. Its end-of-turn token,
<|im_end|>, is the templates' eos_token: Mistral's closing, whole."""

from __future__ import annotations

import json
import shutil

import pytest
from chat_formats import FORMATS, Chat, Format
from conftest import stacks_at_once

from kvmux.bench.peers import export_mlx_dir
from kvmux.client import Client

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)

SYSTEM = "You are terse."
QUESTIONS = ["Name a fruit.", "And a colour?", "Now a planet.", "A tree?", "Last one: a river."]
STACKS = {  # one daemon per template; Qwen3's serves a session with thinking on and one with it off
    "smollm2": ["smollm2"],
    "qwen3": ["qwen3-thinking", "qwen3-no-thinking"],
    "gemma3": ["gemma3"],
    "llama3.1": ["llama3.1"],
    "mistral": ["mistral"],
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_mlx_dir(tmp_path_factory.mktemp("models") / "smollm2-mlx")


def with_template(exported, tmp_path, fmt: Format):
    """The exported model with `fmt`'s template: weights and config linked,
    the tokenizer's files copied and its chat template replaced."""
    path = tmp_path / f"smollm2-{fmt.template}"
    path.mkdir()
    for item in exported.iterdir():
        if item.name in ("tokenizer_config.json", "chat_template.jinja"):
            continue
        if item.name.startswith("tokenizer"):
            shutil.copy(item, path / item.name)
        else:
            (path / item.name).symlink_to(item)
    config = json.loads((exported / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(fmt.source)
    return path


@pytest.fixture(scope="module")
def stacks(exported, tmp_path_factory):
    """Each template's daemon, all started at once. One slab: Qwen3's two
    sessions take turns on it, so each turn restores a hibernated session,
    its template options with it."""
    models = tmp_path_factory.mktemp("templates")
    configs = {
        template: {"slabs": 1, "worker_args": ["--model", str(with_template(exported, models, FORMATS[names[0]]))]}
        for template, names in STACKS.items()
    }
    with stacks_at_once(**configs) as stacks:
        yield stacks


@pytest.mark.parametrize("template", list(STACKS))
def test_five_turns_feed_each_piece_once_and_keep_the_replies(template, stacks, hf_tokenizer):
    names = STACKS[template]
    stack = stacks[template]
    with Client(stack.frontend, timeout=120) as client:
        chats = []
        for name in names:
            fmt = FORMATS[name]
            session = client.open_session(SYSTEM, chat_template_kwargs=fmt.kwargs, window=512, max_tokens=6)
            chats.append(Chat(session, fmt, hf_tokenizer, SYSTEM))
        for question in QUESTIONS:
            for chat in chats:
                chat.turn(question)
        for chat in chats:
            info = chat.session.info(token_ids=True)
            assert info.token_ids == chat.history
            assert hf_tokenizer.decode(info.token_ids) == chat.history_text
            assert info.restores >= (len(QUESTIONS) - 1 if len(chats) > 1 else 0)
