"""OpenAI's chat completions: POST /v1/chat/completions (a completion, or
its chunks as server-sent events) and GET /v1/models. The conversation,
resent whole on every request, continues the session bound to it
(conversation.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmux import protocol as p

from . import schemas, sse
from .conversation import Chat, Reply, Usage, content, find_session, options, rebind
from .errors import OPENAI, HTTPError, answered, bad
from .gateway import SESSION_HEADER, Gateway

FINISH = {"eos": "stop", "stop": "stop", "cancelled": "stop", "max_tokens": "length", "tool_calls": "tool_calls"}


def message(m: schemas.Message) -> dict:
    """A request's message as the gateway keeps it: role, text content, and
    a call's tool_calls or a result's tool_call_id."""
    text = m.content if not isinstance(m.content, list) else "".join(part.text for part in m.content)
    if text is None and m.role != "assistant" and not m.tool_calls:
        raise bad("every message but an assistant's needs its content", "messages")
    out = {"role": "system" if m.role == "developer" else m.role, "content": text or ""}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls
        ]
    if m.role == "tool":
        if m.tool_call_id is None:
            raise bad("a tool message needs the tool_call_id it answers", "messages")
        out["tool_call_id"] = m.tool_call_id
    return out


def chat_of(body: schemas.ChatCompletion) -> Chat:
    messages = [message(m) for m in body.messages]
    if messages[-1]["role"] == "assistant":
        raise bad("the last message must not be the assistant's: there is nothing to reply to", "messages")
    choice = body.tool_choice
    return Chat(
        messages=messages,
        options=options(
            max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=[body.stop] if isinstance(body.stop, str) else body.stop,
            speculative=body.speculative,
            priority=body.priority,
            tool_choice=p.NamedTool(name=choice.function.name) if isinstance(choice, schemas.NamedFunction) else choice,
            parallel_tool_calls=body.parallel_tool_calls,
            format=body.response_format.format() if body.response_format else None,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        ),
        model=body.model,
        stream=body.stream,
        template_kwargs=body.chat_template_kwargs,
        tools=[t.function.tool() for t in body.tools or []],
    )


def usage(counts: Usage) -> dict:
    return {
        "prompt_tokens": counts.prompt,
        "completion_tokens": counts.completion,
        "total_tokens": counts.prompt + counts.completion,
        "prompt_tokens_details": {"cached_tokens": counts.cached},
    }


def logprob(lp: p.Logprobs) -> dict:
    """A token's logprobs in OpenAI's shape."""

    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**entry(lp.text, lp.logprob), "top_logprobs": [entry(t.text, t.logprob) for t in lp.top]}


@answered(OPENAI)
async def completions(gateway: Gateway, request: Request) -> Response:
    body = await schemas.read(request, schemas.ChatCompletion)
    chat = chat_of(body)
    session, bound, new = await find_session(gateway, request, chat)
    reply = await Reply.start(session, bound.held, new, chat.options, gateway.metrics.watch("chat_completions"))
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": chat.model}
    headers = {SESSION_HEADER: session.id}
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if chat.stream:
        events = _events(chat, bound, reply, head, include_usage, body.logprobs)
        return sse.response(events, reply.stream, _error, headers)
    chunks = [chunk async for chunk in reply.chunks()]
    result = reply.result
    text = content("".join(chunk.text for chunk in chunks), result)
    counts = reply.usage
    await rebind(session, chat, bound, text, result)
    message = {"role": "assistant", "content": text}
    if result.tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": _calls(result)}
    choice = {"index": 0, "message": message, "finish_reason": FINISH[str(result.stop_reason)]}
    if body.logprobs:
        choice["logprobs"] = {"content": [logprob(lp) for chunk in chunks for lp in chunk.logprobs]}
    completion = {**head, "object": "chat.completion", "choices": [choice], "usage": usage(counts)}
    return JSONResponse(completion, headers=headers)


def _error(exc: HTTPError) -> str:
    return sse.event(OPENAI.event(exc))


def _calls(result: p.GenerateResult) -> list[dict]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in result.tool_calls
    ]


async def _events(
    chat: Chat, bound, reply: Reply, head: dict, include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    """The completion's chunks: the role, each piece of text or of a call,
    the finish reason, the usage where asked for, [DONE]."""

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
        return sse.event({**head, "object": "chat.completion.chunk", "choices": [choice]})

    def deltas(piece: p.Chunk) -> Iterator[str]:
        extra = {"logprobs": {"content": [logprob(lp) for lp in piece.logprobs]}} if logprobs else {}
        if piece.text or (extra and not piece.tool_calls):
            yield chunk({"content": piece.text}, **extra)
        for call in piece.tool_calls:
            function = {"arguments": call.arguments}
            delta = {"index": call.index, "function": function}
            if call.id is not None:
                delta.update(id=call.id, type="function")
                function["name"] = call.name
            yield chunk({"tool_calls": [delta]}, **extra)

    parts = []
    yield chunk({"role": "assistant", "content": ""})
    async for piece in reply.chunks():
        parts.append(piece.text)
        for out in deltas(piece):
            yield out
    result = reply.result
    counts = reply.usage
    await rebind(reply.session, chat, bound, content("".join(parts), result), result)
    yield chunk({}, FINISH[str(result.stop_reason)])
    if include_usage:
        yield sse.event({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(counts)})
    yield "data: [DONE]\n\n"


@answered(OPENAI)
async def models(gateway: Gateway, request: Request) -> Response:
    stats = await gateway.client.stats()
    data = [  # OpenAI's model objects, with where each model is (llama.cpp's router says it too)
        {"id": m.model, "object": "model", "created": 0, "owned_by": "kvmux", "state": m.state, "aliases": m.aliases}
        for m in stats.models
    ]
    return JSONResponse({"object": "list", "data": data})


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
