"""The inproc pipe between a worker's I/O thread (server.py) and its compute
thread (scheduler.py): the only thing the two threads share.

Three-part messages `[route, envelope, body]` are requests (I/O -> compute)
or replies (compute -> I/O), passed through as the broker framed them (an
empty route is the broker's own, as for RESTORED). Anything else is
control, `[name]` or `[name, payload]`:

    I/O -> compute   DRAIN         take no new sessions, finish running work
                     CANCEL_ALL    the drain's grace is over: cancel every job
                     STOP          the drain is done: save the sessions and end
    compute -> I/O   LOADED, ready the model is loaded; payload: the READY body
                     FAILED        loading or the compute loop died
                     FAILED, REFUSED  the model or draft model cannot be served
                     STATUS, body  slabs and jobs changed; payload: `Status`
"""

from __future__ import annotations

import msgspec

from kvmux import protocol as p

PIPE = "inproc://kvmux-compute"

DRAIN = b"drain"
CANCEL_ALL = b"cancel_all"
STOP = b"stop"
LOADED = b"loaded"
FAILED = b"failed"
REFUSED = b"refused"
STATUS = b"status"


class Status(msgspec.Struct, array_like=True):
    """What the I/O thread reports in heartbeats and READY, and waits on to
    finish a drain."""

    free_slabs: int
    running: int  # jobs (appends and generates) in progress
    sessions: dict[str, str]  # live sessions held in slabs, each with its owner (READY carries both)
    draining: bool = False  # DRAIN was seen: `running` counts every job there will be
    drafted: int = 0  # speculative decoding, over the worker's life: tokens drafted
    accepted: int = 0  # and accepted
    link_bytes: int = 0  # a worker group's rank 0: bytes sent to and received from its other ranks
    kv_bytes: int = 0  # KV cache the live sessions hold (their kv_live_bytes summed)
    prefixes: p.PrefixCounts | None = None  # shared prefixes (worker/prefixes.py)


def encode_status(status: Status) -> bytes:
    return msgspec.msgpack.encode(status)


def decode_status(raw: bytes) -> Status:
    return msgspec.msgpack.decode(raw, type=Status)
