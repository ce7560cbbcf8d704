"""Anthropic's Messages API, POST /v1/messages: a request is translated to
app.py's ChatRequest and served as a chat completion is (the same bindings:
a conversation resent each turn prefills only its new messages, and one
resent without its last reply rewinds its session); replies, server-sent
events and errors in Anthropic's shapes."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvmux import protocol as p
from kvmux.client import errors

from .app import (
    SESSION_HEADER,
    ChatRequest,
    Gateway,
    HTTPError,
    _bad,
    _check_key,
    _first,
    _from_kvmux,
    _numbers,
    _protocol_messages,
    _rebind,
    _session,
    _usage,
    chunks,
    json_body,
    speculative,
)
from .page import _own

# Fields read (speculative: kvmux's extension, as on chat completions);
# metadata (an identifier) and cache_control (a caching hint, anywhere: all
# that a live session holds is cached) are taken and ignored.
# Any other is refused by name.
FIELDS = {
    "model", "max_tokens", "system", "messages", "stop_sequences", "temperature", "top_p", "top_k", "stream",
    "tools", "tool_choice", "metadata", "cache_control", "speculative",
}  # fmt: skip
# Content blocks: the role that may send each, and its keys beside type and cache_control.
BLOCKS = {
    "text": (("user", "assistant"), {"text"}),
    "tool_use": (("assistant",), {"id", "name", "input"}),
    "tool_result": (("user",), {"tool_use_id", "content", "is_error"}),
}
STOP_REASON = {
    "eos": "end_turn",
    "cancelled": "end_turn",
    "stop": "stop_sequence",
    "max_tokens": "max_tokens",
    "tool_calls": "tool_use",
}
CHOICE = {"auto": "auto", "any": "required", "none": "none"}  # and tool: a NamedTool
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def _error_body(exc: HTTPError) -> dict:
    kind = ERROR_TYPE.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": kind, "message": exc.message}


def _error(exc: HTTPError) -> JSONResponse:
    return JSONResponse({"type": "error", "error": _error_body(exc)}, status_code=exc.status, headers=exc.headers)


def _keyed(request: Request) -> Request:
    """The request with its x-api-key (Anthropic's header) as the Bearer
    key app.py's _check_key and _owner read."""
    key = request.headers.get("x-api-key")
    if key is None or "authorization" in request.headers:
        return request
    headers = [*request.scope["headers"], (b"authorization", f"Bearer {key}".encode())]
    return Request({**request.scope, "headers": headers}, request.receive)


def _text(content: object, where: str) -> str:
    """A string, or text blocks' text joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(_block(b, "user")["text"] for b in content)
    raise _bad(f"{where} must be a string or a list of text blocks", where)


def _block(block: object, role: str) -> dict:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in BLOCKS:
        raise _bad(f"content block type {kind} is not supported by kvmux: text, tool_use, tool_result", "messages")
    roles, keys = BLOCKS[kind]
    if role not in roles:
        raise _bad(f"a {role} message cannot hold a {kind} block", "messages")
    unknown = sorted(set(block) - keys - {"type", "cache_control"})
    if unknown:
        raise _bad(f"{unknown[0]} in a {kind} block is not supported by kvmux", "messages")
    if kind == "text" and not isinstance(block.get("text"), str):
        raise _bad("a text block needs its text", "messages")
    if kind == "tool_use" and not (
        isinstance(block.get("id"), str) and isinstance(block.get("name"), str) and isinstance(block.get("input"), dict)
    ):
        raise _bad("a tool_use block needs an id, a name and an input object", "messages")
    if kind == "tool_result" and not isinstance(block.get("tool_use_id"), str):
        raise _bad("a tool_result block needs the tool_use_id it answers", "messages")
    return block


def _messages(messages: object) -> list[dict]:
    """The conversation as app.py keeps it: an assistant's tool_use blocks
    are its tool_calls, a user's tool_result blocks are tool messages
    (before the user's text, as Anthropic orders them)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad("every message needs a role: user or assistant (the system prompt goes in system)", "messages")
        content = m["content"] if isinstance(m.get("content"), list) else [{"type": "text", "text": m.get("content")}]
        blocks = [_block(b, role) for b in content]
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        if role == "assistant":
            calls = [
                {"id": b["id"], "name": b["name"], "arguments": json.dumps(b["input"])}
                for b in blocks
                if b["type"] == "tool_use"
            ]
            out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            continue
        results = [b for b in blocks if b["type"] == "tool_result"]
        for b in results:  # an error is the model's to read as one
            result = _text(b.get("content", ""), "tool_result content")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b["tool_use_id"],
                    "content": ("Error: " if b.get("is_error") else "") + result,
                }
            )
        if text or not results:
            out.append({"role": "user", "content": text})
    if out[-1]["role"] == "assistant":
        raise _bad(
            "the last message must not be the assistant's: kvmux does not continue a prefilled reply", "messages"
        )
    return out


