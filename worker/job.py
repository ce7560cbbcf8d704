"""A running append or generate on one session: the coroutine of Steps and
NewTokens the engine gives it (worker/engine.py), where it stands, and its
flow control; the scheduler (worker/scheduler.py) resumes it."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import mlx.core as mx

from .engine import LiveSession, Step
from .tool_calls import ToolCallStream


@dataclass
class Job:
    """A running append or generate on one session."""

    session: LiveSession
    route: bytes
    request_id: int
    steps: Generator | None = None
    ask: Step | None = None  # what the job asked for at its last boundary
    decoding: bool = False  # its last ask was a decode step
    logits: mx.array | None = None  # the answer, sent into `steps` when it resumes
    cancelled: bool = False
    credit: int = 0  # Generate.credit: chunks that may be unacknowledged; 0 = no flow control
    outstanding: int = 0  # chunks sent minus credits returned
    # the closes (route, request id, keep) waiting for this job: each gets its answer
    close_after: list[tuple[bytes, int, bool]] = field(default_factory=list)
    saved: bool = False  # the session's record was written after this job's work
    calls: ToolCallStream | None = None  # a generate whose reply is read for tool calls
    priority: int = 0  # Sampling.priority: higher goes first in the scheduler's passes

    @property
    def runnable(self) -> bool:
        return self.cancelled or not self.credit or self.outstanding < self.credit

    @property
    def stopping(self) -> bool:
        """Cancelled, or its reply's last tool call is in (parallel calls off)."""
        return self.cancelled or (self.calls is not None and self.calls.finished)
