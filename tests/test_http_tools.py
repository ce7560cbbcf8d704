"""Tool calls, structured output and logprobs through `kvmux http`, with the
`openai` package, on a real broker and worker (the embedded model)."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import api
from schemas import ADD, PERSON, WEATHER, valid

TOOLS = [{"type": "function", "function": tool} for tool in (WEATHER, ADD)]


def chat(client: openai.OpenAI, messages, stream: bool = False, **options):
    """(message dict as a client sends it back, finish_reason, usage, raw chunks or None)."""
    options = {"model": "kvmux", "messages": messages, "temperature": 0, "max_tokens": 96, **options}
    if not stream:
        completion = client.chat.completions.create(**options)
        choice = completion.choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason, completion.usage, choice
    content, calls, finish, chunks = "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **options):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(
                delta.index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
            )
            if delta.id:
                call["id"], call["function"]["name"] = delta.id, delta.function.name
            call["function"]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, None, chunks


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_json_object_and_strict_json_schema(base, stream):
    client = api(base)
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    message, finish, _, _ = chat(
        client, [{"role": "user", "content": "Invent a person."}], stream, response_format=schema_format, max_tokens=160
    )
    assert finish == "stop" and valid(json.loads(message["content"]), PERSON), message
    message, finish, _, _ = chat(
        client,
        [{"role": "user", "content": "Describe a cat."}],
        stream,
        response_format={"type": "json_object"},
        max_tokens=160,
    )
    assert finish == "stop" and isinstance(json.loads(message["content"]), dict), message


@pytest.mark.parametrize("stream", [False, True])
def test_each_tool_choice(base, stream):
    client = api(base)
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        message, finish, _, _ = chat(client, ask, stream, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        assert finish == "tool_calls" and len(message["tool_calls"]) == 1, message
        call = message["tool_calls"][0]
        tool = {"get_weather": WEATHER, "add": ADD}[call["function"]["name"]]
        assert valid(json.loads(call["function"]["arguments"]), tool["parameters"])
        assert call["id"].startswith("call_") and not message.get("content")
        if isinstance(choice, dict):
            assert call["function"]["name"] == "add"
    message, finish, _, _ = chat(client, ask, stream, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert "tool_calls" not in message and finish in ("stop", "length") and message["content"]
    message, finish, _, _ = chat(client, ask, stream, tools=TOOLS, max_tokens=48)  # auto: the model's choice, parsed
    assert finish in ("stop", "length", "tool_calls")
    for call in message.get("tool_calls", []):
        assert call["function"]["name"] in ("get_weather", "add")
        json.loads(call["function"]["arguments"])


def test_a_ten_step_tool_loop_through_the_gateway_reuses_its_session(base):
    client = api(base)
    messages = [{"role": "user", "content": "Add 1 and 2, then keep adding 1 to the result."}]
    sessions, prefilled = set(), []
    for step in range(10):
        raw = client.chat.completions.with_raw_response.create(
            model="kvmux",
            messages=messages,
            temperature=0,
            max_tokens=48,
            tools=TOOLS[1:],
            tool_choice="required" if step % 2 == 0 else "auto",
            parallel_tool_calls=False,
        )
        completion = raw.parse()
        sessions.add(raw.headers["x-kvmux-session"])
        usage = completion.usage
        prefilled.append(usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Use the tool again."})
    assert len(sessions) == 1, sessions  # every turn continued the same live session
    assert max(prefilled[1:]) < 60 and usage.prompt_tokens > 200, (prefilled, usage)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs(base, stream):
    client = api(base)
    options = {"logprobs": True, "top_logprobs": 2, "max_tokens": 8}
    _, _, _, out = chat(client, [{"role": "user", "content": "Name a colour."}], stream, **options)
    if stream:
        entries = [
            e for chunk in out if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content
        ]
    else:
        entries = out.logprobs.content
    assert len(entries) >= 1
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.token == entry.top_logprobs[0].token  # greedy takes the most likely
        assert bytes(entry.bytes).decode() == entry.token


def test_refusals_name_the_parameter(base):
    client = api(base)
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"extra_body": {"top_k_sampling": 3}}, "top_k_sampling"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "foo"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "no tools"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}]}, "object"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ]
    for options, named in cases:
        with pytest.raises(openai.BadRequestError, match=named) as bad:
            client.chat.completions.create(model="kvmux", messages=hi, max_tokens=4, **options)
        assert bad.value.status_code == 400
    assert client.chat.completions.create(model="kvmux", messages=hi, max_tokens=2, frequency_penalty=0).choices


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_is_exactly_one_call_of_it(base, stream):
    """As openai-agents asks through chat completions: parallel calls left at their default."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    message, finish, _, _ = chat(api(base), ask, stream, tools=TOOLS, tool_choice=named, max_tokens=200)
    assert finish == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert valid(json.loads(message["tool_calls"][0]["function"]["arguments"]), WEATHER["parameters"])


def test_a_call_cut_by_max_tokens_is_a_cut_call(base):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    replies = [
        chat(api(base), ask, stream, tools=TOOLS, tool_choice="required", max_tokens=22) for stream in (False, True)
    ]
    for message, finish, _, _ in replies:
        assert finish == "length" and len(message["tool_calls"]) == 1 and not message.get("content"), message
        function = message["tool_calls"][0]["function"]
        assert function["name"] in ("get_weather", "add") and function["arguments"].startswith("{")
        with pytest.raises(json.JSONDecodeError):  # its arguments as far as they were generated
            json.loads(function["arguments"])
    assert replies[0][0]["tool_calls"][0]["function"] == replies[1][0]["tool_calls"][0]["function"]  # as streamed


def test_a_format_beside_tools_holds_the_answer_and_calls_still_parse(base):
    client = api(base)
    total = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"], "additionalProperties": False}  # fmt: skip
    shaped = {"type": "json_schema", "json_schema": {"name": "total", "schema": total, "strict": True}}
    answers = {}
    for tools, question in ((TOOLS[1:], "Add 2 and 3."), (TOOLS, "What is the weather in Paris?")):
        ask = [{"role": "user", "content": question}]
        answers[question] = chat(client, ask, tools=tools, response_format=shaped, max_tokens=120)
    message, finish, _, _ = answers["Add 2 and 3."]  # the model answers: in the format
    assert finish == "stop" and "tool_calls" not in message and valid(json.loads(message["content"]), total), message
    message, finish, _, _ = answers["What is the weather in Paris?"]  # the model calls: calls, parsed
    assert finish == "tool_calls" and message["tool_calls"] and not message.get("content"), message
    for call in message["tool_calls"]:
        tool = {"get_weather": WEATHER, "add": ADD}[call["function"]["name"]]
        assert valid(json.loads(call["function"]["arguments"]), tool["parameters"])