def _tools(body: dict) -> tuple[list[p.Tool], dict]:
    """The request's tools and the options that go with them."""
    tools, options = [], {}
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            raise _bad("tools must be client tools: {name, description, input_schema}", "tools")
        unknown = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
        if unknown:
            raise _bad(f"{unknown[0]} in a tool is not supported by kvmux", "tools")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise _bad("a tool needs a name and an input_schema object", "tools")
        tools.append(
            p.Tool(name=tool["name"], description=tool.get("description") or "", parameters=tool["input_schema"])
        )
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool" and isinstance(choice.get("name"), str):
            options["tool_choice"] = p.NamedTool(name=choice["name"])
        elif kind in CHOICE:
            options["tool_choice"] = CHOICE[kind]
        else:
            raise _bad("tool_choice must be {type: auto, any, none, or tool with a name}", "tool_choice")
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None:
            if not isinstance(parallel, bool):
                raise _bad("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
            options["parallel_tool_calls"] = not parallel
    return tools, options


def _request(body: object) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise _bad(f"{name} is not supported by kvmux", name)
    if "max_tokens" not in body:
        raise _bad("max_tokens is required", "max_tokens")
    options = _numbers(body, {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int})
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop_sequences must be a list of strings", "stop_sequences")
        options["stop"] = stops
    system = body.get("system")
    messages = _messages(body.get("messages"))
    if system is not None:
        messages.insert(0, {"role": "system", "content": _text(system, "system")})
    tools, tool_options = _tools(body)
    return ChatRequest(
        messages=messages,
        stream=bool(body.get("stream", False)),
        options={**options, **tool_options, **speculative(body)},
        include_usage=False,  # usage is always sent
        model=str(body.get("model") or "kvmux"),
        tools=tools,
    )


def _anthropic_usage(bound, result: p.GenerateResult) -> dict:
    """input_tokens are those prefilled, as Anthropic counts them: the
    tokens the session held are cache reads."""
    usage = _usage(bound, result)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "output_tokens": usage["completion_tokens"],
        "cache_read_input_tokens": cached,
    }


def _stop(chat: ChatRequest, result: p.GenerateResult) -> dict:
    """The stop reason, and the stop sequence that matched: the worker
    does not say which, so it is named only when the request gave one."""
    stops = chat.options.get("stop") or []
    reason = str(result.stop_reason)
    return {
        "stop_reason": STOP_REASON[reason],
        "stop_sequence": stops[0] if reason == "stop" and len(stops) == 1 else None,
    }


def _reply_text(result: p.GenerateResult, parts: list[str]) -> str:
    """The reply's text: the result's content when the worker read the
    reply for calls (not with tool_choice none: its content is then empty),
    else the chunks' text."""
    return result.content if result.content or result.tool_calls else "".join(parts)


def _sent_back(result: p.GenerateResult) -> p.GenerateResult:
    """The result with its calls' arguments as a client sends them back (a
    tool_use block's input, serialized here again), for the binding."""
    calls = [msgspec.structs.replace(c, arguments=json.dumps(json.loads(c.arguments))) for c in result.tool_calls]
    return msgspec.structs.replace(result, tool_calls=calls)


async def messages(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    request = _keyed(request)
    try:
        _check_key(gateway, request)
        pinned = request.headers.get(SESSION_HEADER)
        if pinned and gateway.api_keys:
            await _own(gateway, request, pinned)  # another key's session is unknown (page.Watch, for chat completions)
        body = await json_body(request)
        chat = _request(body)
        session, bound, new = await _session(gateway, request, chat)
        stream = session.generate(messages=_protocol_messages(new), **chat.options)
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": chat.model}
        headers = {SESSION_HEADER: session.id}
        if chat.stream:
            first = await _first(stream)  # errors before the first token are still HTTP errors
            events = _events(session, chat, bound, stream, first, message)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        chunks = [chunk async for chunk in stream]
        result = stream.result
        text = _reply_text(result, [chunk.text for chunk in chunks])
        usage = _anthropic_usage(bound, result)
        await _rebind(session, chat, bound, text, _sent_back(result))
        content = [{"type": "text", "text": text}] if text else []
        content += [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
            for c in result.tool_calls
        ]
        return JSONResponse({**message, "content": content, **_stop(chat, result), "usage": usage}, headers=headers)
    except HTTPError as exc:
        return _error(exc)
    except errors.KvmuxError as exc:
        return _error(_from_kvmux(exc))


def _sse(kind: str, **data) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _events(session, chat, bound, stream, first, message) -> AsyncIterator[str]:
    """Anthropic's server-sent events: a block per run of text or per tool
    call, its arguments as input_json_delta pieces. A client that goes away
    cancels the generation (closing the stream tells the worker)."""
    opened: list[str] = []  # the blocks started, by index: the last is open

    def start(kind: str, **block) -> Iterator[str]:
        if opened:
            yield _sse("content_block_stop", index=len(opened) - 1)
        opened.append(kind)
        yield _sse("content_block_start", index=len(opened) - 1, content_block={"type": kind, **block})

    def deltas(chunk: p.Chunk) -> Iterator[str]:
        if chunk.text:
            if opened[-1:] != ["text"]:
                yield from start("text", text="")
            yield _sse("content_block_delta", index=len(opened) - 1, delta={"type": "text_delta", "text": chunk.text})
        for call in chunk.tool_calls:  # a call's arguments stream before the next call starts
            if call.id is not None:
                yield from start("tool_use", id=call.id, name=call.name, input={})
            if call.arguments:
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                yield _sse("content_block_delta", index=len(opened) - 1, delta=delta)

    parts = []
    try:
        # The prefill's count comes with the result: message_delta has it.
        usage = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": bound.held}
        yield _sse(
            "message_start",
            message={**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage},
        )
        async for chunk in chunks(first, stream):
            parts.append(chunk.text)
            for out in deltas(chunk):
                yield out
        if opened:
            yield _sse("content_block_stop", index=len(opened) - 1)
        result = stream.result
        usage = _anthropic_usage(bound, result)
        await _rebind(session, chat, bound, _reply_text(result, parts), _sent_back(result))
        yield _sse("message_delta", delta=_stop(chat, result), usage=usage)
        yield _sse("message_stop")
    except errors.KvmuxError as exc:
        yield _sse("error", error=_error_body(_from_kvmux(exc)))
    finally:
        await stream.aclose()
