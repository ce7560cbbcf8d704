"""Chat rendering (worker/conversation.py) with the embedded model's real
tokenizer and chat template, without its weights or any process."""

from __future__ import annotations

import copy

import pytest

from kvmux.protocol import ErrorCode, ProtocolError
from kvmux.worker.conversation import Conversation
from kvmux.worker.model import _gguf_tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return _gguf_tokenizer(model_path)


def one_shot(tokenizer, messages, generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def test_each_extend_adds_the_difference_of_one_shot_renderings(tokenizer):
    conv = Conversation(tokenizer, "Be brief.")
    history = [{"role": "system", "content": "Be brief."}]
    fed = ""
    for turn in ("Hi!", "Who are you?"):
        message = {"role": "user", "content": turn}
        fed += conv.extend([message])
        history.append(message)
        assert fed == one_shot(tokenizer, history)
        fed += conv.generation_prompt()
        assert fed == one_shot(tokenizer, history, generation_prompt=True)
        reply = f"Answer to {turn}"
        fed += reply + conv.close_turn(reply, reply)
        history.append({"role": "assistant", "content": reply})
        assert fed == one_shot(tokenizer, history)
    assert conv.rendered == fed and conv.messages == history


def test_the_generation_prompt_opens_the_assistant_turn(tokenizer):
    conv = Conversation(tokenizer, None)
    conv.extend([{"role": "user", "content": "Hello"}])
    assert conv.generation_prompt() == "<|im_start|>assistant\n"


def test_close_turn_returns_what_the_template_puts_after_the_reply(tokenizer):
    conv = Conversation(tokenizer, None)
    conv.extend([{"role": "user", "content": "Hello"}])
    conv.generation_prompt()
    assert conv.close_turn("Hi there", "Hi there") == "<|im_end|>\n"


def test_unknown_roles_are_invalid_arguments(tokenizer):
    with pytest.raises(ProtocolError) as exc:
        Conversation(tokenizer, None).extend([{"role": "wizard", "content": "abracadabra"}])
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT


def test_a_template_that_re_renders_earlier_turns_is_refused(tokenizer):
    stamping = copy.copy(tokenizer)  # the real tokenizer with a real template that numbers every turn anew
    stamping.chat_template = "{% for m in messages %}[{{ loop.length }}] {{ m.content }}\n{% endfor %}"
    conv = Conversation(stamping, None)
    conv.extend([{"role": "user", "content": "one"}])
    with pytest.raises(ProtocolError) as exc:
        conv.extend([{"role": "user", "content": "two"}])
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
