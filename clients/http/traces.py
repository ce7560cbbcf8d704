"""The gateway's server spans, while it traces (kvmux/tracing.py): one per
/v1/ request, continuing the trace its W3C `traceparent` header names (a
new one otherwise). The requests it makes of the daemon meanwhile carry
the span on, so the broker's and the worker's spans are its children."""

from __future__ import annotations

from kvmux import tracing

from .metrics import api_of


class Traced:
    """ASGI middleware: each /v1/ request in a server span named by its method and API."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        with tracing.server_span(f"{scope['method']} {api_of(scope['path']) or 'v1'}", headers) as span:

            async def traced(message: dict) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, traced)
