"""structlog set-up shared by every kvmux process: JSON lines when stderr is
not a terminal (launchd, CI, pipes), coloured key=value when it is.

One event style in every process: the event is a short snake_case identifier
of what happened, the same on every call (`worker_lost`, `session_opened`,
`turn_failed`), never prose or an f-string; whatever varies goes in key=value
fields. Operators filter the JSON lines on `event`, so an event name is part
of the interface:

    log.warning("worker_lost", worker=worker_id, sessions=len(sessions))

Loggers are named by process and module, dotted: `broker`, `worker.model`,
`bench`.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(level: str | None = None) -> None:
    level_name = (level or os.environ.get("KVMUX_LOG_LEVEL", "info")).upper()
    renderer = structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=True,
    )


class _Stderr:
    """sys.stderr looked up at each write, not at configure time: a host
    (pytest's capture, a daemoniser) may swap or close the stream after."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def get(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
