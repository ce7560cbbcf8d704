"""The session store: where records and slab snapshots live, and the only
code that writes or deletes them. Broker and worker hold a `SessionStore`
and call it; neither touches a record's files.

Records are written by workers (after every request they complete) and read
by both; a record is deleted by whoever closes its session (the broker for
a hibernated one, the worker for a live one). `store_id` tells a broker
which workers share a store: a hibernated session is restored only on a
worker that reads the store it was written to.

Fencing: every placement of a session on a worker (an open, a restore)
`claim`s a new epoch, and the worker's record writes carry it; a write with
an older epoch is refused (`Fenced`), atomically with the check, so a
worker declared lost that comes back cannot overwrite what the session's
new worker wrote. One broker serves a store at a time: it holds the store's
`lease`.

Bytes: every backend counts what its records and snapshots take as it
writes and deletes them (`bytes_total`), so that the broker keeps the store
within `max_store_bytes` without summing every session's files; a write
that finds no room raises `StoreFull`, having stored nothing of itself.

Backends: `LocalStore` (local.py), a directory under the state dir, one
host; `RedisStore` (redis_store.py), any number of hosts. `open_store`
(backends.py, which knows them all) picks one from the `store` setting.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvmux.protocol import DECODE_ERRORS

from .record import RecordHead, SessionRecord, StoreError, decode_head, decode_record

if TYPE_CHECKING:
    import mlx.core as mx

    from .prefixes import PrefixStore


class SessionStore(abc.ABC):
    store_id: str  # equal for every process that sees the same records

    @abc.abstractmethod
    def exists(self, session_id: str) -> bool: ...

    @abc.abstractmethod
    def claim(self, session_id: str) -> int:
        """A new placement of the session: its epoch, from now on the only
        one whose writes are taken."""

    @abc.abstractmethod
    def save(self, record: SessionRecord, epoch: int) -> int:
        """Write the record atomically, if `epoch` is still the session's
        (else raise Fenced); returns the bytes written."""

    def load(self, session_id: str) -> SessionRecord:
        """The whole record; raises StoreError when missing or unreadable."""
        return self._decoded(session_id, decode_record)

    def head(self, session_id: str) -> RecordHead:
        """What the broker needs of the record; raises StoreError."""
        return self._decoded(session_id, decode_head)

    def _decoded(self, session_id: str, decode):
        data = self.record_bytes(session_id)
        if data is None:
            raise StoreError(f"no record for session {session_id}")
        try:
            record = decode(data)
        except DECODE_ERRORS as exc:
            raise StoreError(f"session {session_id}: unreadable record ({exc})") from None
        if record.session_id != session_id:
            raise StoreError(f"session {session_id}: the record names {record.session_id}")
        return record

    @abc.abstractmethod
    def record_bytes(self, session_id: str) -> bytes | None:
        """The record as stored, None when there is none; raises StoreError
        when it cannot be read."""

    @abc.abstractmethod
    def save_snapshot(
        self, session_id: str, slab: list, logits: mx.array | None, name: str | None = None
    ) -> tuple[str, int]:
        """Write a slab snapshot beside the record, under a new name or
        `name` (a worker group rank's part: snapshot.part_name); returns its
        name (for the record to point at) and size. Older ones stay until
        `prune_snapshots`, which keeps the parts of the one it keeps."""

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

    def prefixes(self, budget: int) -> PrefixStore | None:
        """The shared prefixes kept beside these sessions, under `budget`
        bytes (prefixes.py); None where this store keeps none."""
        return None

    @abc.abstractmethod
    def bytes_total(self) -> int:
        """What every session's record and snapshots take, as counted on
        each write and delete (counted afresh when no count is kept yet)."""

    @abc.abstractmethod
    def lease(self, holder: str, ttl_s: float) -> str:
        """Take or renew the broker's lease on the store for `ttl_s`; returns
        who holds it (`holder` when it is ours)."""

    @abc.abstractmethod
    def release(self, holder: str) -> None:
        """Give the lease back, if `holder` has it: the next broker need not
        wait for it to lapse."""
