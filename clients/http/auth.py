"""Who calls: an API key (Bearer, or Anthropic's x-api-key) among the
gateway's, and the owner it makes of the sessions it opens (the broker's
client_name: one per key), so that no key lists, continues or pins
another's. `Auth` checks both in front of every /v1/ route, in the
route's dialect."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from starlette.requests import Request

from kvmux import logs
from kvmux import protocol as p
from kvmux.client import errors

from .errors import OPENAI, Dialect, HTTPError
from .gateway import SESSION_HEADER, Gateway

log = logs.get("http.auth")


def key(request: Request) -> str:
    bearer = request.headers.get("authorization")
    if bearer is None:
        return request.headers.get("x-api-key", "").strip()
    return bearer.removeprefix("Bearer ").strip()


def check_key(gateway: Gateway, request: Request) -> None:
    given = key(request).encode()
    if gateway.api_keys and not any(hmac.compare_digest(given, k.encode()) for k in gateway.api_keys):
        raise HTTPError(401, "invalid API key", "invalid_request_error", "invalid_api_key")


def owner(gateway: Gateway, request: Request) -> str:
    """The owner of the sessions a caller opens: one per API key."""
    if not gateway.api_keys:
        return "kvmux-http"  # every caller is the one loopback user
    return f"kvmux-http:{hashlib.sha256(key(request).encode()).hexdigest()[:12]}"


def prioritize(gateway: Gateway, request: Request, options: dict) -> None:
    """A request without a `priority` of its own gets its key's default, if the key has one."""
    default = gateway.priorities.get(key(request))
    if default is not None:
        options.setdefault("priority", default)


async def mine(gateway: Gateway, request: Request) -> list[p.SessionSummary]:
    """The caller's sessions, live and hibernated."""
    me = owner(gateway, request)
    return [s for s in await gateway.client.list_sessions() if s.owner == me]


async def own(gateway: Gateway, request: Request, session_id: str) -> p.SessionSummary:
    """The caller's session `session_id`; another key's is unknown (404)."""
    for summary in await mine(gateway, request):
        if summary.session_id == session_id:
            return summary
    log.info("session_refused", session=session_id)
    raise HTTPError(404, f"no session {session_id}", "invalid_request_error", str(p.ErrorCode.SESSION_NOT_FOUND))


class Auth:
    """ASGI middleware: a /v1/ request needs one of the gateway's keys
    (401), and one pinning a session (X-Kvmux-Session) another key's
    session is refused as unknown (404), answered in the route's dialect
    (`dialects` by path; OpenAI's otherwise). The page and /health are
    open."""

    def __init__(self, app, dialects: Mapping[str, Dialect]):
        self.app, self.dialects = app, dialects

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            request = Request(scope)
            try:
                await self.check(request.app.state.gateway, request)
            except (HTTPError, errors.KvmuxError) as exc:
                await self.dialects.get(scope["path"], OPENAI).answer(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def check(gateway: Gateway, request: Request) -> None:
        check_key(gateway, request)
        pinned = request.headers.get(SESSION_HEADER)
        if pinned and gateway.api_keys:
            await own(gateway, request, pinned)
