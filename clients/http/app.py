"""The gateway's app: the broker's client opened at startup, each API's
routes (chat.py, messages.py, responses.py, page.py), GET /health, /ready
and /metrics, and the middleware in front of them: the callers' keys and
sessions (auth.Auth), the page's timings (page.Watch), the requests'
count (metrics.Count) and, while it traces, their spans (traces.Traced)."""

from __future__ import annotations

from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmux import tracing
from kvmux.client import AsyncClient, errors

from . import chat, messages, page, responses
from .auth import Auth
from .errors import ANTHROPIC
from .gateway import Gateway
from .metrics import Count
from .traces import Traced

# Each route's dialect, where it is not OpenAI's: how auth.Auth refuses a caller there.
DIALECTS = {"/v1/messages": ANTHROPIC}


async def health(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        await gateway.client.ping(timeout=2.0)
    except errors.KvmuxError as exc:
        return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Whether a load balancer should send requests here: 503 while the
    daemon drains, has no worker or cannot reach its session store (or
    does not answer), each reason said."""
    gateway: Gateway = request.app.state.gateway
    try:
        stats = await gateway.client.stats(timeout=2.0)
    except errors.KvmuxError as exc:
        return JSONResponse({"status": "unavailable", "reasons": [f"daemon: {exc}"]}, status_code=503)
    reasons = [
        why
        for failing, why in (
            (stats.draining, "the daemon is draining"),
            (not stats.workers, "no worker is registered"),
            (bool(stats.store_error), f"the session store: {stats.store_error}"),
        )
        if failing
    ]
    if reasons:
        return JSONResponse({"status": "unavailable", "reasons": reasons}, status_code=503)
    return JSONResponse({"status": "ready"})


def make_app(gateway: Gateway) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):
        gateway.client = AsyncClient(gateway.endpoint, timeout=gateway.timeout_s)
        app.state.gateway = gateway
        try:
            yield
        finally:
            await gateway.client.close()

    metrics = page.Metrics()
    routes = [*chat.routes(), *messages.routes(), *responses.routes(), *page.routes(metrics)]
    routes.append(Route("/health", health, methods=["GET"]))
    routes.append(Route("/ready", ready, methods=["GET"]))
    routes.append(Route("/metrics", gateway.metrics.endpoint, methods=["GET"]))
    middleware = [
        Middleware(Count, metrics=gateway.metrics),
        Middleware(Auth, dialects=DIALECTS),
        page.middleware(metrics),
    ]
    if tracing.enabled():
        middleware.insert(0, Middleware(Traced))
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
