"""Durable sessions: the record (record.py), a live session to its record
and back (durable.py), slab snapshots (snapshot.py), and the store that
holds them (store.py: the interface; local.py: a directory, the first
backend, written atomically by files.py; redis_store.py: Redis;
backends.py: the one a setting names). Shared by broker and worker; MLX
is imported only where a worker writes or reads a snapshot."""

from .backends import open_store
from .local import LocalStore, store_id
from .record import (
    Fenced,
    RecordHead,
    SessionRecord,
    SessionState,
    StoreError,
    StoreFull,
    StoreUnavailable,
    Turn,
    is_session_id,
    state_fields,
)
from .store import SessionStore

__all__ = [
    "Fenced",
    "LocalStore",
    "RecordHead",
    "SessionRecord",
    "SessionState",
    "SessionStore",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "Turn",
    "is_session_id",
    "open_store",
    "state_fields",
    "store_id",
]
