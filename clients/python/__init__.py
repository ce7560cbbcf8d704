"""The thin kvmux client: pyzmq + msgspec, no MLX.

    from kvmux.client import Client
    with Client() as client, client.open_session(system="Be brief.") as session:
        for chunk in session.chat("Hello!", max_tokens=32):
            print(chunk.text, end="", flush=True)

`AsyncClient` has the same surface for asyncio. Replies are the protocol's
msgspec Structs (Chunk, GenerateResult, SessionInfo, ...), re-exported here.
"""

from kvmux.protocol import (
    Ack,
    Appended,
    BrokerStats,
    ChatMessage,
    Chunk,
    Closed,
    ErrorCode,
    GenerateResult,
    OverloadReason,
    Pong,
    Sampling,
    SessionInfo,
    SessionOpened,
    SessionSummary,
    WorkerStats,
)

from .aio import AsyncClient, AsyncSession, AsyncStream
from .errors import (
    Busy,
    Cancelled,
    Forbidden,
    FrameTooLarge,
    Internal,
    InvalidArgument,
    KvmuxError,
    MalformedFrame,
    ModelNotFound,
    Overloaded,
    SessionCorrupt,
    SessionExpired,
    SessionNotFound,
    Timeout,
    UnknownOp,
    VersionMismatch,
    WorkerLost,
)
from .sync import Client, Session, Stream

__all__ = [
    "Ack",
    "Appended",
    "AsyncClient",
    "AsyncSession",
    "AsyncStream",
    "BrokerStats",
    "Busy",
    "Cancelled",
    "ChatMessage",
    "Chunk",
    "Client",
    "Closed",
    "ErrorCode",
    "Forbidden",
    "FrameTooLarge",
    "GenerateResult",
    "Internal",
    "InvalidArgument",
    "KvmuxError",
    "MalformedFrame",
    "ModelNotFound",
    "OverloadReason",
    "Overloaded",
    "Pong",
    "Sampling",
    "Session",
    "SessionCorrupt",
    "SessionExpired",
    "SessionInfo",
    "SessionNotFound",
    "SessionOpened",
    "SessionSummary",
    "Stream",
    "Timeout",
    "UnknownOp",
    "VersionMismatch",
    "WorkerLost",
    "WorkerStats",
]
