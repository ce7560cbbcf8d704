"""OpenAI's Responses API on live sessions: POST /v1/responses (plain, or
streamed as its typed server-sent events), GET and DELETE /v1/responses/{id}
and GET /v1/responses/{id}/input_items.

A stored response (`store`, true by default) is a named point of its
session (protocol Mark) whose note keeps the response object, its input and
the id it continued, in the session's record; its name is made of its id
and its caller's, so the broker finds it (Find) for that caller alone. A
chain (`previous_response_id`) thus costs only the new input's prefill and
outlives the gateway, the daemon and the worker, with no state in the
gateway.

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
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmux import logs
from kvmux import protocol as p
from kvmux.client import errors

from . import auth, schemas, sse
from .conversation import Chat, Reply, Usage, calls, content, options, prefix_mode
from .errors import RESPONSES, HTTPError, answered, bad
from .gateway import SESSION_HEADER, Gateway

log = logs.get("http.responses")


def _not_found(response_id: str) -> HTTPError:
    return HTTPError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "not_found")


# ------------------------------------------------------------------ request


def _input(items: list[schemas.InputItem]) -> list[dict]:
    """The input as the gateway keeps messages: a function_call item joins
    the assistant message before it (or starts one), a
    function_call_output is a tool message."""
    out: list[dict] = []
    for item in items:
        if isinstance(item, schemas.FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif isinstance(item, schemas.FunctionCallItem):
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            call = {"id": item.call_id, "name": item.name, "arguments": item.arguments}
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            text = item.content if isinstance(item.content, str) else "".join(part.text for part in item.content)
            out.append({"role": "system" if item.role == "developer" else item.role, "content": text})
    if out[-1]["role"] == "assistant":
        raise bad("the input must not end with the assistant's message: there is nothing to reply to", "input")
    return out


@dataclass
class ResponseRequest:
    chat: Chat  # the messages to send, the sampling options, the tools
    input: list[dict]  # the request's own input, as messages
    instructions: str | None
    previous: str | None
    store: bool
    metadata: dict
    echo: dict  # the request's settings as the response object repeats them


def _request(body: schemas.Responses) -> ResponseRequest:
    given = _input(body.items())
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice
    chat = Chat(
        messages=list(given),
        options=options(
            max_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            speculative=body.speculative,
            priority=body.priority,
            tool_choice=p.NamedTool(name=choice.name) if isinstance(choice, schemas.ResponsesNamed) else choice,
            parallel_tool_calls=body.parallel_tool_calls,
            format=fmt.format() if fmt is not None else None,
        ),
        model=body.model,
        stream=body.stream,
        tools=[t.tool() for t in body.tools or []],
    )
    echo = {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
        "tools": msgspec.to_builtins(body.tools or []),
        "tool_choice": msgspec.to_builtins(choice) if choice is not None else "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "truncation": "disabled",
    }
    return ResponseRequest(
        chat, given, body.instructions, body.previous_response_id, body.store, body.metadata or {}, echo
    )


def _context(req: ResponseRequest, owner: str) -> str:
    """What a session is opened with: a response continues in its session
    only with the same instructions, tools and model, from the same caller."""
    tools = [msgspec.to_builtins(t) for t in req.chat.tools]
    model = [req.chat.session_model] if req.chat.session_model is not None else []  # the default's: as before
    parts = [owner, req.instructions, tools, *model]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------ stored


def _name(owner: str, response_id: str) -> str:
    """A stored response's name in its session: its id, and its caller's."""
    return hashlib.sha256(f"{owner}\n{response_id}".encode()).hexdigest()


@dataclass
class Stored:
    session: object  # a detached handle on its session
    name: str  # its name there
    at: int  # the session's messages at the response
    note: dict  # the response object, its input, its reply, the id it continued, its context
    info: p.SessionInfo


async def _stored(gateway: Gateway, request: Request, response_id: str) -> Stored:
    """A stored response of the caller's, found by its name (the broker's
    index: Find); 404 for an unknown one, another key's, or one whose
    session is gone."""
    name = _name(auth.owner(gateway, request), response_id)
    found = await gateway.client.find([name])
    if found is None:
        raise _not_found(response_id)
    try:
        session = await gateway.client.resume_session(found.session_id)
        session.detach()  # a handle only: the session outlives the gateway
        info = await session.info(marks=[name])
    except (errors.SessionNotFound, errors.SessionExpired):
        raise _not_found(response_id) from None
    if name not in info.marks:
        raise _not_found(response_id)
    return Stored(session, name, info.marks[name], json.loads(info.notes[name]), info)


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
    owner = auth.owner(gateway, request)
    prefix = prefix_mode(request)
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
    session = await gateway.client.open_session(
        req.instructions,
        client_name=owner,
        tools=req.chat.tools,
        prefix=prefix,
        priority=req.chat.options.get("priority"),
        model=req.chat.session_model,
    )
    session.detach()
    return Placed(session, 0, opened=True)


@dataclass
class Turn:
    """The response being made: its request, its session, its id and name."""

    req: ResponseRequest
    placed: Placed
    context: str
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    name: str = ""  # _name(owner, id)
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, reply: Reply | None = None, output=()) -> dict:
        """The response object; in progress until its reply has ended."""
        req, status, incomplete = self.req, "in_progress", None
        if reply is not None:
            cut = str(reply.result.stop_reason) == "max_tokens"
            status, incomplete = ("incomplete", {"reason": "max_output_tokens"}) if cut else ("completed", None)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": req.chat.model,
            "output": list(output),
            "previous_response_id": req.previous,
            "store": req.store,
            "metadata": req.metadata,
            "usage": _usage(reply.usage) if reply is not None else None,
            **req.echo,
        }

    async def keep(self, response: dict, result: p.GenerateResult) -> None:
        """Store the response as its session's newest point, with its note;
        a session opened for a response not stored is closed: nothing can
        continue it."""
        req, session = self.req, self.placed.session
        if not req.store:
            if self.placed.opened:
                await session.close()
            return
        reply = {"role": "assistant", "content": _text(response)}
        if result.tool_calls:
            reply["tool_calls"] = calls(result)
        note = {
            "response": response,
            "input": req.input,
            "reply": reply,
            "previous": req.previous,
            "context": self.context,
        }
        try:
            await session.mark({self.name: 0}, notes={self.name: json.dumps(note)}, from_end=True)
        except errors.KvmuxError as exc:  # the reply stands; only its id cannot be continued or fetched
            log.warning("response_not_stored", response=self.id, error=str(exc))


# ------------------------------------------------------------------ response


def _message_item(text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    item_id = f"msg_{uuid.uuid4().hex}"
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_status(arguments: str) -> str:
    """A call's, once it ends: incomplete when max_output_tokens cut its arguments."""
    try:
        json.loads(arguments)
    except ValueError:
        return "incomplete"
    return "completed"


