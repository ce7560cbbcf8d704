"""One exception class per protocol error code, all under `KvmuxError`.

Raised from ERROR replies (and, for `Timeout`, when no reply came within the
call's timeout). `code` and the overload details travel with the exception so
a caller can retry on `Overloaded.retry_after_s`.
"""

from __future__ import annotations

from kvmux.protocol import Error as ErrorReply
from kvmux.protocol import ErrorCode


class KvmuxError(Exception):
    """Base of every kvmux client error."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        retry_after_s: float | None = None,
        queue_depth: int | None = None,
        request_id: int | None = None,
        session_id: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.reason = reason  # OverloadReason value for Overloaded
        self.retry_after_s = retry_after_s
        self.queue_depth = queue_depth
        self.request_id = request_id
        self.session_id = session_id


class SessionNotFound(KvmuxError):
    code = ErrorCode.SESSION_NOT_FOUND


class SessionExpired(KvmuxError):
    code = ErrorCode.SESSION_EXPIRED


class SessionCorrupt(KvmuxError):
    code = ErrorCode.SESSION_CORRUPT


class Forbidden(KvmuxError):
    """An admin op (DRAIN) from an identity that is not admin."""

    code = ErrorCode.FORBIDDEN


class InvalidArgument(KvmuxError):
    code = ErrorCode.INVALID_ARGUMENT


class MalformedFrame(KvmuxError):
    code = ErrorCode.MALFORMED_FRAME


class UnknownOp(KvmuxError):
    code = ErrorCode.UNKNOWN_OP


class Busy(KvmuxError):
    code = ErrorCode.BUSY


class Overloaded(KvmuxError):
    code = ErrorCode.OVERLOADED


class WorkerLost(KvmuxError):
    code = ErrorCode.WORKER_LOST


class Cancelled(KvmuxError):
    code = ErrorCode.CANCELLED


class VersionMismatch(KvmuxError):
    code = ErrorCode.VERSION_MISMATCH


class FrameTooLarge(KvmuxError):
    code = ErrorCode.FRAME_TOO_LARGE


class ModelNotFound(KvmuxError):
    code = ErrorCode.MODEL_NOT_FOUND


class Timeout(KvmuxError, TimeoutError):
    """No reply within the call's timeout (a stream's: per frame)."""

    code = ErrorCode.TIMEOUT


class Internal(KvmuxError):
    code = ErrorCode.INTERNAL


ERRORS: dict[ErrorCode, type[KvmuxError]] = {cls.code: cls for cls in KvmuxError.__subclasses__()}
assert set(ERRORS) == set(ErrorCode), "every ErrorCode needs its exception class"


def from_reply(reply: ErrorReply, request_id: int | None = None, session_id: str | None = None) -> KvmuxError:
    """The exception for an ERROR reply body."""
    return ERRORS[reply.code](
        reply.message,
        reason=reply.reason,
        retry_after_s=reply.retry_after_s,
        queue_depth=reply.queue_depth,
        request_id=request_id,
        session_id=session_id or None,
    )
