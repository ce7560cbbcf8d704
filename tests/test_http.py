"""`kvmux http`, the OpenAI-compatible gateway, with the official `openai`
package as the client, on a real broker and worker."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from conftest import api, broker_stats

from kvmux.client import Client


@pytest.fixture
def gateway(shared_stack, base):
    return shared_stack, base


def ask(client: openai.OpenAI, messages, **options):
    """(reply text, usage, the kvmux session the gateway used)."""
    raw = client.chat.completions.with_raw_response.create(
        model="kvmux", messages=messages, temperature=0, max_tokens=12, **options
    )
    completion = raw.parse()
    return completion.choices[0].message.content, completion.usage, raw.headers["x-kvmux-session"]


def test_a_streamed_and_a_plain_chat(gateway):
    _, base = gateway
    client = api(base)
    text, usage, _ = ask(client, [{"role": "user", "content": "Name a colour."}])
    assert text and usage.completion_tokens > 0 and usage.prompt_tokens > 0
    stream = client.chat.completions.create(
        model="kvmux",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
        ["stop"],
        ["length"],
    )
    assert chunks[-1].usage.completion_tokens > 0
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_a_five_turn_conversation_prefills_only_each_new_message(gateway):
    _, base = gateway
    client = api(base)
    messages = [{"role": "system", "content": "You are terse."}]
    sessions, held = set(), 0
    for turn in range(5):
        messages.append({"role": "user", "content": f"Tell me one fact about the number {turn + 2}."})
        text, usage, session = ask(client, messages)
        sessions.add(session)
        assert usage.prompt_tokens_details.cached_tokens == held  # all earlier turns reused
        new = usage.prompt_tokens - held
        assert 0 < new < 40 if turn else new > 0  # the new message (and the reply's closing tokens) only
        held = usage.prompt_tokens + usage.completion_tokens
        messages.append({"role": "assistant", "content": text})
    assert len(sessions) == 1 and held > 100


def test_an_edited_earlier_message_forks_and_the_original_branch_is_untouched(gateway):
    stack, base = gateway
    client = api(base)
    history = [{"role": "user", "content": "My name is Ada. Say hello."}]
    text, _, original = ask(client, history)
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "What is my name?"}]
    text, usage, same = ask(client, history)
    assert same == original and usage.prompt_tokens_details.cached_tokens > 0
    edited = [{"role": "user", "content": "My name is Grace. Say hello."}, *history[1:]]
    _, usage, fork = ask(client, edited)
    assert fork != original and usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Spell it."}]
    _, usage, again = ask(client, history)
    assert again == original and usage.prompt_tokens_details.cached_tokens > 0
    with Client(stack.frontend, timeout=60) as kvmux:
        assert kvmux.resume_session(original).info().messages == 6  # 3 turns, none of the fork's


def test_a_regenerate_and_an_edited_last_message_continue_a_copy_and_leave_the_session_as_it_was(gateway):
    """Resent without its last reply, or with the last message changed, a
    conversation matches an earlier point of its session: it gets a copy
    from there (nothing prefilled again), and the session keeps its turns,
    as it would for another conversation that opened the same way."""
    stack, base = gateway
    client = api(base)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    text, _, session = ask(client, history)
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Name a fruit."}]
    fruit, turn, same = ask(client, history)
    assert same == session
    again, regenerated, copy = ask(client, history)  # resent without its last reply: a regenerate
    assert copy != session and regenerated.prompt_tokens == turn.prompt_tokens and again == fruit
    assert regenerated.prompt_tokens - regenerated.prompt_tokens_details.cached_tokens < 10  # not the history again
    edited = [*history[:-1], {"role": "user", "content": "Name an animal."}]
    _, usage, other = ask(client, edited)  # the last message changed
    assert other not in (session, copy) and usage.prompt_tokens_details.cached_tokens > 20
    with Client(stack.frontend, timeout=60) as kvmux:
        assert kvmux.resume_session(session).info().messages == 5  # its turns, as they were


def test_other_chat_template_kwargs_are_another_conversation(gateway):
    _, base = gateway
    client = api(base)
    thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    history = [{"role": "user", "content": "Name a fruit."}]
    text, _, first = ask(client, history, extra_body=thinking)
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another?"}]
    _, usage, same = ask(client, history, extra_body=thinking)
    assert same == first and usage.prompt_tokens_details.cached_tokens > 0
    _, usage, other = ask(client, history)  # the same messages, without the options
    assert other != first and usage.prompt_tokens_details.cached_tokens == 0


def test_four_concurrent_conversations(gateway):
    _, base = gateway
    client = api(base)
    out: dict[int, tuple] = {}

    def converse(i: int) -> None:
        messages = [{"role": "user", "content": f"Count to {i + 3}."}]
        text, _, first = ask(client, messages)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again, slower."}]
        _, usage, second = ask(client, messages)
        out[i] = (first, second, usage.prompt_tokens_details.cached_tokens)

    threads = [threading.Thread(target=converse, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 4 and len({first for first, _, _ in out.values()}) == 4
    assert all(first == second and cached > 0 for first, second, cached in out.values())


def test_bad_requests_and_keys_get_openai_errors(gateway):
    _, base = gateway
    with pytest.raises(openai.BadRequestError) as bad:
        api(base).chat.completions.create(model="kvmux", messages=[])
    assert bad.value.status_code == 400 and "messages" in str(bad.value)
    with pytest.raises(openai.BadRequestError):
        api(base).chat.completions.create(model="kvmux", messages=[{"role": "user", "content": "hi"}], n=2)
    with pytest.raises(openai.BadRequestError):
        api(base).chat.completions.create(model="kvmux", messages=[{"role": "user", "content": "hi"}], max_tokens=10**9)
    with pytest.raises(openai.BadRequestError, match="speculative"):  # a kvmux option, checked by the worker
        api(base).chat.completions.create(
            model="kvmux", messages=[{"role": "user", "content": "hi"}], extra_body={"speculative": "always"}
        )
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        api(base).chat.completions.create(model="kvmux", messages=hi, extra_body={"chat_template_kwargs": [1]})
    with pytest.raises(openai.BadRequestError, match="tokenize"):  # reaches the worker, which refuses it
        api(base).chat.completions.create(
            model="kvmux", messages=hi, extra_body={"chat_template_kwargs": {"tokenize": True}}
        )
    with pytest.raises(openai.AuthenticationError):
        api(base, key="sk-wrong").chat.completions.create(model="kvmux", messages=[{"role": "user", "content": "hi"}])


def test_a_client_that_disconnects_mid_stream_frees_the_worker(gateway):
    stack, base = gateway
    stream = api(base).chat.completions.create(
        model="kvmux", messages=[{"role": "user", "content": "Write a very long story."}], max_tokens=2000, stream=True
    )
    for i, _chunk in enumerate(stream):
        if i == 5:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while broker_stats(stack.admin).workers[0].running and time.monotonic() < deadline:
        time.sleep(0.2)
    assert broker_stats(stack.admin).workers[0].running == 0
