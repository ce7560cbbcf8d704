"""A session's durable state on the worker side: its record written to the
store (kvmux/store.py) after every request, its slab snapshotted on
hibernation, and the session rebuilt from both, exactly.

A restore loads the last snapshot (or starts from an empty slab) and runs
the tokens that came after it through the slab again, in the chunks they
first ran in (`Session.replay`): the same shapes through the same model
compute the same keys and values, so the restored slab and logits equal the
lost ones bit for bit, for a session that decoded alone. (A decode step batched with other
sessions reduces in another order; replaying it alone can differ in the last
bits.) Snapshots bound that replay: one is written whenever more than
SNAPSHOT_AFTER_CHUNKS chunks have piled up since the last.
"""

from __future__ import annotations

import time

import mlx.core as mx

from kvmux import logs
from kvmux.protocol import ChatMessage, ErrorCode, ProtocolError
from kvmux.store import SessionRecord, Store, StoreError

from . import snapshot
from .conversation import Conversation
from .engine import Engine, Session

log = logs.get("worker.durable")

# A crash replays at most this many forward passes (a decode step is one).
SNAPSHOT_AFTER_CHUNKS = 64


def record_of(session: Session, model_id: str) -> SessionRecord:
    conv = session.conversation
    return SessionRecord(
        session_id=session.id,
        model=model_id,
        owner=session.owner,
        created=session.created,
        updated=time.time(),
        sink=session.sink,
        window=session.window,
        tokens=len(session.history) + len(session.pending),
        sampling=session.defaults,
        messages=[ChatMessage(role=m["role"], content=m["content"]) for m in conv.messages],
        rendered=conv.rendered,
        chat_template_kwargs=conv.kwargs,
        history=session.history,
        pending=session.pending,
        raw=session.raw,
        snapshot=session.snapshot,
        snapshot_tokens=session.snapshot_tokens,
        replay=session.replay,
        restores=session.restores,
        last_restore_s=session.last_restore_s,
    )


def save(store: Store, session: Session, model_id: str, *, snapshot_now: bool = False) -> int:
    """Write the session's record (and first a slab snapshot when asked or
    when the replay has grown long); returns the bytes written."""
    store.dir(session.id).mkdir(exist_ok=True, mode=0o700)
    written = 0
    snapshotting = snapshot_now or len(session.replay) > SNAPSHOT_AFTER_CHUNKS
    if snapshotting:
        name = f"slab-{time.time_ns()}.safetensors"
        written += snapshot.save(store.slab_path(session.id, name), session.slab, session.logits)
        session.snapshot, session.snapshot_tokens, session.replay = name, len(session.history), []
    written += store.save(record_of(session, model_id))
    if snapshotting:  # only now, with the record naming the new one, may the old go
        store.remove_stale_slabs(session.id, session.snapshot)
    return written


def restore(store: Store, engine: Engine, session_id: str) -> tuple[Session, int]:
    """The session rebuilt from the store, and how many tokens were run
    again; raises ProtocolError (session_not_found, session_corrupt)."""
    try:
        if not store.exists(session_id):
            raise ProtocolError(ErrorCode.SESSION_NOT_FOUND, f"no session {session_id}")
        record = store.load(session_id)
    except StoreError as exc:
        raise ProtocolError(ErrorCode.SESSION_CORRUPT, f"session {session_id} is corrupt: {exc}") from None
    if record.model != engine.loaded.model_id:
        raise ProtocolError(
            ErrorCode.SESSION_CORRUPT,
            f"session {session_id} was made with {record.model}, this worker runs {engine.loaded.model_id}",
        )
    tail = record.history[record.snapshot_tokens :]
    if sum(record.replay) != len(tail) or not (0 <= record.snapshot_tokens <= len(record.history)):
        raise ProtocolError(ErrorCode.SESSION_CORRUPT, f"session {session_id} is corrupt: its replay does not add up")
    session = engine.new_session(session_id, record.sink, record.window, None, record.sampling)
    session.conversation = Conversation(
        engine.tokenizer,
        [{"role": m.role, "content": m.content} for m in record.messages],
        record.rendered,
        record.chat_template_kwargs,
    )
    if record.snapshot is not None:
        try:
            session.slab, session.logits = snapshot.load(
                store.slab_path(session_id, record.snapshot), engine.make_slab(record.sink, record.window)
            )
        except (ValueError, OSError) as exc:
            raise ProtocolError(ErrorCode.SESSION_CORRUPT, f"session {session_id} is corrupt: {exc}") from None
    at = 0
    for size in record.replay:
        session.logits = engine.run_chunk(session, tail[at : at + size])
        at += size
    # mx.load maps the file lazily: read it all now, so the restore's time
    # (reported to the broker) is what it costs, not the next step's.
    mx.eval(session.logits, [layer.state for layer in session.slab])
    session.history = list(record.history)
    session.pending = list(record.pending)
    session.raw = record.raw
    session.owner, session.created = record.owner, record.created
    session.snapshot, session.snapshot_tokens = record.snapshot, record.snapshot_tokens
    session.replay = list(record.replay)
    session.restores, session.last_restore_s = record.restores, record.last_restore_s
    return session, len(tail)
