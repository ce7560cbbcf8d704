"""kvmux wire contract, protocol v1 (depends on msgspec only)."""

from .codec import (  # noqa: F401  (the package re-exports its API)
    DECODE_ERRORS,
    DEFAULT_MAX_APPEND_TOKENS,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_TOKENS_LIMIT,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    PRIORITIES,
    PROTOCOL_VERSION,
    REPLY_OPS,
    REQUEST_BODIES,
    SESSION_OPS,
    WORKER_BODIES,
    Envelope,
    Op,
    ProtocolError,
    decode_body,
    decode_envelope,
    decode_reply,
    encode,
    envelope,
    error_body,
)
from .errors import (  # noqa: F401
    ErrorCode,
    FormatType,
    ModelState,
    OverloadReason,
    PrefixMode,
    SpeculativeMode,
    StopReason,
    ToolChoice,
)
from .messages import *  # noqa: F403  (the message Structs are the API)
