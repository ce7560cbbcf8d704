"""A session's durable record: what outlives the worker, the broker and the
daemon. Its fields are declared once, here.

`SessionState` is what a live session carries and its record keeps as it
is: the worker's live session (worker/engine.py: `LiveSession`) is a
subclass, so turning one into the other is a copy of these fields by name
(`state_fields`), never a hand-written list. `SessionRecord` adds what the
record derives from the live session when it is written (the model, the
conversation, the time). `RecordHead` (protocol's StoredSession) is the part
the broker reads of every record: msgspec skips the rest unread.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvmux.protocol import Sampling, StoredSession, Tool

RECORD_VERSION = 1
_SESSION_ID = re.compile(r"^[0-9a-f]{32}$")  # the broker's uuid4().hex


def is_session_id(value: object) -> bool:
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None


class StoreError(Exception):
    """A record that is missing, truncated or not a kvmux record."""


class Fenced(StoreError):
    """A write from a placement of the session that is no longer its own: the
    session was placed again (a worker declared lost, then back)."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (a Redis server down or unreachable)."""


class StoreFull(StoreError):
    """The store has no room for a write (a full disk, a Redis server at its
    maxmemory): nothing of that write is stored, what was stored stays."""


class Turn(msgspec.Struct, array_like=True):
    """Where a turn of the conversation ended (its messages queued, or a
    reply closed): a rewind may take the session back there."""

    messages: int  # the conversation's messages
    rendered: int  # characters of its rendered text
    tokens: int  # history and pending tokens


class SessionState(msgspec.Struct, kw_only=True):
    session_id: str
    sink: int
    window: int
    owner: str = ""  # the identity the per-client quota (and, with CURVE, ownership) counts
    created: float = 0.0  # wall-clock seconds
    sampling: Sampling | None = None  # the session's defaults (OpenSession.sampling)
    tools: list[Tool] = []  # functions the model may call (OpenSession.tools)
    history: list[int] = []  # every token fed into the slab, those the window dropped too
    pending: list[int] = []  # appended, not fed yet
    raw: bool = False  # the last append was raw token ids: generate continues them, no template
    snapshot: str | None = None  # slab snapshot holding the first `snapshot_tokens` of history
    snapshot_tokens: int = 0
    layout: str = ""  # how the worker that wrote the snapshot split the model ("": one process; worker/group.py)
    replay: list[int] = []  # sizes of the chunks fed since the snapshot, in order
    turns: list[Turn] = []  # where each turn ended, oldest first (Rewind)
    marks: dict[str, int] = {}  # named points of the conversation: name -> messages (Mark)
    notes: dict[str, str] = {}  # a client's note beside a name
    restores: int = 0
    last_restore_s: float = 0.0


class SessionRecord(SessionState, kw_only=True):
    version: int = RECORD_VERSION
    model: str
    updated: float  # wall-clock seconds
    tokens: int = 0  # len(history) + len(pending), readable without decoding them
    system: str | None = None
    messages: list[dict[str, Any]] = []  # as the chat template takes them (a call's tool_calls too)
    rendered: str = ""  # the conversation's text fed so far (template pieces, replies as generated)
    chat_template_kwargs: dict[str, Any] = {}


def state_fields(state: SessionState) -> dict[str, Any]:
    """`state`'s SessionState fields by name (lists and maps copied): what a
    record takes from a live session and a restored session from its record."""
    fields = {name: getattr(state, name) for name in SessionState.__struct_fields__}
    return {name: type(value)(value) if isinstance(value, (list, dict)) else value for name, value in fields.items()}


# What the broker reads of every record (msgspec skips the rest unread),
# and what a worker tells a broker that cannot read its store (READY.stored).
RecordHead = StoredSession

encode = msgspec.msgpack.Encoder().encode
_record_decoder = msgspec.msgpack.Decoder(SessionRecord)
_head_decoder = msgspec.msgpack.Decoder(RecordHead)


def decode_record(data: bytes) -> SessionRecord:
    return _record_decoder.decode(data)


def decode_head(data: bytes) -> RecordHead:
    return _head_decoder.decode(data)
