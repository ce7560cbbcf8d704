"""Anthropic's Messages API on `kvmux http`, with the official `anthropic`
package as the client, on a real broker and worker (the embedded model)."""

from __future__ import annotations

import json

import anthropic
import pytest
from conftest import KEY

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
PICK_WEATHER = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}


def client(base: str, **options) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, max_retries=0, timeout=300, **{"api_key": KEY, **options})


def ask(base: str, messages: list, **options):
    """(the message, the kvmux session the gateway used); greedy: the worker's default."""
    options = {"model": "kvmux", "max_tokens": 8, **options}
    raw = client(base).messages.with_raw_response.create(messages=messages, **options)
    return raw.parse(), raw.headers["x-kvmux-session"]


def held(message) -> int:
    """The tokens the session holds after this reply."""
    usage = message.usage
    return usage.cache_read_input_tokens + usage.input_tokens + usage.output_tokens


def streamed(base: str, messages: list, **options):
    """(the events' types, the text and tool input pieces per block index, the final message)."""
    options = {"model": "kvmux", "max_tokens": 8, **options}
    kinds, pieces = [], {}
    with client(base).messages.stream(messages=messages, **options) as stream:
        for event in stream:
            if event.type in ("text", "input_json"):  # the helper's own, beside the API's events
                continue
            kinds.append(event.type)
            if event.type == "content_block_delta":
                delta = event.delta
                pieces[event.index] = pieces.get(event.index, "") + (
                    delta.text if delta.type == "text_delta" else delta.partial_json
                )
        return kinds, pieces, stream.get_final_message()


def test_a_plain_and_a_streamed_message(base):
    sampling = {"temperature": 0, "top_p": 1, "top_k": 1}  # the anthropic package's 2.x has them no more
    message, _ = ask(base, [{"role": "user", "content": "Name a colour."}], system="Be brief.", extra_body=sampling)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert message.usage.cache_read_input_tokens == 0

    question = [{"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}]
    kinds, pieces, final = streamed(base, question, system=[{"type": "text", "text": "Be brief."}])
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert pieces == {0: final.content[0].text} and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    # The gateway bound the text it streamed: sent back, the conversation goes on in its session.
    turn = [*question, {"role": "assistant", "content": final.content}, {"role": "user", "content": "Another."}]
    message, _ = ask(base, turn, system=[{"type": "text", "text": "Be brief."}])
    assert message.usage.cache_read_input_tokens == held(final)


def test_a_three_turn_conversation_reuses_its_session_and_a_regenerate_continues_a_copy(base):
    messages, sessions, before = [], set(), 0
    for turn in range(3):
        messages.append({"role": "user", "content": f"Tell me one fact about the number {turn + 2}."})
        message, session = ask(base, messages, system="You are terse.")
        sessions.add(session)
        assert message.usage.cache_read_input_tokens == before  # all earlier turns reused
        assert 0 < message.usage.input_tokens < 40 if turn else message.usage.input_tokens > 0
        before = held(message)
        messages.append({"role": "assistant", "content": message.content})
    assert len(sessions) == 1 and turn == 2
    regenerated, session = ask(base, messages[:-1], system="You are terse.")  # without the last reply
    assert session not in sessions  # a copy from that point: the conversation's session keeps its turns
    assert 0 < regenerated.usage.cache_read_input_tokens < before
    assert regenerated.usage.input_tokens < 40  # the last message again, not the conversation


def test_a_tool_round_trip(base):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    message, session = ask(base, messages, tools=[WEATHER], tool_choice=PICK_WEATHER, max_tokens=48)
    assert message.stop_reason == "tool_use", message
    call = message.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    assert set(call.input) == {"city"} and isinstance(call.input["city"], str)
    messages += [
        {"role": "assistant", "content": message.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "14 C"}]}],
        },
    ]
    reply, same = ask(base, messages, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=16)
    assert same == session and reply.usage.cache_read_input_tokens == held(message)
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason in ("end_turn", "max_tokens")


def test_a_streamed_tool_call(base):
    question = [{"role": "user", "content": "Weather in Rome?"}]
    kinds, pieces, final = streamed(base, question, tools=[WEATHER], tool_choice=PICK_WEATHER, max_tokens=48)
    assert final.stop_reason == "tool_use" and kinds[-2:] == ["message_delta", "message_stop"]
    index, call = next((i, b) for i, b in enumerate(final.content) if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    assert json.loads(pieces[index]) == call.input
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(final.content)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "9 C"}]}
    reply, _ = ask(base, [*question, {"role": "assistant", "content": final.content}, result], tools=[WEATHER])
    assert reply.usage.cache_read_input_tokens == held(final)  # the streamed call, as sent back, is bound


def test_errors_in_anthropic_shape(base):
    question = {"model": "kvmux", "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(base).messages.create(**question, max_tokens=anthropic.NOT_GIVEN)
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(base).messages.create(**question, max_tokens=4, extra_body={"thinking": {"type": "enabled"}})
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "thinking is not supported by kvmux"},
    }
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client(base, api_key="sk-wrong").messages.create(**question, max_tokens=4)
    assert caught.value.status_code == 401 and caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):  # Anthropic's own header
        client(base, api_key=None, default_headers={"x-api-key": "sk-wrong"}).messages.create(**question, max_tokens=4)
    message = client(base, api_key=None, default_headers={"x-api-key": KEY}).messages.create(**question, max_tokens=2)
    assert message.usage.output_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="speculative"):  # kvmux's extension, checked by the worker
        client(base).messages.create(**question, max_tokens=2, extra_body={"speculative": "always"})
