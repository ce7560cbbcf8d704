"""What the broker reads from the session store (kvmux/store.py) itself:
every session at start-up, and the answers it gives for a hibernated session
without waking it (INFO, the SESSIONS listing). No MLX."""

from __future__ import annotations

import time

from kvmux.protocol import SessionInfo, SessionOpened
from kvmux.store import RecordHead, SessionRecord, Store, StoreError


def scan(store: Store) -> tuple[list[RecordHead], dict[str, str]]:
    """Every stored session's head, and the ids whose record is unreadable
    (with why): those answer `session_corrupt`, the rest are served."""
    heads, corrupt = [], {}
    for session_id in store.session_ids():
        try:
            heads.append(store.head(session_id))
        except StoreError as exc:
            corrupt[session_id] = str(exc)
    return heads, corrupt


def opened_from(head: RecordHead | SessionRecord) -> SessionOpened:
    """RESUME's answer for a session known only from the store."""
    return SessionOpened(
        session_id=head.session_id, worker_id="", model=head.model, sink=head.sink, window=head.window, slab_bytes=0
    )


def idle_since(updated_wall: float, now: float) -> float:
    """A record's wall-clock time on the broker's monotonic clock."""
    return now - max(0.0, time.time() - updated_wall)


def info(record: SessionRecord, slab_bytes: int, idle_s: float, token_ids: bool) -> SessionInfo:
    """SESSION INFO for a hibernated session, from its record."""
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
        token_ids=history if token_ids else None,
        state="hibernated",
        restores=record.restores,
        last_restore_s=record.last_restore_s,
    )
