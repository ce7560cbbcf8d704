"""Durable sessions: the record (record.py), a live session to its record
and back (durable.py), slab snapshots (snapshot.py), and the store that
holds them (store.py: the interface; local.py: a directory, the first
backend, written atomically by files.py). Shared by broker and worker; MLX
is imported only where a worker writes or reads a snapshot."""

from .local import LocalStore, store_id
from .record import RecordHead, SessionRecord, SessionState, StoreError, is_session_id, state_fields
from .store import SessionStore

__all__ = [
    "LocalStore",
    "RecordHead",
    "SessionRecord",
    "SessionState",
    "SessionStore",
    "StoreError",
    "is_session_id",
    "state_fields",
    "store_id",
]
