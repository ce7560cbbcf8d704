"""Anthropic's Messages API, POST /v1/messages: a request is the chat it
continues (conversation.py: the same bindings as chat completions, so a
conversation resent each turn prefills only its new messages, and one
resent without its last reply rewinds its session); replies, server-sent
events and errors in Anthropic's shapes."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmux import protocol as p

from . import schemas, sse
from .conversation import Chat, Reply, Usage, content, find_session, options, rebind
from .errors import ANTHROPIC, HTTPError, answered, bad
from .gateway import SESSION_HEADER, Gateway

STOP_REASON = {
    "eos": "end_turn",
    "cancelled": "end_turn",
    "stop": "stop_sequence",
    "max_tokens": "max_tokens",
    "tool_calls": "tool_use",
}
CHOICE = {schemas.AutoChoice: "auto", schemas.AnyChoice: "required", schemas.NoChoice: "none"}  # and tool: a NamedTool


def _text(content: str | list[schemas.TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _messages(given: list[schemas.AnthropicMessage]) -> list[dict]:
    """The conversation as the gateway keeps it: an assistant's tool_use
    blocks are its tool_calls, a user's tool_result blocks are tool
    messages (before the user's text, as Anthropic orders them)."""
    out = []
    for m in given:
        blocks = [schemas.TextBlock(text=m.content)] if isinstance(m.content, str) else m.content
        allowed = schemas.ToolUseBlock if m.role == "assistant" else schemas.ToolResultBlock
        for block in blocks:
            if not isinstance(block, (schemas.TextBlock, allowed)):
                raise bad(f"a {m.role} message cannot hold a {block.__struct_config__.tag} block", "messages")
        text = "".join(b.text for b in blocks if isinstance(b, schemas.TextBlock))
        if m.role == "assistant":
            calls = [
                {"id": b.id, "name": b.name, "arguments": json.dumps(b.input)}
                for b in blocks
                if isinstance(b, schemas.ToolUseBlock)
            ]
            out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            continue
        results = [b for b in blocks if isinstance(b, schemas.ToolResultBlock)]
        for b in results:  # an error is the model's to read as one
            result = ("Error: " if b.is_error else "") + _text(b.content)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
        if text or not results:
            out.append({"role": "user", "content": text})
    if out[-1]["role"] == "assistant":
        raise bad("the last message must not be the assistant's: kvmux does not continue a prefilled reply", "messages")
    return out


def chat_of(body: schemas.AnthropicMessages) -> Chat:
    messages = _messages(body.messages)
    if body.system is not None:
        messages.insert(0, {"role": "system", "content": _text(body.system)})
    choice = body.tool_choice
    disable_parallel = choice.disable_parallel_tool_use if choice is not None else None
    named = p.NamedTool(name=choice.name) if isinstance(choice, schemas.NamedChoice) else None
    return Chat(
        messages=messages,
        options=options(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences,
            speculative=body.speculative,
            priority=body.priority,
            tool_choice=named or CHOICE.get(type(choice)),
            parallel_tool_calls=None if disable_parallel is None else not disable_parallel,
        ),
        model=body.model,
        stream=body.stream,
        tools=[t.tool() for t in body.tools or []],
    )


def usage(counts: Usage) -> dict:
    """input_tokens are those prefilled, as Anthropic counts them: the
    tokens the session held, or took from a shared prefix, are cache reads."""
    return {
        "input_tokens": counts.prefilled,
        "output_tokens": counts.completion,
        "cache_read_input_tokens": counts.cached,
    }


def _stop(chat: Chat, result: p.GenerateResult) -> dict:
    """The stop reason, and the stop sequence that matched: the worker
    does not say which, so it is named only when the request gave one."""
    stops = chat.options.get("stop") or []
    reason = str(result.stop_reason)
    return {
        "stop_reason": STOP_REASON[reason],
        "stop_sequence": stops[0] if reason == "stop" and len(stops) == 1 else None,
    }


def _input(call: p.ToolCall) -> dict:
    """A call's arguments as a tool_use block's input: an object (a call
    cut by max_tokens, whose arguments are not one yet, has an empty one)."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _sent_back(result: p.GenerateResult) -> p.GenerateResult:
    """The result with its calls' arguments as a client sends them back (a
    tool_use block's input, serialized here again), for the binding."""
    calls = [msgspec.structs.replace(c, arguments=json.dumps(_input(c))) for c in result.tool_calls]
    return msgspec.structs.replace(result, tool_calls=calls)


@answered(ANTHROPIC)
async def messages(gateway: Gateway, request: Request) -> Response:
    chat = chat_of(await schemas.read(request, schemas.AnthropicMessages))
    session, bound, new = await find_session(gateway, request, chat)
    reply = await Reply.start(session, bound.held, new, chat.options, gateway.metrics.watch("messages"))
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": chat.model}
    headers = {SESSION_HEADER: session.id}
    if chat.stream:
        return sse.response(_events(chat, bound, reply, message), reply.stream, _error, headers)
    parts = [chunk.text async for chunk in reply.chunks()]
    result = reply.result
    text = content("".join(parts), result)
    counts = reply.usage
    await rebind(session, chat, bound, text, _sent_back(result))
    blocks = [{"type": "text", "text": text}] if text else []
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c)} for c in result.tool_calls]
    body = {**message, "content": blocks, **_stop(chat, result), "usage": usage(counts)}
    return JSONResponse(body, headers=headers)


def _event(kind: str, **data) -> str:
    return sse.event({"type": kind, **data}, kind)


def _error(exc: HTTPError) -> str:
    return sse.event(ANTHROPIC.event(exc), "error")


async def _events(chat: Chat, bound, reply: Reply, message: dict) -> AsyncIterator[str]:
    """Anthropic's server-sent events: a block per run of text or per tool
    call, its arguments as input_json_delta pieces."""
    opened: list[str] = []  # the blocks started, by index: the last is open

    def start(kind: str, **block) -> Iterator[str]:
        if opened:
            yield _event("content_block_stop", index=len(opened) - 1)
        opened.append(kind)
        yield _event("content_block_start", index=len(opened) - 1, content_block={"type": kind, **block})

    def deltas(chunk: p.Chunk) -> Iterator[str]:
        if chunk.text:
            if opened[-1:] != ["text"]:
                yield from start("text", text="")
            yield _event("content_block_delta", index=len(opened) - 1, delta={"type": "text_delta", "text": chunk.text})
        for call in chunk.tool_calls:  # a call's arguments stream before the next call starts
            if call.id is not None:
                yield from start("tool_use", id=call.id, name=call.name, input={})
            if call.arguments:
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                yield _event("content_block_delta", index=len(opened) - 1, delta=delta)

    # The prefill's count comes with the result: message_delta has it.
    start_usage = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": bound.held}
    yield _event(
        "message_start",
        message={**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage},
    )
    parts = []
    async for chunk in reply.chunks():
        parts.append(chunk.text)
        for out in deltas(chunk):
            yield out
    if opened:
        yield _event("content_block_stop", index=len(opened) - 1)
    result = reply.result
    counts = reply.usage
    await rebind(reply.session, chat, bound, content("".join(parts), result), _sent_back(result))
    yield _event("message_delta", delta=_stop(chat, result), usage=usage(counts))
    yield _event("message_stop")


def routes() -> list[Route]:
    return [Route("/v1/messages", messages, methods=["POST"])]
