"""The gateway's routes: POST /v1/chat/completions (streamed as server-sent
events or not), GET /v1/models, GET /health; errors as OpenAI's error
object; Bearer API keys."""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvmux import protocol as p
from kvmux.client import AsyncClient, errors

from .binding import Bindings, Bound

SESSION_HEADER = "X-Kvmux-Session"
FINISH = {"eos": "stop", "stop": "stop", "cancelled": "stop", "max_tokens": "length"}


@dataclass
class Gateway:
    endpoint: str | None
    api_keys: list[str] = field(default_factory=list)  # none: loopback only (the CLI checks the host)
    timeout_s: float = 600.0
    client: AsyncClient | None = None
    bindings: Bindings = field(default_factory=Bindings)


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


@dataclass
class ChatRequest:
    messages: list[dict[str, str]]
    stream: bool
    options: dict
    include_usage: bool
    model: str
    template_kwargs: dict | None = None  # chat_template_kwargs, for a session it opens


def _parse(body: object) -> ChatRequest:
    def bad(message: str, param: str | None = None) -> HTTPError:
        return HTTPError(400, message, "invalid_request_error", "invalid_value", param=param)

    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    clean = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: text only
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad("every message needs a role: system, user, assistant or tool", "messages")
        if not isinstance(content, str):
            raise bad("every message needs text content", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if clean[-1]["role"] == "assistant":
        raise bad("the last message must not be the assistant's: there is nothing to reply to", "messages")
    if body.get("n", 1) != 1:
        raise bad("n must be 1", "n")
    options = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    for name, value, kind in (
        ("max_tokens", max_tokens, int),
        ("temperature", body.get("temperature"), (int, float)),
        ("top_p", body.get("top_p"), (int, float)),
        ("seed", body.get("seed"), int),
    ):
        if value is not None:
            if not isinstance(value, kind) or isinstance(value, bool):
                raise bad(f"{name} must be a number", name)
            options[name] = value
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop must be a string or a list of strings", "stop")
        options["stop"] = stop
    speculative = body.get("speculative")  # a kvmux extension (the openai SDK's extra_body)
    if speculative is not None:
        if not isinstance(speculative, str):
            raise bad("speculative must be one of auto, off, lookup, draft", "speculative")
        options["speculative"] = speculative
    template_kwargs = body.get("chat_template_kwargs")  # vLLM's extension (the openai SDK's extra_body)
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise bad("chat_template_kwargs must be an object", "chat_template_kwargs")
    stream_options = body.get("stream_options") or {}
    return ChatRequest(
        messages=clean,
        stream=bool(body.get("stream", False)),
        options=options,
        include_usage=bool(stream_options.get("include_usage")) if isinstance(stream_options, dict) else False,
        model=str(body.get("model") or "kvmux"),
        template_kwargs=template_kwargs,
    )


async def _session(gateway: Gateway, request: Request, chat: ChatRequest):
    """The session to continue (pinned, or found by the binding) and the
    messages it still needs; a new one otherwise."""
    client = gateway.client
    pinned = request.headers.get(SESSION_HEADER)
    if pinned:
        session = await client.resume_session(pinned)
        last = max((i for i, m in enumerate(chat.messages) if m["role"] == "assistant"), default=-1)
        return session, Bound(session.id, 0), chat.messages[last + 1 :]
    bound, held = gateway.bindings.claim(chat.messages, chat.template_kwargs)
    if bound is not None:
        try:
            return await client.resume_session(bound.session_id), bound, chat.messages[held:]
        except errors.KvmuxError as exc:  # closed, expired or lost by the daemon: start afresh
            if exc.code not in (
                p.ErrorCode.SESSION_NOT_FOUND,
                p.ErrorCode.SESSION_EXPIRED,
                p.ErrorCode.SESSION_CORRUPT,
            ):
                raise
    messages = chat.messages
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    session = await client.open_session(system, client_name="kvmux-http", chat_template_kwargs=chat.template_kwargs)
    return session, Bound(session.id, 0), messages[1:] if system is not None else messages


def _usage(bound: Bound, result: p.GenerateResult) -> dict:
    prompt = bound.held + result.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": result.completion_tokens,
        "total_tokens": prompt + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": bound.held},
    }


async def chat_completions(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        _check_key(gateway, request)
        try:
            body = await request.json()
        except ValueError:
            raise HTTPError(400, "the body is not JSON", "invalid_request_error", "invalid_json") from None
        chat = _parse(body)
        session, bound, new = await _session(gateway, request, chat)
        stream = session.generate(messages=new, **chat.options)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        headers = {SESSION_HEADER: session.id}
        if chat.stream:
            first = await _first(stream)  # errors before the first token are still HTTP errors
            events = _events(gateway, chat, session, bound, stream, first, completion_id, created)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        text = "".join([chunk.text async for chunk in stream])
        result = stream.result
        usage = _usage(bound, result)
        _rebind(gateway, chat, bound, text, result)
        body = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": chat.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": FINISH[str(result.stop_reason)],
                }
            ],
            "usage": usage,
        }
        return JSONResponse(body, headers=headers)
    except HTTPError as exc:
        return _error(exc)
    except errors.KvmuxError as exc:
        return _error(_from_kvmux(exc))


async def _first(stream) -> p.Chunk | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _rebind(gateway: Gateway, chat: ChatRequest, bound: Bound, text: str, result: p.GenerateResult) -> None:
    """The session now holds the conversation and its reply: bind it there."""
    if str(result.stop_reason) == "cancelled":
        return  # a partial reply: no client will send it back as it is
    bound.held += result.prompt_tokens + result.completion_tokens
    gateway.bindings.bind([*chat.messages, {"role": "assistant", "content": text}], bound, chat.template_kwargs)


async def _events(gateway, chat, session, bound, stream, first, completion_id, created) -> AsyncIterator[str]:
    """Server-sent events; a client that goes away cancels the generation
    (closing the stream tells the worker)."""

    def event(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
        chunk = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": chat.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None else [],
        }
        if usage is not None:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    parts = []
    try:
        yield event({"role": "assistant", "content": ""})
        if first is not None:
            parts.append(first.text)
            yield event({"content": first.text})
            async for chunk in stream:
                parts.append(chunk.text)
                if chunk.text:
                    yield event({"content": chunk.text})
        result = stream.result
        usage = _usage(bound, result)
        _rebind(gateway, chat, bound, "".join(parts), result)
        yield event({}, FINISH[str(result.stop_reason)])
        if chat.include_usage:
            yield event({}, usage=usage)
        yield "data: [DONE]\n\n"
    except errors.KvmuxError as exc:
        err = _from_kvmux(exc)
        yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.kind, 'code': err.code}})}\n\n"
    finally:
        await stream.aclose()


async def models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        _check_key(gateway, request)
        stats = await gateway.client.stats()
    except HTTPError as exc:
        return _error(exc)
    except errors.KvmuxError as exc:
        return _error(_from_kvmux(exc))
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
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