def _call_item(call_id: str, name: str, arguments: str, status: str | None = None) -> dict:
    status = status or _call_status(arguments)
    item_id = f"fc_{uuid.uuid4().hex}"
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}  # fmt: skip


def _text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def _usage(counts: Usage) -> dict:
    return {
        "input_tokens": counts.prompt,
        "input_tokens_details": {"cached_tokens": counts.cached},
        "output_tokens": counts.completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counts.prompt + counts.completion,
    }


# ------------------------------------------------------------------ routes


class _Events:
    """Responses' server-sent events: each typed and numbered in its stream."""

    def __init__(self) -> None:
        self.numbers = itertools.count()

    def __call__(self, kind: str, **data) -> str:
        return sse.event({"type": kind, "sequence_number": next(self.numbers), **data}, kind)

    def error(self, exc: HTTPError) -> str:
        return self("error", **RESPONSES.event(exc))


@answered(RESPONSES)
async def create(gateway: Gateway, request: Request) -> Response:
    req = _request(await schemas.read(request, schemas.Responses))
    auth.prioritize(gateway, request, req.chat.options)
    owner = auth.owner(gateway, request)
    context = _context(req, owner)
    turn = Turn(req, await _place(gateway, request, req, context), context)
    turn.name = _name(owner, turn.id)
    reply = await Reply.start(
        turn.placed.session, turn.placed.held, req.chat.messages, req.chat.options, gateway.metrics.watch("responses")
    )
    headers = {SESSION_HEADER: turn.placed.session.id}
    if req.chat.stream:
        event = _Events()
        return sse.response(_events(event, turn, reply), reply.stream, event.error, headers)
    parts = [chunk.text async for chunk in reply.chunks()]
    result = reply.result
    text = content("".join(parts), result)
    output = ([_message_item(text)] if text else []) + [
        _call_item(c.id, c.name, c.arguments) for c in result.tool_calls
    ]
    response = turn.response(reply, output)
    await turn.keep(response, result)
    return JSONResponse(response, headers=headers)


