"""A session rebuilt from the store, on the worker: its record checked
(kvmux/sessions/durable.py), its last snapshot loaded (or an empty slab),
and the chunks that ran after the snapshot run again, as they first ran,
so the slab and logits are the lost ones."""

from __future__ import annotations

import mlx.core as mx

from kvmux.protocol import ErrorCode, ProtocolError
from kvmux.sessions import SessionStore, state_fields
from kvmux.sessions.durable import conversation_of, restorable

from .conversation import Conversation
from .engine import Engine, LiveSession
from .tool_calls import template_tools


def restore(store: SessionStore, engine: Engine, session_id: str) -> tuple[LiveSession, int]:
    """The session rebuilt and placed here (its epoch claimed: writes of
    an older placement are refused from now on), and how many tokens were
    run again; raises ProtocolError (session_not_found, session_corrupt)."""
    session, replayed = rebuild(store, engine, session_id)
    session.epoch = store.claim(session_id)
    return session, replayed


def rebuild(store: SessionStore, engine: Engine, session_id: str) -> tuple[LiveSession, int]:
    """The session as its record and snapshot hold it, not placed (a fork
    reads a session another worker may hold)."""
    layout = str(engine.loaded.layout)
    record = restorable(store, session_id, engine.loaded.model_id, layout)
    slab = engine.make_slab(record.sink, record.window)
    logits = None
    if record.snapshot is not None:
        try:
            slab, logits = store.load_snapshot(session_id, record.snapshot, slab)
        except (ValueError, OSError) as exc:
            raise ProtocolError(ErrorCode.SESSION_CORRUPT, f"session {session_id} is corrupt: {exc}") from None
    session = LiveSession(
        **state_fields(record),
        slab=slab,
        logits=logits,
        conversation=Conversation(
            engine.tokenizer,
            *conversation_of(record),
            tools=template_tools(record.tools) if engine.tool_format.native else [],
        ),
        draft=engine.drafter.new_cache(record.sink, record.window) if engine.drafter else None,
    )
    session.layout = layout  # the snapshots it writes from now on
    tail = record.history[record.snapshot_tokens :]
    at = 0
    for size in record.replay:
        session.logits = engine.run_chunk(session, tail[at : at + size])
        at += size
    # mx.load maps the file lazily: read it all now, so the restore's time
    # (reported to the broker) is what it costs, not the next step's.
    mx.eval(session.logits, [layer.state for layer in session.slab])
    return session, len(tail)
