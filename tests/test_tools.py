"""Structured output, tool calls and logprobs from the Python client, on a
real broker and worker with the embedded model (its template has no tools:
the generic format, worker/tool_calls.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import Stack
from schemas import ADD, PERSON, WEATHER, valid

from kvmux import protocol as p
from kvmux.client import Client, errors

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)


@pytest.fixture(scope="module")
def stack():
    stack = Stack(workers=1, slabs=4)
    yield stack
    stack.stop()


@pytest.fixture
def client(stack):
    with Client(stack.frontend, timeout=120) as client:
        yield client


def run(stream) -> tuple[list[p.Chunk], p.GenerateResult]:
    chunks = list(stream)
    return chunks, stream.result


def test_twenty_seeded_json_schema_replies_parse_and_validate(stack):
    subjects = ["a sailor", "a child", "a baker", "a pilot", "a poet"] * 4

    def one(i: int) -> str:
        with Client(stack.frontend, timeout=300) as client, client.open_session() as session:
            stream = session.generate(
                messages=[{"role": "user", "content": f"Invent {subjects[i]} and describe them."}],
                max_tokens=160,
                temperature=0.8,
                seed=i,
                format={"type": "json_schema", "schema": PERSON},
            )
            text = "".join(c.text for c in stream)
            assert stream.result.stop_reason == p.StopReason.EOS, (i, text)
            return text

    with ThreadPoolExecutor(4) as pool:  # four sessions share each pass
        replies = list(pool.map(one, range(20)))
    people = [json.loads(text) for text in replies]
    assert all(valid(person, PERSON) for person in people), replies
    assert len({json.dumps(person) for person in people}) > 10  # seeds sample different people


def test_json_object_and_grammars(client):
    with client.open_session() as session:
        chunks, result = run(
            session.generate(messages=[("user", "Describe a cat.")], max_tokens=160, format={"type": "json_object"})
        )
        assert result.stop_reason == p.StopReason.EOS
        assert isinstance(json.loads("".join(c.text for c in chunks)), dict)
        chunks, _ = run(
            session.generate(
                messages=[("user", "Is the sky blue?")],
                max_tokens=8,
                format={"type": "lark", "grammar": 'start: "yes" | "no"'},
            )
        )
        assert "".join(c.text for c in chunks) in ("yes", "no")
        chunks, _ = run(
            session.generate(
                messages=[("user", "How many legs has a spider?")],
                max_tokens=8,
                format={"type": "gbnf", "grammar": "root ::= [0-9]+"},
            )
        )
        assert "".join(c.text for c in chunks).isdigit()
        chunks, _ = run(
            session.generate(
                messages=[("user", "Give a code.")],
                max_tokens=12,
                format={"type": "regex", "grammar": "[a-z]{3}-[0-9]{2}"},
            )
        )
        text = "".join(c.text for c in chunks)
        assert len(text) == 6 and text[:3].isalpha() and text[3] == "-" and text[4:].isdigit(), text


def test_bad_formats_and_tool_choices_are_refused_and_the_session_is_untouched(client):
    with client.open_session(tools=[WEATHER]) as session:
        run(session.generate(messages=[("user", "Hi.")], max_tokens=4, tool_choice="none"))
        before = session.info().history_tokens
        cases = [
            ({"format": {"type": "json_schema", "schema": {"type": "foo"}}, "tool_choice": "none"}, "format"),
            ({"format": {"type": "lark", "grammar": 'start: "a" missing'}, "tool_choice": "none"}, "format"),
            ({"format": {"type": "gbnf", "grammar": "root ::= ("}, "tool_choice": "none"}, "gbnf"),
            ({"format": {"type": "xml"}, "tool_choice": "none"}, "format type"),
            ({"tool_choice": {"name": "get_time"}}, "get_time"),
            ({"tool_choice": "always"}, "tool_choice"),
            ({"logprobs": 21}, "logprobs"),
        ]
        for options, named in cases:
            with pytest.raises(errors.InvalidArgument, match=named):
                run(session.generate(messages=[("user", "Go on.")], max_tokens=4, **options))
            assert session.info().history_tokens == before, options
        _, result = run(session.generate(messages=[("user", "Go on.")], max_tokens=4, tool_choice="none"))
        assert result.completion_tokens > 0
    with pytest.raises(errors.InvalidArgument, match="no tools"), client.open_session() as session:
        run(session.generate(messages=[("user", "Hi.")], max_tokens=4, tool_choice="required"))
    for tools, named in (([{**ADD, "name": "bad name"}], "bad function name"), ([ADD, ADD], "its own name")):
        with pytest.raises(errors.InvalidArgument, match=named):
            client.open_session(tools=tools)


def calls_of(chunks: list[p.Chunk]) -> dict[int, dict]:
    """Tool calls put together from their streamed deltas."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.tool_calls:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:
                call["id"], call["name"] = delta.id, delta.name
            call["arguments"] += delta.arguments
    return calls