async def _events(event: _Events, turn: Turn, reply: Reply) -> AsyncIterator[str]:
    """An output item per run of text (its content part and text deltas) or
    per function call (its arguments' deltas), each closed before the next
    opens."""
    items: list[dict] = []
    open_item: dict | None = None
    held_back = ""  # whitespace before any text: a reply that is only calls has no message

    def place(item: dict) -> dict:
        return {"item_id": item["id"], "output_index": items.index(item)}

    def close() -> Iterator[str]:
        nonlocal open_item
        item, open_item = open_item, None
        if item is None:
            return
        if item["type"] == "message":
            item["status"] = "completed"
            part = {"type": "output_text", "text": item.pop("text"), "annotations": []}
            item["content"] = [part]
            yield event("response.output_text.done", **place(item), content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **place(item), content_index=0, part=part)
        else:
            item["status"] = _call_status(item["arguments"])
            yield event("response.function_call_arguments.done", **place(item), arguments=item["arguments"])
        yield event("response.output_item.done", output_index=items.index(item), item=item)

    def start(item: dict) -> Iterator[str]:
        nonlocal open_item
        yield from close()
        items.append(item)
        open_item = item
        yield event("response.output_item.added", output_index=len(items) - 1, item=dict(item))

    def deltas(chunk: p.Chunk) -> Iterator[str]:
        nonlocal held_back
        text = held_back + chunk.text
        if text.strip():
            held_back = ""
            if open_item is None or open_item["type"] != "message":
                yield from start({**_message_item("", "in_progress"), "text": ""})
                part = {"type": "output_text", "text": "", "annotations": []}
                yield event("response.content_part.added", **place(open_item), content_index=0, part=part)
            open_item["text"] += text
            yield event("response.output_text.delta", **place(open_item), content_index=0, delta=text, logprobs=[])
        else:
            held_back = text
        for call in chunk.tool_calls:
            if call.id is not None:
                yield from start(_call_item(call.id, call.name, "", "in_progress"))
            if call.arguments:
                open_item["arguments"] += call.arguments
                yield event("response.function_call_arguments.delta", **place(open_item), delta=call.arguments)

    started = turn.response()
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    async for chunk in reply.chunks():
        for out in deltas(chunk):
            yield out
    for out in close():
        yield out
    response = turn.response(reply, items)
    await turn.keep(response, reply.result)
    yield event(f"response.{response['status']}", response=response)


@answered(RESPONSES)
async def retrieve(gateway: Gateway, request: Request) -> Response:
    """GET a stored response; DELETE forgets it (and its session, once no
    response of it is left)."""
    response_id = request.path_params["response_id"]
    stored = await _stored(gateway, request, response_id)
    if request.method == "GET":
        return JSONResponse(stored.note["response"])
    if (await stored.session.mark({}, drop=[stored.name])).marks == 0:
        await stored.session.close()
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@answered(RESPONSES)
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
