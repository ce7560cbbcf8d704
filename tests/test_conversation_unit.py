"""Chat rendering (worker/conversation.py) with the embedded model's real
tokenizer and chat template, loaded the way the worker loads them (rebuilt
from the GGUF's metadata through the on-disk tokenizer cache, then wrapped by
mlx-lm), without the weights or any process."""

from __future__ import annotations

import copy

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kvmux.protocol import ErrorCode, ProtocolError
from kvmux.worker.conversation import Conversation
from kvmux.worker.model import _gguf_tokenizer

# SmolLM2's template (ChatML), as the GGUF carries it.
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>\n"


@pytest.fixture(scope="module")
def gguf_tokenizer(model_path):
    """transformers' tokenizer, as worker/model.py builds it for a GGUF."""
    return _gguf_tokenizer(model_path)


@pytest.fixture(scope="module")
def tokenizer(gguf_tokenizer):
    """What the worker hands to Conversation: the same tokenizer wrapped by mlx-lm."""
    return TokenizerWrapper(gguf_tokenizer)


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def one_shot(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    """The whole conversation rendered at once."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)  # as the engine encodes what Conversation returns


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_each_extend_adds_the_difference_of_one_shot_renderings(tokenizer, system):
    conv = Conversation(tokenizer, system)
    history = list(conv.messages)
    appends = (
        [user("Hi!")],
        [user("Who are you?"), assistant("A small model."), user("Say that in French.")],  # a replayed history
        [{"role": "system", "content": "Answer in French from now on."}],
        [{"role": "tool", "content": '{"temperature": 21}'}],
    )
    for i, messages in enumerate(appends):
        before = one_shot(tokenizer, history) if i else ""  # a system prompt is fed with the first append
        added = conv.extend(messages)
        history += messages
        after = one_shot(tokenizer, history)
        assert after.startswith(before)
        assert added == after[len(before) :]
        assert conv.messages == history and conv.rendered == after


def test_a_whole_chat_feeds_exactly_the_one_shot_rendering(tokenizer):
    """Appends, generation prompts, replies and closed turns, fed piece by
    piece, give the text and the tokens of the conversation rendered at once."""
    conv = Conversation(tokenizer, "Be brief.")
    history = list(conv.messages)
    fed: list[str] = []
    for turn in ("Hi!", "Who are you?", "Say that in French."):
        fed.append(conv.extend([user(turn)]))
        history.append(user(turn))
        assert "".join(fed) == one_shot(tokenizer, history)
        fed.append(conv.generation_prompt())
        assert "".join(fed) == one_shot(tokenizer, history, generation_prompt=True)
        reply = f"An answer to {turn!r}."
        fed += [reply, conv.close_turn(reply, reply)]
        history.append(assistant(reply))
        assert "".join(fed) == one_shot(tokenizer, history)
    assert conv.messages == history and conv.rendered == "".join(fed)
    tokens = [token for piece in fed for token in encode(tokenizer, piece)]
    assert tokens == encode(tokenizer, one_shot(tokenizer, history))


def test_the_system_prompt_opens_the_first_append(tokenizer):
    conv = Conversation(tokenizer, "Be brief.")
    assert conv.messages == [{"role": "system", "content": "Be brief."}]
    assert conv.rendered == ""  # nothing is fed before the first append
    added = conv.extend([user("Hello")])
    assert added == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"


def test_without_a_system_prompt_the_template_supplies_its_own(tokenizer):
    conv = Conversation(tokenizer, None)
    assert conv.messages == []
    assert conv.extend([user("Hello")]) == DEFAULT_SYSTEM + "<|im_start|>user\nHello<|im_end|>\n"


def test_the_generation_prompt_opens_the_assistant_turn(tokenizer):
    conv = Conversation(tokenizer, "Be brief.")
    conv.extend([user("Hello")])
    history = list(conv.messages)
    header = conv.generation_prompt()
    assert header == ASSISTANT_HEADER
    assert one_shot(tokenizer, history) + header == one_shot(tokenizer, history, generation_prompt=True)
    assert conv.messages == history  # the reply is recorded only when its turn closes


@pytest.mark.parametrize(
    ("reply", "eos"),
    [
        ("Hi there!", False),  # max tokens, a stop string or a cancel: the reply is all that was fed
        ("Hi there!", True),  # the model ended its turn: its end-of-turn token was fed too
        ("", False),  # cancelled before the first token
    ],
    ids=["no_eos", "eos", "empty"],
)
def test_close_turn_returns_exactly_what_the_template_puts_after_the_reply(tokenizer, reply, eos):
    conv = Conversation(tokenizer, "Be brief.")
    prompt = conv.extend([user("Hello")]) + conv.generation_prompt()
    generated = reply + (tokenizer.decode([tokenizer.eos_token_id]) if eos else "")  # as the scheduler builds it
    closing = conv.close_turn(reply, generated)
    assert conv.messages[-1] == assistant(reply)
    assert prompt + generated + closing == one_shot(tokenizer, conv.messages) == conv.rendered
    assert closing == ("\n" if eos else TURN_END)


def test_a_reply_the_template_does_not_reproduce_still_gets_the_template_s_closing(tokenizer):
    conv = Conversation(tokenizer, None)
    conv.extend([user("Hello")])
    conv.generation_prompt()
    assert conv.close_turn("Hi there", "Hi there, partly rewritten") == TURN_END
    assert conv.rendered == one_shot(tokenizer, conv.messages)


@pytest.mark.parametrize("role", ["wizard", "", "User"])
def test_an_unknown_role_is_an_invalid_argument_and_changes_nothing(tokenizer, role):
    conv = Conversation(tokenizer, "Be brief.")
    conv.extend([user("Hello")])
    messages, rendered = list(conv.messages), conv.rendered
    with pytest.raises(ProtocolError) as exc:
        conv.extend([user("One more."), {"role": role, "content": "abracadabra"}])
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    assert conv.messages == messages and conv.rendered == rendered
    assert conv.extend([user("One more.")]) == "<|im_start|>user\nOne more.<|im_end|>\n"


def test_a_template_that_re_renders_earlier_turns_is_an_invalid_argument(gguf_tokenizer):
    # The real tokenizer with a real template, one that numbers every turn anew.
    stamping = copy.copy(gguf_tokenizer)
    stamping.chat_template = "{% for m in messages %}[{{ loop.index }}/{{ loop.length }}] {{ m.content }}\n{% endfor %}"
    conv = Conversation(TokenizerWrapper(stamping), None)
    assert conv.extend([user("one")]) == "[1/1] one\n"
    with pytest.raises(ProtocolError) as exc:
        conv.extend([user("two")])
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    assert conv.messages == [user("one")] and conv.rendered == "[1/1] one\n"
    assert gguf_tokenizer.chat_template != stamping.chat_template  # the module's tokenizer is untouched
