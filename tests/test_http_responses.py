"""OpenAI's Responses API on `kvmux http`, with the `openai` package as the
client, on a real broker and worker (the embedded model): chains on live
sessions, branches, stored responses, streaming, tools and structured
output; and conversation bindings that outlive the gateway and the daemon."""

from __future__ import annotations

import itertools
import json

import openai
import pytest
from conftest import KEY, OTHER_KEY, Daemon, api, http_gateway

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
QUESTIONS = ("Name a colour.", "Name a fruit.", "Name an animal.", "Name a city.")


def create(client: openai.OpenAI, **options):
    """(the response, the kvmux session that holds it); greedy, short."""
    options = {"model": "kvmux", "max_output_tokens": 8, "temperature": 0, **options}
    raw = client.responses.with_raw_response.create(**options)
    return raw.parse(), raw.headers["x-kvmux-session"]


def prefilled(response) -> int:
    return response.usage.input_tokens - response.usage.input_tokens_details.cached_tokens


def held(response) -> int:
    """The tokens its session holds after it."""
    return response.usage.input_tokens + response.usage.output_tokens


def chain(client: openai.OpenAI, questions=QUESTIONS, previous=None):
    responses, sessions = [], set()
    for question in questions:
        response, session = create(client, input=question, previous_response_id=previous, instructions="Be brief.")
        responses.append(response)
        sessions.add(session)
        previous = response.id
    return responses, sessions


def test_a_chain_prefills_only_its_input_and_branches_from_an_older_response(base):
    client = api(base)
    responses, sessions = chain(client)
    assert len(sessions) == 1  # one live session
    for before, response in itertools.pairwise(responses):
        assert response.status == "completed" and response.output_text
        assert response.previous_response_id == before.id
        assert response.usage.input_tokens_details.cached_tokens == held(before)
        assert prefilled(response) < 30  # the new question and the template's turn, not the chain
    assert responses[-1].usage.input_tokens > 60

    brief = {"instructions": "Be brief."}
    branch, branch_session = create(client, input="Name a planet.", previous_response_id=responses[1].id, **brief)
    assert branch_session not in sessions and branch.output_text  # a copy of the chain's session at response 2
    reused = branch.usage.input_tokens_details.cached_tokens
    assert held(responses[1]) - 3 <= reused <= held(responses[1]) and prefilled(branch) < 30  # says what it reused
    on, session = create(client, input="And a star?", previous_response_id=branch.id, **brief)
    assert session == branch_session and prefilled(on) < 30
    mainline, session = create(client, input="And a river?", previous_response_id=responses[-1].id, **brief)
    assert session in sessions and prefilled(mainline) < 30  # the chain itself goes on as it was
    other, session = create(client, input="And a lake?", previous_response_id=mainline.id)
    assert session not in sessions and prefilled(other) > 60  # other instructions: a session opened with them


def test_stored_responses_are_fetched_listed_and_deleted(base):
    client = api(base)
    first, _ = create(client, input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}])
    second, _ = create(client, input="Again.", previous_response_id=first.id, metadata={"run": "7"})
    fetched = client.responses.retrieve(second.id)
    assert fetched.id == second.id and fetched.output_text == second.output_text
    assert fetched.usage.input_tokens == second.usage.input_tokens and fetched.metadata == {"run": "7"}
    items = client.responses.input_items.list(second.id)
    assert [item.content[0].text for item in items.data] == ["Again."]

    unstored, _ = create(client, input="Not kept.", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)

    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert gone.value.body["code"] == "not_found" and first.id in gone.value.body["message"]
    assert client.responses.retrieve(second.id).id == second.id  # the others stay
    with pytest.raises(openai.NotFoundError):
        create(client, input="Hi.", previous_response_id="resp_" + "0" * 48)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("not-an-id")


def test_a_streamed_response_sends_openai_events_and_is_stored(base):
    client = api(base)
    first, _ = create(client, input="Name a colour.")
    kinds, deltas = [], []
    with client.responses.stream(
        model="kvmux", input="Name another.", previous_response_id=first.id, max_output_tokens=12
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    added = kinds.index("response.output_item.added")
    assert kinds[added + 1] == "response.content_part.added" and "response.output_text.done" in kinds
    assert kinds.index("response.output_item.done") > kinds.index("response.content_part.done")
    assert final.output_text == "".join(deltas) and deltas
    assert final.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_function_tools_round_trip_and_structured_output(base):
    client = api(base)
    tools = {
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
    }
    called, session = create(client, input="What is the weather in Paris?", max_output_tokens=40, **tools)
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}
    answer, same = create(client, input=[result], previous_response_id=called.id, tools=[WEATHER], tool_choice="none")
    assert same == session and answer.output_text and prefilled(answer) < 40  # only the result's turn

    with client.responses.stream(model="kvmux", input="Weather in Rome?", max_output_tokens=40, **tools) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert json.loads(next(i for i in streamed.output if i.type == "function_call").arguments)["city"]

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}}
    shaped, _ = create(client, input="Pick a number.", text=fmt, max_output_tokens=20)
    assert isinstance(json.loads(shaped.output_text)["n"], int)


