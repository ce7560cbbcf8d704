"""The gateway's routes: POST /v1/chat/completions (streamed as server-sent
events or not), GET /v1/models, GET /health; errors as OpenAI's error
object; Bearer API keys."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvmux import logs
from kvmux import protocol as p
from kvmux.client import AsyncClient, errors

from . import binding
from .binding import Bound

log = logs.get("http")

SESSION_HEADER = "X-Kvmux-Session"
FINISH = {"eos": "stop", "stop": "stop", "cancelled": "stop", "max_tokens": "length", "tool_calls": "tool_calls"}


@dataclass
class Gateway:
    endpoint: str | None
    api_keys: list[str] = field(default_factory=list)  # none: loopback only (the CLI checks the host)
    timeout_s: float = 600.0
    client: AsyncClient | None = None


class HTTPError(Exception):
    """An answer in OpenAI's error shape: status, message, type, code, param."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.param: str | None = extra.get("param")
        self.headers: dict = extra.get("headers") or {}


def _error(exc: HTTPError) -> JSONResponse:
    body = {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _from_kvmux(exc: errors.KvmuxError) -> HTTPError:
    """A kvmux error code as an HTTP status and OpenAI error type."""
    code = str(exc.code)
    if isinstance(exc, errors.Overloaded):
        retry = str(max(1, round(exc.retry_after_s or 1)))
        if exc.reason == p.OverloadReason.QUOTA.value:
            return HTTPError(429, str(exc), "rate_limit_exceeded", code, headers={"Retry-After": retry})
        return HTTPError(503, str(exc), "server_error", code, headers={"Retry-After": retry})
    status = {
        p.ErrorCode.INVALID_ARGUMENT: 400,
        p.ErrorCode.FRAME_TOO_LARGE: 400,
        p.ErrorCode.SESSION_NOT_FOUND: 404,
        p.ErrorCode.FORBIDDEN: 403,
        p.ErrorCode.BUSY: 409,
        p.ErrorCode.WORKER_LOST: 502,
    }.get(exc.code, 500)
    return HTTPError(status, str(exc), "invalid_request_error" if status < 500 else "server_error", code)


def _check_key(gateway: Gateway, request: Request) -> None:
    if not gateway.api_keys:
        return
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not any(hmac.compare_digest(given.encode(), key.encode()) for key in gateway.api_keys):
        raise HTTPError(401, "invalid API key", "invalid_request_error", "invalid_api_key")


def _owner(gateway: Gateway, request: Request) -> str:
    """The owner (the broker's client_name) of the sessions a caller opens:
    one per API key, so that no key lists or continues another's (page.py)."""
    if not gateway.api_keys:
        return "kvmux-http"
    key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    return f"kvmux-http:{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def answered(handler):
    """A route behind the gateway's API keys: `handler(gateway, request)`,
    its HTTPError and kvmux errors answered in OpenAI's error shape."""

    async def endpoint(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        try:
            _check_key(gateway, request)
            return await handler(gateway, request)
        except HTTPError as exc:
            return _error(exc)
        except errors.KvmuxError as exc:
            return _error(_from_kvmux(exc))

    return endpoint


@dataclass
class ChatRequest:
    messages: list[dict]  # role, content, and a call's tool_calls or a result's tool_call_id
    stream: bool
    options: dict
    include_usage: bool
    model: str
    template_kwargs: dict | None = None  # chat_template_kwargs, for a session it opens
    tools: list[p.Tool] = field(default_factory=list)  # for a session it opens
    logprobs: bool = False
    owner: str = ""  # the caller's identity (_owner): another key's conversation is never continued

    @property
    def context(self) -> dict | None:
        """What a session is opened with beside its messages, and whose it
        is: a request with other template options or tools, or from another
        key, is another conversation."""
        context = {"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else {}
        if self.owner:
            context["owner"] = self.owner
        if self.tools:
            context["tools"] = [msgspec.to_builtins(t) for t in self.tools]
        return context or None


# Parameters read, and those that change nothing at their default (refused
# otherwise): any other is refused by name, never dropped.
PARAMETERS = {
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "seed", "stop", "n", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "logprobs", "top_logprobs", "user", "speculative", "chat_template_kwargs",
}  # fmt: skip
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "store": False, "metadata": None}


def _bad(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", "invalid_value", param=param)


def _numbers(body: dict, kinds: dict[str, type]) -> dict:
    """The sampling numbers a request gives (`kinds`: name -> int or float,
    a float taking an int too); a bool or anything else is a 400."""
    options = {}
    for name, kind in kinds.items():
        value = body.get(name)
        if value is not None:
            if not isinstance(value, (int, float) if kind is float else int) or isinstance(value, bool):
                raise _bad(f"{name} must be a number", name)
            options[name] = value
    return options


def speculative(body: dict) -> dict:
    """`speculative`, a kvmux extension every route takes (the SDKs' extra_body):
    auto, off, lookup or draft (the worker refuses another value by name)."""
    mode = body.get("speculative")
    if mode is None:
        return {}
    if not isinstance(mode, str):
        raise _bad("speculative must be one of auto, off, lookup, draft", "speculative")
    return {"speculative": mode}


def _message(m: object) -> dict:
    """A request's message as the gateway keeps it: role, text content, and
    a call's tool_calls ({id, name, arguments}) or a result's tool_call_id."""
    if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        raise _bad("every message needs a role: system, user, assistant or tool", "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = m.get("tool_calls") or []
    if content is None and (calls or m["role"] == "assistant"):
        content = ""
    if not isinstance(content, str):
        raise _bad("every message needs text content", "messages")
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
    if calls:
        try:
            out["tool_calls"] = [
                {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
            ]
        except (KeyError, TypeError):
            raise _bad("a tool call needs an id and a function with a name and arguments", "messages") from None
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise _bad("a tool message needs the tool_call_id it answers", "messages")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _tools(body: dict) -> tuple[list[p.Tool], dict]:
    """The request's tools and the options that go with them."""
    tools, options = [], {}
    for tool in body.get("tools") or []:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad("tools must be functions: {type: function, function: {name, parameters}}", "tools")
        parameters = function.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise _bad(f"tools: {function['name']}'s parameters must be a JSON schema object", "tools")
        tools.append(
            p.Tool(name=function["name"], description=function.get("description") or "", parameters=parameters)
        )
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise _bad("tool_choice: {type: function, function: {name}}", "tool_choice")
            choice = p.NamedTool(name=name)
        elif choice not in ("auto", "none", "required"):
            raise _bad("tool_choice must be auto, none, required or a function", "tool_choice")
        options["tool_choice"] = choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
        options["parallel_tool_calls"] = parallel
    return tools, options


def _response_format(value: object) -> p.Format | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return p.Format(type="json_object")
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise _bad("response_format json_schema needs json_schema.schema (an object)", "response_format")
        return p.Format(type="json_schema", schema=schema)
    raise _bad("response_format type must be text, json_object or json_schema", "response_format")


def _parse(body: object) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    for name, value in body.items():
        if name not in PARAMETERS and (name not in NEUTRAL or value not in (NEUTRAL[name], None)):
            raise _bad(f"{name} is not supported by kvmux", name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    clean = [_message(m) for m in messages]
    if clean[-1]["role"] == "assistant":
        raise _bad("the last message must not be the assistant's: there is nothing to reply to", "messages")
    if body.get("n", 1) != 1:
        raise _bad("n must be 1", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    options = _numbers(
        {**body, "max_tokens": max_tokens}, {"max_tokens": int, "temperature": float, "top_p": float, "seed": int}
    )
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop must be a string or a list of strings", "stop")
        options["stop"] = stop
    options.update(speculative(body))
    template_kwargs = body.get("chat_template_kwargs")  # vLLM's extension (the openai SDK's extra_body)
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise _bad("chat_template_kwargs must be an object", "chat_template_kwargs")
    tools, tool_options = _tools(body)
    options.update(tool_options)
    if body.get("response_format") is not None:
        fmt = _response_format(body["response_format"])
        if fmt is not None:
            options["format"] = fmt
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs not in (None, True, False):
        raise _bad("logprobs must be true or false", "logprobs")
    if top is not None:
        if not logprobs:
            raise _bad("top_logprobs needs logprobs true", "top_logprobs")
        if not isinstance(top, int) or isinstance(top, bool):
            raise _bad("top_logprobs must be an integer", "top_logprobs")
    if logprobs:
        options["logprobs"] = top or 0
    stream_options = body.get("stream_options") or {}
    return ChatRequest(
        messages=clean,
        stream=bool(body.get("stream", False)),
        options=options,
        include_usage=bool(stream_options.get("include_usage")) if isinstance(stream_options, dict) else False,
        model=str(body.get("model") or "kvmux"),
        template_kwargs=template_kwargs,
        tools=tools,
        logprobs=bool(logprobs),
    )


def _protocol_messages(messages: list[dict]) -> list[p.ChatMessage]:
    return [msgspec.convert(m, p.ChatMessage) for m in messages]


async def _session(gateway: Gateway, request: Request, chat: ChatRequest):
    """The session to continue (pinned, or found by the binding) and the
    messages it still needs; a new one otherwise. The gateway holds a
    handle only (detached): the session is its caller's and outlives the
    gateway, whose client would close it on the way out."""
    chat.owner = _owner(gateway, request)
    session, bound, new = await _find_session(gateway, request, chat)
    session.detach()
    return session, bound, new


async def _find_session(gateway: Gateway, request: Request, chat: ChatRequest):
    client = gateway.client
    pinned = request.headers.get(SESSION_HEADER)
    if pinned:
        session = await client.resume_session(pinned)
        last = max((i for i, m in enumerate(chat.messages) if m["role"] == "assistant"), default=-1)
        return session, Bound(session.id, 0, pinned=True), chat.messages[last + 1 :]
    claimed = await binding.claim(client, chat.messages, chat.context)
    if claimed is not None:
        return claimed
    messages = chat.messages
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    session = await client.open_session(
        system, client_name=chat.owner, chat_template_kwargs=chat.template_kwargs, tools=chat.tools
    )
    return session, Bound(session.id, 0), messages[1:] if system is not None else messages


def _usage(bound: Bound, result: p.GenerateResult) -> dict:
    prompt = bound.held + result.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": result.completion_tokens,
        "total_tokens": prompt + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": bound.held},
    }


async def json_body(request: Request) -> object:
    """The request's JSON body; a 400 when it is not JSON."""
    try:
        return await request.json()
    except ValueError:
        raise HTTPError(400, "the body is not JSON", "invalid_request_error", "invalid_json") from None


@answered
async def chat_completions(gateway: Gateway, request: Request) -> Response:
    body = await json_body(request)
    chat = _parse(body)
    session, bound, new = await _session(gateway, request, chat)
    stream = session.generate(messages=_protocol_messages(new), **chat.options)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    headers = {SESSION_HEADER: session.id}
    if chat.stream:
        first = await _first(stream)  # errors before the first token are still HTTP errors
        events = _events(chat, session, bound, stream, first, completion_id, created)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    chunks = [chunk async for chunk in stream]
    result = stream.result
    text = _content("".join(chunk.text for chunk in chunks), result)
    usage = _usage(bound, result)
    await _rebind(session, chat, bound, text, result)
    message = {"role": "assistant", "content": text}
    if result.tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": _openai_calls(result.tool_calls)}
    choice = {"index": 0, "message": message, "finish_reason": FINISH[str(result.stop_reason)]}
    if chat.logprobs:
        choice["logprobs"] = {"content": [_logprob(lp) for chunk in chunks for lp in chunk.logprobs]}
    body = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": chat.model,
        "choices": [choice],
        "usage": usage,
    }
    return JSONResponse(body, headers=headers)


async def chunks(first: p.Chunk | None, stream) -> AsyncIterator[p.Chunk]:
    """A stream's chunks, the first (read before the response began: `_first`) included."""
    if first is not None:
        yield first
        async for chunk in stream:
            yield chunk


async def _first(stream) -> p.Chunk | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _content(text: str, result: p.GenerateResult) -> str:
    """A reply's text as sent (its calls' text never is), less the spaces
    around its calls (the worker's `content`)."""
    return text.strip() if result.tool_calls else text


def _openai_calls(calls: list[p.ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _logprob(lp: p.Logprobs) -> dict:
    """A token's logprobs in OpenAI's shape."""

    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**entry(lp.text, lp.logprob), "top_logprobs": [entry(t.text, t.logprob) for t in lp.top]}


async def _rebind(session, chat: ChatRequest, bound: Bound, text: str, result: p.GenerateResult) -> None:
    """The session now holds the conversation and its reply: name it there,
    under the reply as the client will send it back (its calls too)."""
    if str(result.stop_reason) == "cancelled" or bound.pinned:
        return  # a partial reply: no client will send it back as it is; a pinned session is its client's
    bound.held += result.prompt_tokens + result.completion_tokens
    reply = {"role": "assistant", "content": text}
    if result.tool_calls:
        reply["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in result.tool_calls]
    try:
        await binding.bind(session, bound, [*chat.messages, reply], chat.context)
    except errors.KvmuxError as exc:  # the reply stands; the next turn opens a session anew
        log.warning("gateway_bind_failed", session=session.id, error=str(exc))


async def _events(chat, session, bound, stream, first, completion_id, created) -> AsyncIterator[str]:
    """Server-sent events; a client that goes away cancels the generation
    (closing the stream tells the worker)."""

    def event(delta: dict, finish: str | None = None, usage: dict | None = None, logprobs: dict | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        chunk = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": chat.model,
            "choices": [choice] if usage is None else [],
        }
        if usage is not None:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    def deltas(chunk: p.Chunk) -> Iterator[str]:
        extra = {"logprobs": {"content": [_logprob(lp) for lp in chunk.logprobs]}} if chat.logprobs else {}
        if chunk.text or (extra and not chunk.tool_calls):
            yield event({"content": chunk.text}, **extra)
        for call in chunk.tool_calls:
            function = {"arguments": call.arguments}
            delta = {"index": call.index, "function": function}
            if call.id is not None:
                delta.update(id=call.id, type="function")
                function["name"] = call.name
            yield event({"tool_calls": [delta]}, **extra)

    parts = []
    try:
        yield event({"role": "assistant", "content": ""})
        async for chunk in chunks(first, stream):
            parts.append(chunk.text)
            for out in deltas(chunk):
                yield out
        result = stream.result
        usage = _usage(bound, result)
        await _rebind(session, chat, bound, _content("".join(parts), result), result)
        yield event({}, FINISH[str(result.stop_reason)])
        if chat.include_usage:
            yield event({}, usage=usage)
        yield "data: [DONE]\n\n"
    except errors.KvmuxError as exc:
        err = _from_kvmux(exc)
        yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.kind, 'code': err.code}})}\n\n"
    finally:
        await stream.aclose()


@answered
async def models(gateway: Gateway, request: Request) -> Response:
    stats = await gateway.client.stats()
    names = sorted({w.model for w in stats.workers})
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvmux"} for name in names]
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        await gateway.client.ping(timeout=2.0)
    except errors.KvmuxError as exc:
        return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
    return JSONResponse({"status": "ok"})


def make_app(gateway: Gateway) -> Starlette:
    from . import messages, page, responses  # they import this module

    @asynccontextmanager
    async def lifespan(app: Starlette):
        gateway.client = AsyncClient(gateway.endpoint, timeout=gateway.timeout_s)
        app.state.gateway = gateway
        try:
            yield
        finally:
            await gateway.client.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/messages", messages.messages, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    routes += responses.routes()
    metrics = page.Metrics()
    routes += page.routes(metrics)
    return Starlette(routes=routes, middleware=[page.middleware(metrics)], lifespan=lifespan)
