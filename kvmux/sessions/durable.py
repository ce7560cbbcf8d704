"""A live session to its record and back.

A worker saves a session after every request (`save`): its record, and a
slab snapshot when the session hibernates or more than
SNAPSHOT_AFTER_CHUNKS chunks have run since the last one. A restore
(`restorable`, then worker/restore.py) loads the last snapshot, or starts
from an empty slab, and runs the tokens that came after it through the slab
again in the chunks they first ran in (`replay`): the same shapes through
the same model compute the same keys and values, so the restored slab and
logits equal the lost ones bit for bit, for a session that decoded alone.
(A decode step batched with other sessions reduces in another order;
replaying it alone can differ in the last bits.)

No MLX is imported here: a live session is the worker's, seen as `Live`.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from kvmux.protocol import ErrorCode, Info, Mark, ProtocolError, SessionInfo

from .record import SessionRecord, SessionState, StoreError, StoreUnavailable, state_fields
from .store import SessionStore


class Conversation(Protocol):
    """worker/conversation.py's Conversation, as a record keeps it."""

    messages: list[dict[str, Any]]
    rendered: str
    kwargs: dict[str, Any]


class Live(Protocol):
    """worker/engine.py's LiveSession as this module uses it: a SessionState
    (every field of which goes into the record) with its slab, the logits
    after its last token and its conversation."""

    session_id: str
    history: list[int]
    pending: list[int]
    snapshot: str | None
    snapshot_tokens: int
    replay: list[int]
    epoch: int  # its placement's (SessionStore.claim)
    slab: list
    logits: Any  # mx.array | None
    conversation: Conversation


# A crash replays at most this many forward passes (a decode step is one).
SNAPSHOT_AFTER_CHUNKS = 64


def record_of(session: Live, model_id: str) -> SessionRecord:
    """The record of a live session."""
    conv = session.conversation
    return SessionRecord(
        **state_fields(session),
        model=model_id,
        updated=time.time(),
        tokens=len(session.history) + len(session.pending),
        messages=conv.messages,
        rendered=conv.rendered,
        chat_template_kwargs=conv.kwargs,
    )


def save(store: SessionStore, session: Live, model_id: str, *, snapshot_now: bool = False) -> int:
    """Write the session's record (first a slab snapshot when asked or when
    the replay has grown long); returns the bytes written. Raises Fenced
    when the session was placed again since this copy was."""
    written = 0
    snapshotting = snapshot_now or len(session.replay) > SNAPSHOT_AFTER_CHUNKS
    if snapshotting:
        name, size = store.save_snapshot(session.session_id, session.slab, session.logits)
        session.snapshot, session.snapshot_tokens, session.replay = name, len(session.history), []
        written += size
    written += store.save(record_of(session, model_id), session.epoch)
    if snapshotting:  # only now, with the record naming the new one, may the old go
        store.prune_snapshots(session.session_id, session.snapshot)
    return written


def stored(store: SessionStore, session_id: str) -> SessionRecord:
    """The session's record; raises ProtocolError (session_not_found,
    session_corrupt, or internal while the store is unreachable)."""
    try:
        if not store.exists(session_id):
            raise ProtocolError(ErrorCode.SESSION_NOT_FOUND, f"no session {session_id}")
        record = store.load(session_id)
    except StoreUnavailable as exc:  # not the record's fault: the session stays, for a later call
        raise ProtocolError(ErrorCode.INTERNAL, str(exc)) from None
    except StoreError as exc:
        raise ProtocolError(ErrorCode.SESSION_CORRUPT, f"session {session_id} is corrupt: {exc}") from None
    return record


def restorable(store: SessionStore, session_id: str, model_id: str, layout: str = "") -> SessionRecord:
    """The record to restore a session from, checked, on a worker whose
    model is split as `layout` says; raises ProtocolError
    (session_not_found, session_corrupt)."""
    record = stored(store, session_id)
    if record.model != model_id:
        raise ProtocolError(
            ErrorCode.SESSION_CORRUPT, f"session {session_id} was made with {record.model}, this worker runs {model_id}"
        )
    if record.snapshot is not None and record.layout != layout:
        raise ProtocolError(
            ErrorCode.SESSION_CORRUPT,
            f"session {session_id}'s slab snapshot was written by a worker of another layout"
            f" ({record.layout or 'one process'}; this worker: {layout or 'one process'}):"
            " a worker of that layout restores it",
        )
    tail = len(record.history) - record.snapshot_tokens
    if sum(record.replay) != tail or not (0 <= record.snapshot_tokens <= len(record.history)):
        raise ProtocolError(ErrorCode.SESSION_CORRUPT, f"session {session_id} is corrupt: its replay does not add up")
    return record


def conversation_of(record: SessionRecord) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """The record's conversation as the worker's Conversation takes it:
    (messages, rendered text, template kwargs)."""
    return record.messages, record.rendered, record.chat_template_kwargs


MARK_NAME_MAX = 256  # characters of a name (Mark)
MARK_NOTE_MAX = 1 << 20  # characters of a note


def mark(state: SessionState, body: Mark, messages: int) -> None:
    """Apply a Mark to a session whose conversation holds `messages`
    messages; raises ProtocolError (invalid_argument) before changing
    anything for a point it has not reached or an oversized name or note."""
    points = {name: messages - at if body.from_end else at for name, at in body.marks.items()}
    for name, at in points.items():
        if not name or len(name) > MARK_NAME_MAX:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"a mark's name takes 1 to {MARK_NAME_MAX} characters")
        if not 0 <= at <= messages:
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT, f"mark {name!r} at {at} messages: the conversation holds {messages}"
            )
    for name, note in body.notes.items():
        if name not in body.marks:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"a note for {name!r}, which this mark does not name")
        if len(note) > MARK_NOTE_MAX:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"the note of {name!r} exceeds {MARK_NOTE_MAX} characters")
    for name in body.drop:
        state.marks.pop(name, None)
        state.notes.pop(name, None)
    state.marks.update(points)
    for name in points:
        state.notes.pop(name, None)
    state.notes.update(body.notes)


def unmark_past(state: SessionState, messages: int) -> None:
    """Forget the names of points past `messages` (a rewind took them away)."""
    for name in [name for name, at in state.marks.items() if at > messages]:
        del state.marks[name]
        state.notes.pop(name, None)


def marked(state: SessionState, names: list[str]) -> dict[str, Any]:
    """Of `names`, those the session has: SessionInfo's marks and notes."""
    return {
        "marks": {n: state.marks[n] for n in names if n in state.marks},
        "notes": {n: state.notes[n] for n in names if n in state.notes},
    }


def hibernated_info(record: SessionRecord, slab_bytes: int, idle_s: float, body: Info) -> SessionInfo:
    """SESSION INFO for a hibernated session, from its record (the broker's
    answer, or a worker's for a store the broker does not read)."""
    history = record.history + record.pending
    return SessionInfo(
        session_id=record.session_id,
        worker_id="",
        history_tokens=len(history),
        cached_tokens=0,
        kv_live_bytes=0,
        slab_bytes=slab_bytes,
        truncated_tokens=max(0, len(record.history) - record.sink - record.window),
        idle_s=idle_s,
        sink=record.sink,
        window=record.window,
        busy=False,
        messages=len(record.messages),
        token_ids=history if body.token_ids else None,
        state="hibernated",
        restores=record.restores,
        last_restore_s=record.last_restore_s,
        pending_tokens=len(record.pending),
        **marked(record, body.marks),
    )