def test_a_named_tool_choice_is_one_call_and_a_cut_call_is_incomplete(base):
    client = api(base)
    named = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    called, _ = create(client, input="What is the weather in Paris?", max_output_tokens=200, **named)
    assert called.status == "completed" and [item.type for item in called.output] == ["function_call"]
    assert json.loads(called.output[0].arguments)["city"] and called.output[0].status == "completed"
    cut, _ = create(client, input="What is the weather in Paris?", max_output_tokens=20, **named)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    call = cut.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "incomplete"
    assert called.output[0].arguments.startswith(call.arguments)  # as far as it was generated


def test_a_stored_response_is_found_by_its_name_for_its_key_alone(base):
    mine, session = create(api(base), input="Name a colour.")
    assert session not in mine.id  # found through the broker's name index, not its session id
    assert api(base).responses.retrieve(mine.id).output_text == mine.output_text
    other = api(base, key=OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        create(other, input="And a fruit?", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    on, same = create(api(base), input="And a fruit?", previous_response_id=mine.id)
    assert same == session and on.usage.input_tokens_details.cached_tokens == held(mine)


def test_refusals_in_openai_shape(base):
    client = api(base)
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, input="Hi.", extra_body={"frequency_penalty": 0.5})
    assert refused.value.body["param"] == "frequency_penalty"
    with pytest.raises(openai.BadRequestError, match="input_image"):
        create(client, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])
    with pytest.raises(openai.BadRequestError, match="web_search"):
        create(client, input="Hi.", tools=[{"type": "web_search"}])
    with pytest.raises(openai.AuthenticationError):
        create(api(base, key="wrong"), input="Hi.")
    with pytest.raises(openai.BadRequestError, match="speculative"):  # kvmux's extension, checked by the worker
        create(client, input="Hi.", extra_body={"speculative": "always"})
    assert create(client, input="Hi.", extra_body={"speculative": "off"})[0].output_text


def test_conversations_outlive_the_gateway_and_gateways_agree(shared_stack, tmp_path):
    messages = [{"role": "user", "content": "Name a colour."}]
    with http_gateway(shared_stack, tmp_path, [KEY]) as one, http_gateway(shared_stack, tmp_path, [KEY]) as two:
        reply = api(one).chat.completions.create(model="kvmux", messages=messages, max_tokens=8)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "And a fruit?"}]  # fmt: skip
        again = api(two).chat.completions.with_raw_response.create(model="kvmux", messages=messages, max_tokens=8)
        other = again.parse()
        assert other.usage.prompt_tokens_details.cached_tokens == reply.usage.total_tokens  # the same session
        response, _ = create(api(one), input="Name a fruit.")
    messages += [{"role": "assistant", "content": other.choices[0].message.content}, {"role": "user", "content": "And a tree?"}]  # fmt: skip
    with http_gateway(shared_stack, tmp_path, [KEY]) as restarted:  # a new gateway process: nothing in memory
        third = api(restarted).chat.completions.with_raw_response.create(model="kvmux", messages=messages, max_tokens=8)
        assert third.headers["x-kvmux-session"] == again.headers["x-kvmux-session"]
        assert third.parse().usage.prompt_tokens_details.cached_tokens > 40
        on, _ = create(api(restarted), input="And a tree?", previous_response_id=response.id)
        assert on.usage.input_tokens_details.cached_tokens > 20 and prefilled(on) < 30


@pytest.mark.stack
def test_a_chain_goes_on_after_a_daemon_restart(tmp_path):
    with Daemon(tmp_path, slabs=2) as daemon, http_gateway(daemon, tmp_path, [KEY]) as gateway:
        responses, sessions = chain(api(gateway), QUESTIONS[:2])
    with Daemon(tmp_path, slabs=2) as daemon, http_gateway(daemon, tmp_path, [KEY]) as gateway:
        client = api(gateway)
        assert client.responses.retrieve(responses[-1].id).output_text == responses[-1].output_text
        on, session = create(
            client, input=QUESTIONS[2], previous_response_id=responses[-1].id, instructions="Be brief."
        )
        assert session in sessions and prefilled(on) < 30  # restored from the store, not prefilled
        assert on.usage.input_tokens_details.cached_tokens == held(responses[-1])
