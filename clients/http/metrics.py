"""The gateway's Prometheus metrics at GET /metrics (prometheus_client's
text format, its naming conventions): requests by API and status,
`overloaded` answers by reason, and each reply's time to first token and
tokens as the gateway's clients see them. The daemon's own (slabs, the
store, workers) are its `--metrics-port`'s: a gateway is one client of it.
Labels are the API, never a session, a key or a client's model name."""

from __future__ import annotations

import functools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from starlette.requests import Request
from starlette.responses import Response

from kvmux.client import errors

# The APIs by path prefix (the first that matches), as the `api` label names them.
APIS = (
    ("/v1/chat/completions", "chat_completions"),
    ("/v1/responses", "responses"),
    ("/v1/messages", "messages"),
    ("/v1/models", "models"),
    ("/v1/kvmux/", "kvmux"),
)
_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def api_of(path: str) -> str | None:
    return next((api for prefix, api in APIS if path.startswith(prefix)), None)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvmux_http_requests", "Requests answered, by API and HTTP status.", ["api", "status"], registry=r
        )
        self.refusals = Counter(
            "kvmux_http_refusals",
            "Requests answered `overloaded` by the daemon, by its reason.",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvmux_http_time_to_first_token_seconds",
            "From a reply's generate sent to the daemon to its first token.",
            ["api"],
            buckets=_SECONDS,
            registry=r,
        )
        self.prefilled = Counter("kvmux_http_prefilled_tokens", "Prompt tokens prefilled.", ["api"], registry=r)
        self.cached = Counter(
            "kvmux_http_cached_tokens",
            "Prompt tokens not prefilled (usage's cached_tokens), by where they came from: session (its"
            " conversation's session held them) or prefix (a new session took them from a shared prefix).",
            ["api", "source"],
            registry=r,
        )
        self.generated = Counter("kvmux_http_generated_tokens", "Tokens generated.", ["api"], registry=r)

    def watch(self, api: str) -> Callable[..., None]:
        """What a reply of `api` calls when it has streamed to its end (`replied`'s other arguments)."""
        return functools.partial(self.replied, api)

    def replied(
        self, api: str, first_s: float | None, held: int, restored: int, prefilled: int, completion: int
    ) -> None:
        """A reply streamed to its end: its first token `first_s` after its
        generate was sent (None: no token), and its usage's tokens."""
        if first_s is not None:
            self.ttft.labels(api).observe(first_s)
        self.cached.labels(api, "session").inc(held)
        self.cached.labels(api, "prefix").inc(restored)
        self.prefilled.labels(api).inc(prefilled)
        self.generated.labels(api).inc(completion)

    def refused(self, exc: Exception) -> None:
        if isinstance(exc, errors.Overloaded):
            self.refusals.labels(exc.reason or "").inc()

    async def endpoint(self, request: Request) -> Response:
        """GET /metrics, in the format the scraper's Accept header asks for."""
        encode, content_type = choose_encoder(request.headers.get("accept"))
        return Response(encode(self.registry), headers={"Content-Type": content_type})


class Count:
    """ASGI middleware: every /v1/ request counted by API and status, when its answer starts."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        api = api_of(scope["path"]) if scope["type"] == "http" else None
        if api is None:
            await self.app(scope, receive, send)
            return

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(api, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
