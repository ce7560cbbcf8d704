"""Chat rendering (worker/conversation.py) with the embedded model's real
tokenizer and chat template, loaded the way the worker loads them (rebuilt
from the GGUF's metadata through the on-disk tokenizer cache, then wrapped by
mlx-lm), without the weights or any process; and with the real templates of
other model families (tests/data/templates) put on that tokenizer."""

from __future__ import annotations

import copy

import pytest
from chat_formats import EOS, FORMATS
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kvmux.protocol import ErrorCode, ProtocolError
from kvmux.worker import gguf_tokenizer as gguf_file_tokenizer
from kvmux.worker.conversation import Conversation

# SmolLM2's template (ChatML), as the GGUF carries it.
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>\n"


@pytest.fixture(scope="module")
def gguf_tokenizer(model_path):
    """transformers' tokenizer, as worker/model.py builds it for a GGUF."""
    return gguf_file_tokenizer.load(model_path)


@pytest.fixture(scope="module")
def tokenizer(gguf_tokenizer):
    """What the worker hands to Conversation: the same tokenizer wrapped by mlx-lm."""
    return TokenizerWrapper(gguf_tokenizer)


def templated(gguf_tokenizer, source: str) -> TokenizerWrapper:
    """The real tokenizer with another chat template (the module's stays as it is)."""
    other = copy.copy(gguf_tokenizer)
    other.chat_template = source
    return TokenizerWrapper(other)


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def one_shot(tokenizer, messages: list[dict], generation_prompt: bool = False, **kwargs) -> str:
    """The whole conversation rendered at once."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)  # as the engine encodes what Conversation returns


def refused(call) -> ProtocolError:
    with pytest.raises(ProtocolError) as exc:
        call()
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    return exc.value


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_for_an_append_only_template_each_piece_is_the_difference_of_one_shot_renderings(tokenizer, system):
    conv = Conversation.open(tokenizer, system, None)
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


def test_with_chatml_and_replies_that_re_tokenize_as_generated_the_history_is_the_one_shot_rendering(tokenizer):
    """The invariant (docs/design.md) is that the history is the template's
    pieces, tokenized as appended, and the replies' ids as generated. For
    an append-only template whose pieces meet at special tokens, and replies
    whose ids are what their text tokenizes to, that is exactly the one-shot
    rendering of the conversation, text and tokens."""
    conv = Conversation.open(tokenizer, "Be brief.", None)
    history = list(conv.messages)
    fed: list[str] = []
    for turn in ("Hi!", "Who are you?", "Say that in French."):
        fed.append(conv.extend([user(turn)]))
        history.append(user(turn))
        assert "".join(fed) == one_shot(tokenizer, history)
        fed.append(conv.generation_prompt())
        assert "".join(fed) == one_shot(tokenizer, history, generation_prompt=True)
        reply = f"An answer to {turn!r}."
        fed += [reply, conv.close_turn(reply, reply, "")]
        history.append(assistant(reply))
        assert "".join(fed) == one_shot(tokenizer, history)
    assert conv.messages == history and conv.rendered == "".join(fed)
    tokens = [token for piece in fed for token in encode(tokenizer, piece)]
    assert tokens == encode(tokenizer, one_shot(tokenizer, history))


def test_the_system_prompt_opens_the_first_append(tokenizer):
    conv = Conversation.open(tokenizer, "Be brief.", None)
    assert conv.messages == [{"role": "system", "content": "Be brief."}]
    assert conv.rendered == ""  # nothing is fed before the first append
    added = conv.extend([user("Hello")])
    assert added == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"


def test_without_a_system_prompt_the_template_supplies_its_own(tokenizer):
    conv = Conversation.open(tokenizer, None, None)
    assert conv.messages == []
    assert conv.extend([user("Hello")]) == DEFAULT_SYSTEM + "<|im_start|>user\nHello<|im_end|>\n"


def test_the_generation_prompt_opens_the_assistant_turn(tokenizer):
    conv = Conversation.open(tokenizer, "Be brief.", None)
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
    conv = Conversation.open(tokenizer, "Be brief.", None)
    prompt = conv.extend([user("Hello")]) + conv.generation_prompt()
    end = tokenizer.decode([tokenizer.eos_token_id]) if eos else ""  # as the scheduler finds it
    closing = conv.close_turn(reply, reply + end, end)
    assert conv.messages[-1] == assistant(reply)
    assert prompt + reply + end + closing == one_shot(tokenizer, conv.messages) == conv.rendered
    assert closing == ("\n" if eos else TURN_END)


def test_an_end_of_turn_token_the_template_does_not_close_with_gets_the_whole_closing(gguf_tokenizer):
    """Llama 3.1's template closes a reply with <|eot_id|>: SmolLM2's own
    end-of-turn token ended the reply, and stays, before it."""
    fmt = FORMATS["llama3.1"]
    conv = Conversation.open(templated(gguf_tokenizer, fmt.source), "Be brief.", fmt.kwargs)
    conv.extend([user("Hello")])
    conv.generation_prompt()
    assert conv.close_turn("Hi!", "Hi!" + EOS, EOS) == "<|eot_id|>"
    assert conv.rendered.endswith("Hi!<|im_end|><|eot_id|>")


@pytest.mark.parametrize("role", ["wizard", "", "User"])
def test_an_unknown_role_is_an_invalid_argument_and_changes_nothing(tokenizer, role):
    conv = Conversation.open(tokenizer, "Be brief.", None)
    conv.extend([user("Hello")])
    messages, rendered = list(conv.messages), conv.rendered
    refused(lambda: conv.extend([user("One more."), {"role": role, "content": "abracadabra"}]))
    assert conv.messages == messages and conv.rendered == rendered
    assert conv.extend([user("One more.")]) == "<|im_start|>user\nOne more.<|im_end|>\n"


# ------------------------------------------------------------ real templates


def reply_for(name: str, i: int) -> str:
    """A reply as a model of that family might generate it: Qwen3 with
    thinking on writes its thinking first."""
    return f"<think>\nTurn {i}: be brief.\n</think>\n\nAnswer {i}." if name == "qwen3-thinking" else f"Answer {i}."


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_chat_feeds_each_message_as_the_template_renders_it_at_its_position(gguf_tokenizer, name):
    """Three turns through each real template: every piece is the text of
    the model family's format for that position (the system prompt where
    the template puts it, the generation prompt, the closing after a reply,
    less the end-of-turn token when the model generated it); earlier turns
    are never fed again; replies stay as generated."""
    fmt = FORMATS[name]
    conv = Conversation.open(templated(gguf_tokenizer, fmt.source), "Be brief.", fmt.kwargs)
    expected = ""
    for i in range(3):
        question = f"Question {i}?"
        assert conv.extend([user(question)]) == fmt.turn(i, "Be brief.", question)
        assert conv.generation_prompt() == fmt.prompt
        reply, end = reply_for(name, i), EOS if i == 1 else ""
        assert conv.close_turn(reply, reply + end, end) == fmt.close(end)
        expected += fmt.turn(i, "Be brief.", question) + fmt.prompt + reply + end + fmt.close(end)
    assert conv.rendered == expected
    assert [m["role"] for m in conv.messages] == ["system"] + ["user", "assistant"] * 3


def test_qwen3_strips_earlier_thinking_the_session_keeps_it(gguf_tokenizer):
    fmt = FORMATS["qwen3-thinking"]
    tokenizer = templated(gguf_tokenizer, fmt.source)
    conv = Conversation.open(tokenizer, "Be brief.", fmt.kwargs)
    conv.extend([user("Question 0?")])
    conv.generation_prompt()
    conv.close_turn(reply_for("qwen3-thinking", 0), reply_for("qwen3-thinking", 0), "")
    conv.extend([user("Question 1?")])
    assert "<think>\nTurn 0: be brief.\n</think>" in conv.rendered
    assert "Turn 0" not in one_shot(tokenizer, conv.messages, **fmt.kwargs)


def test_a_template_that_re_renders_earlier_turns_leaves_them_as_fed(gguf_tokenizer):
    # The real tokenizer with a template that numbers every turn anew.
    stamping = "{% for m in messages %}[{{ loop.index }}/{{ loop.length }}] {{ m.content }}\n{% endfor %}"
    conv = Conversation.open(templated(gguf_tokenizer, stamping), None, None)
    assert conv.extend([user("one")]) == "[1/1] one\n"
    assert conv.extend([user("two")]) == "[2/2] two\n"
    assert conv.rendered == "[1/1] one\n[2/2] two\n"
    assert gguf_tokenizer.chat_template != stamping  # the module's tokenizer is untouched


def test_chat_template_kwargs_reach_every_rendering(gguf_tokenizer):
    fmt = FORMATS["qwen3-no-thinking"]
    tokenizer = templated(gguf_tokenizer, fmt.source)
    on = Conversation.open(tokenizer, None, {"enable_thinking": True})
    off = Conversation.open(tokenizer, None, {"enable_thinking": False})
    for conv in (on, off):
        conv.extend([user("Hello")])
    assert on.generation_prompt() == "<|im_start|>assistant\n"
    assert off.generation_prompt() == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


# ------------------------------------------------------------ refusals


@pytest.mark.parametrize("name", ["tokenize", "add_generation_prompt", "messages", "tools"])
def test_chat_template_kwargs_may_not_set_apply_chat_template_s_own_options(tokenizer, name):
    error = refused(lambda: Conversation.open(tokenizer, None, {name: True}))
    assert name in error.message


def test_chat_template_kwargs_the_template_rejects_are_refused_at_open(gguf_tokenizer):
    strict = (
        "{% if effort is defined and effort not in ['low', 'high'] %}"
        "{{ raise_exception('effort must be low or high') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    )
    tokenizer = templated(gguf_tokenizer, strict)
    error = refused(lambda: Conversation.open(tokenizer, None, {"effort": "extreme"}))
    assert "effort must be low or high" in error.message
    Conversation.open(tokenizer, None, {"effort": "low"})


def test_a_role_order_the_template_refuses_is_an_invalid_argument_and_changes_nothing(gguf_tokenizer):
    conv = Conversation.open(templated(gguf_tokenizer, FORMATS["gemma3"].source), "Be brief.", None)
    conv.extend([user("Hello")])
    messages, rendered = list(conv.messages), conv.rendered
    error = refused(lambda: conv.extend([user("Hello again")]))  # Gemma's roles alternate
    assert "must alternate" in error.message
    assert conv.messages == messages and conv.rendered == rendered
    assert conv.generation_prompt() == "<start_of_turn>model\n"


def test_a_system_prompt_the_template_would_drop_is_an_invalid_argument(gguf_tokenizer):
    # Gemma 3 renders a system prompt only inside the first user turn...
    gemma = Conversation.open(templated(gguf_tokenizer, FORMATS["gemma3"].source), "Be brief.", None)
    refused(gemma.generation_prompt)
    assert gemma.rendered == ""
    # ... Mistral only inside the last message when that is the user's.
    mistral = Conversation.open(templated(gguf_tokenizer, FORMATS["mistral"].source), "Be brief.", None)
    refused(lambda: mistral.extend([user("Hello"), assistant("Hi.")]))
    assert mistral.extend([user("Hello")]) == "<|im_start|>[INST]Be brief.\n\nHello[/INST]"


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{% for m in messages %}{{ m.content | upper }}\n{% endfor %}", "verbatim"),
        ("{% for m in messages %}{{ m.content }}{{ '.' if loop.last else '|' }}{% endfor %}", "closes a turn"),
    ],
    ids=["rewrites_content", "closes_last_turn_otherwise"],
)
def test_a_template_whose_pieces_cannot_be_told_apart_is_an_invalid_argument(gguf_tokenizer, template, problem):
    conv = Conversation.open(templated(gguf_tokenizer, template), None, None)
    conv.extend([user("one")])  # the first piece is a real rendering
    assert problem in refused(lambda: conv.extend([user("two")])).message
    assert conv.messages == [user("one")]
