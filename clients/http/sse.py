"""Server-sent events: a reply streamed as events, which an error midway
ends with the API's error event, and whose generation is closed however
the stream ends: a client that goes away cancels it (closing the stream
tells the worker)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from kvmux.client import errors

from .errors import HTTPError, from_kvmux


def event(data: dict, kind: str | None = None) -> str:
    """One event: its `event:` line where it has a kind, its data as JSON."""
    data_line = f"data: {json.dumps(data)}\n\n"
    return f"event: {kind}\n{data_line}" if kind else data_line


def response(
    events: AsyncIterator[str], generation, error: Callable[[HTTPError], str], headers: dict
) -> StreamingResponse:
    """`events` as a text/event-stream answer; a kvmux error ends them with
    `error(the error)`; `generation` (the stream they read) is closed at
    the end, the client's going away included."""

    async def body() -> AsyncIterator[str]:
        try:
            async for out in events:
                yield out
        except errors.KvmuxError as exc:
            yield error(from_kvmux(exc))
        finally:
            await generation.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
