"""Errors: one type (`HTTPError`: a status, a message, OpenAI's type and
code, the parameter at fault), made from the gateway's own checks, from a
request that does not fit its schema (schemas.py) or from a kvmux error
code; and each API's dialect, which renders one as the body of an error
answer and as the data of a stream's error event."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvmux import protocol as p
from kvmux.client import errors


class HTTPError(Exception):
    """An answer in OpenAI's error shape: status, message, type, code, param."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.param: str | None = extra.get("param")
        self.headers: dict = extra.get("headers") or {}


def bad(message: str, param: str | None = None) -> HTTPError:
    """A request the gateway refuses (400)."""
    return HTTPError(400, message, "invalid_request_error", "invalid_value", param=param)


def not_json() -> HTTPError:
    return HTTPError(400, "the body is not JSON", "invalid_request_error", "invalid_json")


_PROBLEM = re.compile(r"(?P<problem>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?")
_FIELD = re.compile(r"Object (?P<what>contains unknown|missing required) field `(?P<name>[^`]*)`")
_VALUE = re.compile(r"Invalid (?:enum )?value (?P<value>.*)")


def invalid(exc: msgspec.ValidationError, at: str = "") -> HTTPError:
    """A body (or its part at path `at`) that does not fit its schema,
    named by the parameter's path (`tools[0].type`): a field the schema
    does not know is refused as one kvmux does not support, never dropped."""
    problem, path = _PROBLEM.fullmatch(str(exc)).group("problem", "path")
    path = ".".join(part for part in (at, path) if part).replace(".[", "[")
    field = _FIELD.fullmatch(problem)
    if field is not None:
        path = f"{path}.{field['name']}" if path else field["name"]
        unknown = field["what"] == "contains unknown"
        return bad(f"{path} is not supported by kvmux" if unknown else f"{path} is required", path)
    value = _VALUE.fullmatch(problem)
    if value is not None:  # a type (of a tool, a content part) or a choice kvmux does not know
        return bad(f"{path} {value['value']} is not supported by kvmux", path)
    return bad(f"{path}: {problem}" if path else problem, path or None)


def from_kvmux(exc: errors.KvmuxError) -> HTTPError:
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
        p.ErrorCode.MODEL_NOT_FOUND: 404,
        p.ErrorCode.FORBIDDEN: 403,
        p.ErrorCode.BUSY: 409,
        p.ErrorCode.WORKER_LOST: 502,
    }.get(exc.code, 500)
    param = "model" if exc.code == p.ErrorCode.MODEL_NOT_FOUND else None
    return HTTPError(status, str(exc), "invalid_request_error" if status < 500 else "server_error", code, param=param)


@dataclass(frozen=True)
class Dialect:
    """How an API's clients read an error: the body of an error answer,
    and the data of the `error` event that ends a stream it cut short."""

    body: Callable[[HTTPError], dict]
    event: Callable[[HTTPError], dict]

    def answer(self, exc: HTTPError | errors.KvmuxError) -> JSONResponse:
        if isinstance(exc, errors.KvmuxError):
            exc = from_kvmux(exc)
        return JSONResponse(self.body(exc), status_code=exc.status, headers=exc.headers)


def _openai(exc: HTTPError) -> dict:
    return {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}}


def _openai_event(exc: HTTPError) -> dict:
    return {"error": {"message": exc.message, "type": exc.kind, "code": exc.code}}


def _responses_event(exc: HTTPError) -> dict:
    return {"code": exc.code, "message": exc.message, "param": exc.param}


# Anthropic's error types by status; any other is api_error (5xx) or invalid_request_error.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def _anthropic_event(exc: HTTPError) -> dict:
    kind = ANTHROPIC_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


OPENAI = Dialect(_openai, _openai_event)  # chat completions, models, the page's routes
RESPONSES = Dialect(_openai, _responses_event)  # its stream's typed error event
ANTHROPIC = Dialect(_anthropic_event, _anthropic_event)  # Messages: the body is its error event


def answered(dialect: Dialect):
    """A route `handler(gateway, request)` whose HTTPError and kvmux
    errors are answered in `dialect` (the caller's key was checked on the
    way in: auth.py)."""

    def wrap(handler):
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request.app.state.gateway, request)
            except (HTTPError, errors.KvmuxError) as exc:
                request.app.state.gateway.metrics.refused(exc)
                return dialect.answer(exc)

        return endpoint

    return wrap
