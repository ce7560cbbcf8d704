"""OpenAI's Responses API on live sessions: POST /v1/responses (plain, or
streamed as its typed server-sent events), GET and DELETE /v1/responses/{id}
and GET /v1/responses/{id}/input_items.

A response id names a point of a durable session: `resp_` + the session's
id + a nonce. A stored response (`store`, true by default) is a named point
of its session (protocol Mark) whose note keeps the response object, its
input and the id it continued, in the session's record: so a chain
(`previous_response_id`) costs only the new input's prefill and outlives the
gateway, the daemon and the worker, with no state in the gateway.

Continuing the newest response of a session appends to it. Continuing an
older one (a branch) opens a copy of the session taken back to that
response (OpenSession.fork): the copy starts from the session's slab, so
only the input is prefilled. With other instructions or tools than the
session was opened with (or where a copy cannot be made: the session busy,
no slab free), a new session prefills the chain's conversation, read back
from the responses' notes, before the input. Usage says what was reused
(input_tokens_details.cached_tokens) either way.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvmux import logs
from kvmux import protocol as p
from kvmux.client import errors

from .app import (
    SESSION_HEADER,
    ChatRequest,
    Gateway,
    HTTPError,
    _bad,
    _content,
    _first,
    _from_kvmux,
    _message,
    _numbers,
    _owner,
    _protocol_messages,
    _tools,
    answered,
    chunks,
    json_body,
    speculative,
)
from .page import _own

log = logs.get("http.responses")

_ID = re.compile(r"^resp_([0-9a-f]{32})[0-9a-f]{16}$")
# Fields read, and those taken only at the value that changes nothing here;
# any other is refused by name.
FIELDS = {
    "model", "input", "instructions", "previous_response_id", "store", "stream", "max_output_tokens",
    "temperature", "top_p", "text", "tools", "tool_choice", "parallel_tool_calls", "metadata", "user",
    "speculative",
}  # fmt: skip
NEUTRAL = {"truncation": ("disabled",), "background": (False,), "include": ([],), "reasoning": ({},)}
ITEMS = ("message", "function_call", "function_call_output")


def _not_found(response_id: str) -> HTTPError:
    return HTTPError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "not_found")


def _session_of(response_id: object) -> str:
    match = _ID.fullmatch(response_id) if isinstance(response_id, str) else None
    if match is None:
        raise _not_found(str(response_id))
    return match.group(1)


# ------------------------------------------------------------------ request


def _input(value: object) -> list[dict]:
    """The input as app.py keeps messages: a string is one user message; a
    function_call item joins the assistant message before it (or starts one),
    a function_call_output is a tool message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for item in value:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEMS:
            raise _bad(f"input item type {kind} is not supported by kvmux: {', '.join(ITEMS)}", "input")
        if kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise _bad("a function_call_output needs its call_id and an output string", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad("a function_call needs a call_id, a name and arguments", "input")
            call = {"id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            content = item.get("content")
            if isinstance(content, list):
                for part in content:
                    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                        kind = part.get("type") if isinstance(part, dict) else part
                        raise _bad(f"content part {kind} is not supported by kvmux: text parts only", "input")
            out.append(_message({"role": item.get("role"), "content": content}))
    if out[-1]["role"] == "assistant":
        raise _bad("the input must not end with the assistant's message: there is nothing to reply to", "input")
    return out


def _format(text: object) -> p.Format | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is None or fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return p.Format(type="json_object")
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return p.Format(type="json_schema", schema=fmt["schema"])
    raise _bad("text.format must be {type: text}, {type: json_object} or {type: json_schema, schema}", "text")


def _function_tools(body: dict) -> dict:
    """Responses' flat function tools and tool_choice, as chat completions'."""
    tools = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise _bad(f"tool type {kind} is not supported by kvmux: function tools only", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        tools.append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = {"type": choice.get("type"), "function": {"name": choice.get("name")}}
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls")}


@dataclass
class ResponseRequest:
    chat: ChatRequest  # the messages to send, the sampling options, the tools
    input: list[dict]  # the request's own input, as messages
    instructions: str | None
    previous: str | None
    store: bool
    metadata: dict
    echo: dict  # the request's settings as the response object repeats them


def _parse(body: object) -> ResponseRequest:
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    for name, value in body.items():
        if name not in FIELDS and (name not in NEUTRAL or value not in (*NEUTRAL[name], None)):
            raise _bad(f"{name} is not supported by kvmux", name)
    options = _numbers(
        {**body, "max_tokens": body.get("max_output_tokens")}, {"max_tokens": int, "temperature": float, "top_p": float}
    )
    tools, tool_options = _tools(_function_tools(body))
    options.update(tool_options, **speculative(body))
    fmt = _format(body.get("text"))
    if fmt is not None:
        options["format"] = fmt
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("previous_response_id must be a response id", "previous_response_id")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad("metadata must be an object of strings", "metadata")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise _bad("store must be true or false", "store")
    given = _input(body.get("input"))
    chat = ChatRequest(
        messages=list(given),
        stream=bool(body.get("stream", False)),
        options=options,
        include_usage=True,
        model=str(body.get("model") or "kvmux"),
        tools=tools,
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "text": {"format": body["text"]["format"] if fmt is not None else {"type": "text"}},
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "truncation": "disabled",
    }
    return ResponseRequest(chat, given, instructions, previous, store, metadata, echo)


def _context(req: ResponseRequest, owner: str) -> str:
    """What a session is opened with: a response continues in its session
    only with the same instructions and tools, from the same caller."""
    tools = [msgspec.to_builtins(t) for t in req.chat.tools]
    return hashlib.sha256(json.dumps([owner, req.instructions, tools], sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------ stored


@dataclass
class Stored:
    session: object  # a detached handle on its session
    at: int  # the session's messages at the response
    note: dict  # the response object, its input, its reply, the id it continued, its context
    info: p.SessionInfo


async def _stored(gateway: Gateway, request: Request, response_id: str) -> Stored:
    """A stored response; 404 for an unknown one, another key's, or one
    whose session is gone."""
    session_id = _session_of(response_id)
    if gateway.api_keys:
        try:
            await _own(gateway, request, session_id)
        except HTTPError:
            raise _not_found(response_id) from None
    try:
        session = await gateway.client.resume_session(session_id)
        session.detach()  # a handle only: the session outlives the gateway
        info = await session.info(marks=[response_id])
    except (errors.SessionNotFound, errors.SessionExpired):
        raise _not_found(response_id) from None
    if response_id not in info.marks:
        raise _not_found(response_id)
    return Stored(session, info.marks[response_id], json.loads(info.notes[response_id]), info)


async def _conversation(gateway: Gateway, request: Request, response_id: str | None) -> list[dict]:
    """The messages of a chain up to and with `response_id`: each stored
    response's input and reply, oldest first."""
    turns = []
    while response_id is not None:
        note = (await _stored(gateway, request, response_id)).note
        turns.append([*note["input"], note["reply"]])
        response_id = note["previous"]
    return [m for turn in reversed(turns) for m in turn]


@dataclass
class Placed:
    session: object
    held: int  # tokens the session holds already: reused
    opened: bool  # a session opened for this response


async def _place(gateway: Gateway, request: Request, req: ResponseRequest, context: str) -> Placed:
    """The session the response goes into; `req.chat.messages` become what
    it still needs: the input, after the chain's conversation in a new one."""
    owner = _owner(gateway, request)
    if req.previous is not None:
        stored = await _stored(gateway, request, req.previous)
        info = stored.info
        same = stored.note["context"] == context
        if same and stored.at == info.messages and not info.busy:
            return Placed(stored.session, info.history_tokens - info.pending_tokens, opened=False)
        if same:  # a branch: a copy of the session taken back to the response
            try:
                fork = p.Fork(session_id=stored.session.id, messages=stored.at)
                session = await gateway.client.open_session(None, client_name=owner, fork=fork)
                session.detach()
                forked = await session.info()
                return Placed(session, forked.history_tokens - forked.pending_tokens, opened=True)
            except (errors.Busy, errors.Overloaded) as exc:  # running, or no slab for a copy: prefilled anew
                log.info("response_branch_prefilled", response=req.previous, why=str(exc))
        req.chat.messages = [*await _conversation(gateway, request, req.previous), *req.input]
    session = await gateway.client.open_session(req.instructions, client_name=owner, tools=req.chat.tools)
    session.detach()
    return Placed(session, 0, opened=True)


async def _keep(placed: Placed, req: ResponseRequest, context: str, response: dict, result: p.GenerateResult) -> None:
    """Store the response as its session's newest point, with its note; a
    session opened for a response not stored is closed: nothing can continue it."""
    if not req.store:
        if placed.opened:
            await placed.session.close()
        return
    reply = {"role": "assistant", "content": _text(response)}
    if result.tool_calls:
        reply["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in result.tool_calls]
    note = {"response": response, "input": req.input, "reply": reply, "previous": req.previous, "context": context}
    try:
        await placed.session.mark({response["id"]: 0}, notes={response["id"]: json.dumps(note)}, from_end=True)
    except errors.KvmuxError as exc:  # the reply stands; only its id cannot be continued or fetched
        log.warning("response_not_stored", response=response["id"], error=str(exc))


# ------------------------------------------------------------------ response


def _message_item(text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    item_id = f"msg_{uuid.uuid4().hex}"
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    item_id = f"fc_{uuid.uuid4().hex}"
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}  # fmt: skip


def _text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def _usage(held: int, result: p.GenerateResult) -> dict:
    prompt = held + result.prompt_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": held},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + result.completion_tokens,
    }


def _response(response_id: str, created: int, req: ResponseRequest, **fields) -> dict:
    """The response object; without a result (`fields`: output, result,
    held) it is in progress."""
    result: p.GenerateResult | None = fields.get("result")
    status, incomplete = "in_progress", None
    if result is not None:
        cut = str(result.stop_reason) == "max_tokens"
        status, incomplete = ("incomplete", {"reason": "max_output_tokens"}) if cut else ("completed", None)
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": req.chat.model,
        "output": fields.get("output", []),
        "previous_response_id": req.previous,
        "store": req.store,
        "metadata": req.metadata,
        "usage": _usage(fields["held"], result) if result is not None else None,
        **req.echo,
    }


def _output(text: str, result: p.GenerateResult) -> list[dict]:
    items = [_message_item(text)] if text else []
    return items + [_call_item(c.id, c.name, c.arguments) for c in result.tool_calls]


# ------------------------------------------------------------------ routes


@answered
async def create(gateway: Gateway, request: Request) -> Response:
    body = await json_body(request)
    req = _parse(body)
    context = _context(req, _owner(gateway, request))
    placed = await _place(gateway, request, req, context)
    stream = placed.session.generate(messages=_protocol_messages(req.chat.messages), **req.chat.options)
    response_id = f"resp_{placed.session.id}{uuid.uuid4().hex[:16]}"
    created = int(time.time())
    headers = {SESSION_HEADER: placed.session.id}
    if req.chat.stream:
        first = await _first(stream)  # errors before the first token are still HTTP errors
        events = _events(placed, req, context, stream, first, response_id, created)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    parts = [chunk.text async for chunk in stream]
    result = stream.result
    output = _output(_content("".join(parts), result), result)
    response = _response(response_id, created, req, output=output, result=result, held=placed.held)
    await _keep(placed, req, context, response, result)
    return JSONResponse(response, headers=headers)


async def _events(placed: Placed, req, context, stream, first, response_id: str, created: int) -> AsyncIterator[str]:
    """Responses' typed server-sent events: an output item per run of text
    (its content part and text deltas) or per function call (its arguments'
    deltas), each closed before the next opens. A client that goes away
    cancels the generation (closing the stream tells the worker)."""
    numbers = itertools.count()
    items: list[dict] = []
    open_item: dict | None = None
    held_back = ""  # whitespace before any text: a reply that is only calls has no message

    def sse(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(numbers), **data})}\n\n"

    def place(item: dict) -> dict:
        return {"item_id": item["id"], "output_index": items.index(item)}

    def close() -> Iterator[str]:
        nonlocal open_item
        item, open_item = open_item, None
        if item is None:
            return
        item["status"] = "completed"
        if item["type"] == "message":
            part = {"type": "output_text", "text": item.pop("text"), "annotations": []}
            item["content"] = [part]
            yield sse("response.output_text.done", **place(item), content_index=0, text=part["text"], logprobs=[])
            yield sse("response.content_part.done", **place(item), content_index=0, part=part)
        else:
            yield sse("response.function_call_arguments.done", **place(item), arguments=item["arguments"])
        yield sse("response.output_item.done", output_index=items.index(item), item=item)

    def start(item: dict) -> Iterator[str]:
        nonlocal open_item
        yield from close()
        items.append(item)
        open_item = item
        yield sse("response.output_item.added", output_index=len(items) - 1, item=dict(item))

    def deltas(chunk: p.Chunk) -> Iterator[str]:
        nonlocal held_back
        text = held_back + chunk.text
        if text.strip():
            held_back = ""
            if open_item is None or open_item["type"] != "message":
                yield from start({**_message_item("", "in_progress"), "text": ""})
                part = {"type": "output_text", "text": "", "annotations": []}
                yield sse("response.content_part.added", **place(open_item), content_index=0, part=part)
            open_item["text"] += text
            yield sse("response.output_text.delta", **place(open_item), content_index=0, delta=text, logprobs=[])
        else:
            held_back = text
        for call in chunk.tool_calls:
            if call.id is not None:
                yield from start(_call_item(call.id, call.name, "", "in_progress"))
            if call.arguments:
                open_item["arguments"] += call.arguments
                yield sse("response.function_call_arguments.delta", **place(open_item), delta=call.arguments)

    try:
        started = _response(response_id, created, req)
        yield sse("response.created", response=started)
        yield sse("response.in_progress", response=started)
        async for chunk in chunks(first, stream):
            for out in deltas(chunk):
                yield out
        for out in close():
            yield out
        result = stream.result
        response = _response(response_id, created, req, output=items, result=result, held=placed.held)
        await _keep(placed, req, context, response, result)
        yield sse(f"response.{response['status']}", response=response)
    except errors.KvmuxError as exc:
        err = _from_kvmux(exc)
        yield sse("error", code=err.code, message=err.message, param=None)
    finally:
        await stream.aclose()


@answered
async def retrieve(gateway: Gateway, request: Request) -> Response:
    """GET a stored response; DELETE forgets it (and its session, once no
    response of it is left)."""
    response_id = request.path_params["response_id"]
    stored = await _stored(gateway, request, response_id)
    if request.method == "GET":
        return JSONResponse(stored.note["response"])
    if (await stored.session.mark({}, drop=[response_id])).marks == 0:
        await stored.session.close()
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@answered
async def input_items(gateway: Gateway, request: Request) -> Response:
    """The input items of a stored response, as the request gave them."""
    note = (await _stored(gateway, request, request.path_params["response_id"])).note
    data = [item for message in note["input"] for item in _items(message)]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return JSONResponse({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": False})


def _items(message: dict) -> list[dict]:
    """A kept message as the input items it came from."""
    if message["role"] == "tool":
        item = {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
        return [{**item, "id": f"fco_{uuid.uuid4().hex}", "status": "completed"}]
    calls = [_call_item(c["id"], c["name"], c["arguments"]) for c in message.get("tool_calls", [])]
    if calls and not message["content"]:
        return calls
    kind = "output_text" if message["role"] == "assistant" else "input_text"
    content = [{"type": kind, "text": message["content"]}]
    item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": message["role"], "content": content}
    return [{**item, "status": "completed"}, *calls]


def routes() -> list[Route]:
    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
    ]
