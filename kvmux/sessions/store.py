"""The session store: where records and slab snapshots live, and the only
code that writes or deletes them. Broker and worker hold a `SessionStore`
and call it; neither touches a record's files.

Records are written by workers (after every request they complete) and read
by both; a record is deleted by whoever closes its session (the broker for
a hibernated one, the worker for a live one). `store_id` tells a broker
which workers share its store: a hibernated session is restored only on one
of those. `LocalStore` (kvmux/sessions/local.py), a directory under the
daemon's state dir, is the first backend.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .record import RecordHead, SessionRecord

if TYPE_CHECKING:
    import mlx.core as mx


class SessionStore(abc.ABC):
    store_id: str  # equal for every process that sees the same records

    @abc.abstractmethod
    def exists(self, session_id: str) -> bool: ...

    @abc.abstractmethod
    def save(self, record: SessionRecord) -> int:
        """Write the record atomically; returns the bytes written."""

    @abc.abstractmethod
    def load(self, session_id: str) -> SessionRecord:
        """The whole record; raises StoreError when missing or unreadable."""

    @abc.abstractmethod
    def head(self, session_id: str) -> RecordHead:
        """What the broker needs of the record; raises StoreError."""

    @abc.abstractmethod
    def save_snapshot(self, session_id: str, slab: list, logits: mx.array | None) -> tuple[str, int]:
        """Write a slab snapshot beside the record; returns its name (for the
        record to point at) and size. Older ones stay until `prune_snapshots`."""

    @abc.abstractmethod
    def load_snapshot(self, session_id: str, name: str, slab: list) -> tuple[list, mx.array | None]:
        """`slab` (empty, shaped by the session's settings) filled from the
        snapshot `name`, and its logits; raises ValueError for a snapshot of
        another shape or an unreadable one."""

    @abc.abstractmethod
    def prune_snapshots(self, session_id: str, keep: str | None) -> None:
        """Delete snapshots other than `keep`: called once the record names
        `keep`, so a crash in between leaves the old pair readable."""

    @abc.abstractmethod
    def delete(self, session_id: str) -> None:
        """Forget the session: its record and snapshots."""

    @abc.abstractmethod
    def session_ids(self) -> Iterator[str]:
        """Every stored session (records unreadable or not)."""

    @abc.abstractmethod
    def bytes_stored(self, session_id: str) -> int:
        """What the session takes in the store (record and snapshots)."""
