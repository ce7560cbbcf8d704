"""The page at `/` (static/: plain HTML, CSS and JavaScript shipped in the
package, nothing fetched from elsewhere) and what it calls beside chat
completions: the caller's own sessions (the broker names each session's
owner: one per API key, auth.owner) and the daemon's stats, with the
gateway's own timings of the replies it streamed (no other process sees a
reply's first token as its client does)."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

import msgspec
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from . import auth, schemas
from .errors import OPENAI, answered
from .gateway import Gateway

STATIC = Path(__file__).parent / "static"
WINDOW_S = 600.0  # how far back the dashboard's plots go
MIN_DECODE_S = 0.2  # a shorter decode is not timed: its chunks come in bursts
# The page runs only its own files: a reply's text never becomes markup
# (page.js renders it as text nodes), and this forbids any other script.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class Metrics:
    """Streamed chat replies of the last WINDOW_S: time to first token and
    decode tokens/s, as the gateway's clients saw them."""

    def __init__(self) -> None:
        self.replies: deque[tuple[float, float, float | None]] = deque()  # (at, ttft_s, decode tok/s)
        self.workers_seen: set[str] = set()  # worker ids: those gone left (a restart registers a new one)

    def add(self, ttft_s: float, tok_s: float | None) -> None:
        now = time.monotonic()
        self.replies.append((now, ttft_s, tok_s))
        while self.replies and self.replies[0][0] < now - WINDOW_S:
            self.replies.popleft()

    def recent(self) -> dict:
        """Each reply as [seconds ago, value]."""
        now = time.monotonic()
        kept = [r for r in self.replies if r[0] >= now - WINDOW_S]
        return {
            "window_s": WINDOW_S,
            "ttft_s": [[round(now - at, 1), round(ttft, 4)] for at, ttft, _ in kept],
            "decode_tok_s": [[round(now - at, 1), round(rate, 2)] for at, _, rate in kept if rate is not None],
        }


class Watch:
    """ASGI middleware that leaves the routes as they are and times the
    replies POST /v1/chat/completions streams: it answers once the first
    token is out, so the first body chunk is the first token; the usage
    event (stream_options.include_usage) ends the decode."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        seen = {"streamed": False, "first": None, "tok_s": None}

        async def timed(message: dict) -> None:
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers") or []).get(b"content-type", b"")
                seen["streamed"] = message["status"] == 200 and kind.startswith(b"text/event-stream")
            elif seen["streamed"] and message.get("body"):
                now = time.monotonic()
                seen["first"] = seen["first"] or now
                if b'"usage"' in message["body"]:
                    seen["tok_s"] = _decode_rate(message["body"], now - seen["first"])
            await send(message)

        try:
            await self.app(scope, receive, timed)
        finally:
            if seen["first"] is not None:
                self.metrics.add(seen["first"] - start, seen["tok_s"])


def _decode_rate(event: bytes, seconds: float) -> float | None:
    """Tokens/s after the first, from a usage event's completion_tokens;
    none for a decode too short to time (a reply drafted and accepted
    whole comes in one chunk)."""
    try:
        usage = json.loads(event.decode().removeprefix("data: "))["usage"]
        tokens = int(usage["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return None
    return (tokens - 1) / seconds if tokens > 1 and seconds >= MIN_DECODE_S else None


def _plain(value: object) -> object:
    """As JSON builtins with every field: a Struct's to_builtins leaves out
    those at their default (live, exact, no refusals), which the page shows."""
    if isinstance(value, msgspec.Struct):
        return {name: _plain(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return msgspec.to_builtins(value)


def _answer(handler):
    """A JSON endpoint, with OpenAI's error shape."""

    async def endpoint(gateway: Gateway, request: Request) -> Response:
        return JSONResponse(await handler(gateway, request))

    return answered(OPENAI)(endpoint)


async def sessions(gateway: Gateway, request: Request) -> dict:
    """The caller's sessions, live and hibernated."""
    return {"data": _plain(await auth.mine(gateway, request))}


async def session(gateway: Gateway, request: Request) -> dict:
    """One of the caller's sessions with its info (a hibernated one's comes
    from its record: asking does not restore it)."""
    summary = await auth.own(gateway, request, request.path_params["session_id"])
    handle = await gateway.client.resume_session(summary.session_id)
    try:
        info = await handle.info()
    finally:
        handle.detach()  # a handle only: the gateway's close must leave the session be
    return {**_plain(summary), **_plain(info)}


async def rewind(gateway: Gateway, request: Request) -> dict:
    """Take one of the caller's sessions back to the end of an earlier turn
    (the page's regenerate: before the last message, which it then sends
    again): the slab keeps the rest of the conversation."""
    summary = await auth.own(gateway, request, request.path_params["session_id"])
    body = await schemas.read(request, schemas.Rewind)
    handle = await gateway.client.resume_session(summary.session_id)
    try:
        return _plain(await handle.rewind(body.messages))
    finally:
        handle.detach()


def _stats(metrics: Metrics):
    async def stats(gateway: Gateway, request: Request) -> dict:
        """The broker's stats without its endpoints (the admin's business),
        and the gateway's timings."""
        broker = await gateway.client.stats()
        current = {w.worker_id for w in broker.workers}
        metrics.workers_seen |= current
        body = _plain(broker)
        del body["endpoints"]
        return {"broker": body, "workers_gone": len(metrics.workers_seen - current), "gateway": metrics.recent()}

    return stats


async def index(request: Request) -> Response:
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    return FileResponse(STATIC / "index.html", headers=headers)


def routes(metrics: Metrics) -> list[BaseRoute]:
    return [
        Route("/", index, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
        Route("/v1/kvmux/sessions", _answer(sessions), methods=["GET"]),
        Route("/v1/kvmux/sessions/{session_id}", _answer(session), methods=["GET"]),
        Route("/v1/kvmux/sessions/{session_id}/rewind", _answer(rewind), methods=["POST"]),
        Route("/v1/kvmux/stats", _answer(_stats(metrics)), methods=["GET"]),
    ]


def middleware(metrics: Metrics) -> Middleware:
    return Middleware(Watch, metrics=metrics)