def test_required_and_named_tool_calls_stream_their_arguments(client):
    with client.open_session(tools=[WEATHER, ADD]) as session:
        chunks, result = run(
            session.generate(
                messages=[("user", "What is the weather in Paris? Use the tool.")],
                max_tokens=96,
                tool_choice="required",
                parallel_tool_calls=False,
            )
        )
        assert result.stop_reason == p.StopReason.TOOL_CALLS
        assert len(result.tool_calls) == 1
        call = result.tool_calls[0]
        tool = {"get_weather": WEATHER, "add": ADD}[call.name]
        assert valid(json.loads(call.arguments), tool["parameters"]), call
        streamed = calls_of(chunks)
        assert streamed == {0: {"id": call.id, "name": call.name, "arguments": call.arguments}}
        assert "<tool_call>" not in "".join(c.text for c in chunks)

        _, result = run(
            session.generate(
                messages=[
                    p.ChatMessage(role="tool", content='{"celsius": 14}', tool_call_id=call.id, name=call.name),
                    p.ChatMessage(role="user", content="Now add 2 and 3."),
                ],
                max_tokens=64,
                tool_choice={"name": "add"},
            )
        )
        assert [c.name for c in result.tool_calls][:1] == ["add"]
        assert all(valid(json.loads(c.arguments), ADD["parameters"]) for c in result.tool_calls)

        _, result = run(session.generate(messages=[("user", "Thanks! Say bye.")], max_tokens=16, tool_choice="none"))
        assert not result.tool_calls and result.stop_reason != p.StopReason.TOOL_CALLS


def test_a_ten_step_tool_loop_is_one_session_that_prefills_only_its_new_tokens(client):
    with client.open_session(tools=[ADD]) as session:
        messages = [p.ChatMessage(role="user", content="Add 1 and 2, then keep adding 1 to the result.")]
        prompts, total = [], 0
        for step in range(10):
            _, result = run(
                session.generate(messages=messages, max_tokens=48, tool_choice="required", parallel_tool_calls=False)
            )
            assert result.stop_reason == p.StopReason.TOOL_CALLS, step
            prompts.append(result.prompt_tokens)
            total = result.history_tokens
            call = result.tool_calls[0]
            args = json.loads(call.arguments)
            messages = [
                p.ChatMessage(role="tool", content=str(args["a"] + args["b"]), tool_call_id=call.id, name="add")
                for call in result.tool_calls
            ]
        # each turn prefilled its tool results and the prompt, never the history again
        assert max(prompts[1:]) < 60 < total / 4, (prompts, total)
        assert session.info().messages >= 20


def test_logprobs_are_the_models_and_stay_exact_under_speculation(client):
    prompt = "Repeat exactly: one two three four five six. one two three four five six. one two three"
    replies = {}
    for mode in ("off", "lookup"):
        with client.open_session() as session:
            chunks, result = run(
                session.generate(messages=[("user", prompt)], max_tokens=24, speculative=mode, logprobs=3)
            )
            assert all(len(c.logprobs) == 1 and len(c.logprobs[0].top) == 3 for c in chunks)
            replies[mode] = ([c.token_ids[0] for c in chunks], [c.logprobs[0] for c in chunks], result)
    tokens, logprobs, _ = replies["off"]
    assert replies["lookup"][0] == tokens
    assert replies["lookup"][2].accepted_tokens > 0  # the verifier's rows gave those logprobs
    for lp, spec in zip(logprobs, replies["lookup"][1], strict=True):
        assert lp.token == lp.top[0].token and lp.logprob == pytest.approx(lp.top[0].logprob)  # greedy: the top one
        assert lp.logprob <= 0 and [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert spec.logprob == pytest.approx(lp.logprob, abs=2e-3)


def test_a_constrained_reply_with_speculation_is_the_plain_one(client):
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 12}
    prompt = "List the numbers 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3 as a JSON array."
    out = {}
    for mode in ("off", "lookup"):
        with client.open_session() as session:
            chunks, result = run(
                session.generate(
                    messages=[("user", prompt)],
                    max_tokens=64,
                    speculative=mode,
                    format={"type": "json_schema", "schema": schema},
                )
            )
            out[mode] = ("".join(c.text for c in chunks), result)
    assert out["lookup"][0] == out["off"][0]
    assert valid(json.loads(out["off"][0]), schema)
    assert out["lookup"][1].drafted_tokens > 0


def test_a_hibernated_session_keeps_its_tools(stack):
    with Client(stack.frontend, timeout=120) as client:
        session = client.open_session(tools=[ADD])
        run(session.generate(messages=[("user", "Hello.")], max_tokens=4, tool_choice="none"))
        others = [client.open_session() for _ in range(stack.slabs)]  # takes every slab: ours hibernates
        assert session.info().state == "hibernated"
        for other in others:
            other.close()
        _, result = run(session.generate(messages=[("user", "Add 4 and 5.")], max_tokens=48, tool_choice="required"))
        assert result.tool_calls[0].name == "add" and session.info().restores == 1
        session.close()
