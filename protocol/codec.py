"""Envelope and frame codec.

Every kvmux frame is a ZeroMQ multipart message whose last two parts are
``[envelope, body]``. The envelope is a 4-element msgpack array
``[version, op, request_id, session_id]`` that the broker reads; the body is
the op's msgpack map, forwarded untouched. Between broker and worker one more
part leads: the client's routing id (empty for the broker's own frames).
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import messages as m
from .errors import ErrorCode

PROTOCOL_VERSION = 1
# What decoding hostile bytes can raise: msgspec lets invalid UTF-8 inside a
# msgpack string through as a bare UnicodeDecodeError.
DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)
DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024
# A worker's defaults for the most tokens one generate may ask for and one
# append may add (`--max-tokens-limit`, `--max-append-tokens`).
DEFAULT_MAX_TOKENS_LIMIT = 4096
DEFAULT_MAX_APPEND_TOKENS = 32768
# Sampling.priority's bounds (higher first; 0 by default).
PRIORITIES = range(-100, 101)
# Any frame counts as a heartbeat; a peer silent for LIVENESS intervals is
# dead. 2.5 keeps detection inside three intervals even with a late poll.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 2.5


class Op:
    """Envelope ops. Requests flow client -> broker (-> worker); replies flow
    back with op PARTIAL (more follow), FINAL or ERROR (last of a request)."""

    # client requests
    OPEN = "open"
    APPEND = "append"
    GENERATE = "generate"
    CANCEL = "cancel"
    CREDIT = "credit"
    INFO = "info"
    CLOSE = "close"
    STATS = "stats"
    PING = "ping"
    DRAIN = "drain"
    RESUME = "resume"  # a handle on an existing session (the broker answers)
    SESSIONS = "sessions"  # list every session, live and hibernated
    REWIND = "rewind"  # take a session back to the end of an earlier turn
    MARK = "mark"  # name points of a session's conversation
    FIND = "find"  # the session that has a name (the broker answers)
    # worker <-> broker
    READY = "ready"
    HEARTBEAT = "heartbeat"
    DISCONNECT = "disconnect"
    HIBERNATE = "hibernate"  # broker -> worker: snapshot the session to the store, free its slab
    RESTORED = "restored"  # worker -> broker: a session came back from the store (timing)
    # replies
    PARTIAL = "partial"
    FINAL = "final"
    ERROR = "error"


REQUEST_BODIES: dict[str, type] = {
    Op.OPEN: m.OpenSession,
    Op.APPEND: m.Append,
    Op.GENERATE: m.Generate,
    Op.CANCEL: m.Cancel,
    Op.CREDIT: m.Credit,
    Op.INFO: m.Info,
    Op.CLOSE: m.Close,
    Op.STATS: m.Stats,
    Op.PING: m.Ping,
    Op.DRAIN: m.Drain,
    Op.RESUME: m.Resume,
    Op.SESSIONS: m.ListSessions,
    Op.HIBERNATE: m.Hibernate,
    Op.REWIND: m.Rewind,
    Op.MARK: m.Mark,
    Op.FIND: m.Find,
}
WORKER_BODIES: dict[str, type] = {
    Op.READY: m.WorkerReady,
    Op.HEARTBEAT: m.WorkerHeartbeat,
    Op.DISCONNECT: m.Disconnect,
    Op.RESTORED: m.Restored,
}
# Ops that address an existing session (envelope session_id required).
SESSION_OPS = frozenset(
    {Op.APPEND, Op.GENERATE, Op.CANCEL, Op.CREDIT, Op.INFO, Op.CLOSE, Op.RESUME, Op.REWIND, Op.MARK}
)
REPLY_OPS = frozenset({Op.PARTIAL, Op.FINAL, Op.ERROR})


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    version: int
    op: str
    request_id: int
    session_id: str = ""


class ProtocolError(Exception):
    """A frame that cannot be served; carries the typed code to answer with."""

    def __init__(self, code: ErrorCode, message: str, **extra: Any):
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra  # more Error fields: reason, retry_after_s, queue_depth


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_any_decoder = msgspec.msgpack.Decoder()
_reply_decoder = msgspec.msgpack.Decoder(m.ReplyBody)
_body_decoders = {op: msgspec.msgpack.Decoder(t) for op, t in {**REQUEST_BODIES, **WORKER_BODIES}.items()}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def envelope(op: str, request_id: int = 0, session_id: str = "") -> bytes:
    return _encoder.encode(Envelope(PROTOCOL_VERSION, op, request_id, session_id))


def decode_envelope(raw: bytes) -> Envelope:
    """Decode and version-check an envelope, or raise ProtocolError."""
    try:
        env = _envelope_decoder.decode(raw)
    except DECODE_ERRORS as exc:
        # A peer of another version may shape the envelope differently; say
        # so rather than "malformed" when its first element is a version.
        try:
            head = _any_decoder.decode(raw)
        except DECODE_ERRORS:
            head = None
        if isinstance(head, list) and head and isinstance(head[0], int) and head[0] != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"protocol version {head[0]} not supported (this peer speaks {PROTOCOL_VERSION})",
            ) from None
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"bad envelope: {exc}") from None
    if env.version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"protocol version {env.version} not supported (this peer speaks {PROTOCOL_VERSION})",
        )
    return env


def decode_body(op: str, raw: bytes) -> Any:
    """Decode a request or worker-control body for ``op``, or raise ProtocolError."""
    decoder = _body_decoders.get(op)
    if decoder is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}")
    try:
        return decoder.decode(raw)
    except DECODE_ERRORS as exc:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"bad {op} body: {exc}") from None


def decode_reply(raw: bytes) -> m.ReplyBody:
    try:
        return _reply_decoder.decode(raw)
    except DECODE_ERRORS as exc:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"bad reply body: {exc}") from None


def error_body(code: ErrorCode, message: str, **extra: Any) -> bytes:
    return _encoder.encode(m.Error(code=code, message=message, **extra))
