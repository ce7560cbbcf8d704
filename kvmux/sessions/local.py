"""The session store in a directory: every session's record and snapshots
under the daemon's state dir.

    <state_dir>/sessions/<session_id>/record.msgpack      settings, conversation, tokens
    <state_dir>/sessions/<session_id>/slab-<n>.safetensors the slab when last snapshotted
    <state_dir>/sessions/<session_id>/epoch                its placement count (fencing)
    <state_dir>/sessions/broker.lock                       the broker's lease
    <state_dir>/sessions/bytes                             what records and snapshots take (bytes_total)

The record is rewritten after every request a worker completes (a few KB to
a few hundred KB: it holds the token history). Every write is atomic (temp
file, fsync, rename, fsync of the dir): a crash at any instant leaves the
previous state readable. Files are 0600 in 0700 dirs. Two processes share
this store when they run on one host with one state dir (`store_id`).
A session's epoch sits beside its record, read and written under an
exclusive lock on the session's dir (flock), as is every fenced record
write; the broker's lease is a lock on `broker.lock`, released by the
kernel when the broker dies. Every process that writes or deletes a
record or a snapshot adds the change in size to `bytes`, under a lock on
it; when it is missing or unreadable the next reader counts it afresh. A
write that meets a full disk (ENOSPC, EDQUOT) raises StoreFull, its temp
file gone and the previous file in place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from .files import atomic_write
from .prefixes import LocalPrefixes
from .record import Fenced, SessionRecord, StoreError, StoreFull, encode, is_session_id
from .store import SessionStore

RECORD = "record.msgpack"
EPOCH = "epoch"
LEASE = "broker.lock"
BYTES = "bytes"
_SNAPSHOTS = "slab-*.safetensors"
_BYTES_WIDTH = 20  # the count is rewritten in place at this width: no write of it ever needs a new block
_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _room(what: str):
    """A full disk as StoreFull."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _FULL:
            raise StoreFull(f"no room for {what}: {exc.strerror}") from None
        raise


def store_id(state_dir: Path | str) -> str:
    """How workers and the broker tell that they share a store."""
    return f"{socket.gethostname()}:{Path(state_dir).expanduser().resolve()}"


class LocalStore(SessionStore):
    def __init__(self, state_dir: Path | str):
        self.root = Path(state_dir) / "sessions"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        self.store_id = store_id(state_dir)
        self._lease: int | None = None  # the lock file's fd, while this process holds the lease

    def dir(self, session_id: str) -> Path:
        if not is_session_id(session_id):
            raise StoreError(f"not a session id: {session_id!r}")
        return self.root / session_id

    def exists(self, session_id: str) -> bool:
        return (self.dir(session_id) / RECORD).exists()

    @contextlib.contextmanager
    def _locked(self, session_id: str):
        """The session's dir, made if new, with its lock held."""
        folder = self.dir(session_id)
        folder.mkdir(exist_ok=True, mode=0o700)
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield folder
        finally:
            os.close(fd)  # and with it the lock

    def _epoch(self, folder: Path) -> int:
        try:
            return int((folder / EPOCH).read_text())
        except (FileNotFoundError, ValueError):
            return 0  # a record from before fencing: any first claim takes it

    def claim(self, session_id: str) -> int:
        with self._locked(session_id) as folder, _room(f"session {session_id}'s epoch"):
            epoch = self._epoch(folder) + 1
            atomic_write(folder / EPOCH, str(epoch).encode())
            return epoch

    def save(self, record: SessionRecord, epoch: int) -> int:
        data = encode(record)
        with self._locked(record.session_id) as folder:
            current = self._epoch(folder)
            if epoch != current:
                raise Fenced(f"session {record.session_id} was placed again (epoch {current}, this write's {epoch})")
            before = _size(folder / RECORD)
            with _room(f"session {record.session_id}'s record"):
                atomic_write(folder / RECORD, data)  # mkstemp makes it 0600
        self._count(len(data) - before)
        return len(data)

    def record_bytes(self, session_id: str) -> bytes | None:
        try:
            return (self.dir(session_id) / RECORD).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"session {session_id}: unreadable record ({exc})") from None

    def save_snapshot(self, session_id: str, slab: list, logits, name: str | None = None) -> tuple[str, int]:
        from . import snapshot  # MLX: only a worker writes snapshots

        folder = self.dir(session_id)
        folder.mkdir(exist_ok=True, mode=0o700)
        name = name or snapshot.name()
        with _room(f"session {session_id}'s slab snapshot"):
            size = snapshot.save(folder / name, slab, logits)
        self._count(size)
        return name, size

    def load_snapshot(self, session_id: str, name: str, slab: list):
        from . import snapshot

        return snapshot.load(self.dir(session_id) / name, slab)

    def prune_snapshots(self, session_id: str, keep: str | None) -> None:
        from . import snapshot

        freed = 0
        for path in self.dir(session_id).glob(_SNAPSHOTS):
            if snapshot.whole(path.name) != keep:
                freed += _size(path)
                path.unlink(missing_ok=True)
        self._count(-freed)

    def delete(self, session_id: str) -> None:
        freed = self.bytes_stored(session_id)
        shutil.rmtree(self.dir(session_id), ignore_errors=True)
        self._count(-freed)

    def session_ids(self) -> Iterator[str]:
        for path in self.root.iterdir():
            if is_session_id(path.name) and (path / RECORD).exists():
                yield path.name

    def bytes_stored(self, session_id: str) -> int:
        folder = self.dir(session_id)
        try:
            snapshots = sum(_size(path) for path in folder.glob(_SNAPSHOTS))
        except FileNotFoundError:  # deleted meanwhile (a worker closing it while the broker lists sessions)
            return 0
        return _size(folder / RECORD) + snapshots

    def bytes_total(self) -> int:
        fd = os.open(self.root / BYTES, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                return int(os.pread(fd, _BYTES_WIDTH, 0))
            except ValueError:  # new, or torn: counted afresh
                total = sum(self.bytes_stored(session_id) for session_id in self.session_ids())
                os.pwrite(fd, str(total).encode().ljust(_BYTES_WIDTH), 0)
                return total
        finally:
            os.close(fd)  # and with it the lock

    def _count(self, change: int) -> None:
        """Add `change` to the bytes counted, if a count is kept."""
        if not change:
            return
        try:
            fd = os.open(self.root / BYTES, os.O_RDWR)
        except FileNotFoundError:
            return  # no count yet: bytes_total makes it from the files
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                total = max(0, int(os.pread(fd, _BYTES_WIDTH, 0)) + change)
            except ValueError:
                os.ftruncate(fd, 0)  # unreadable: bytes_total counts afresh
                return
            os.pwrite(fd, str(total).encode().ljust(_BYTES_WIDTH), 0)
        finally:
            os.close(fd)

    def prefixes(self, budget: int) -> LocalPrefixes:
        return LocalPrefixes(self.root.parent, budget)

    def lease(self, holder: str, ttl_s: float) -> str:
        if self._lease is None:
            fd = os.open(self.root / LEASE, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = os.read(fd, 256).decode(errors="replace") or "another broker"
                os.close(fd)
                return other
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
            self._lease = fd  # held until this process exits or releases it
        return holder

    def release(self, holder: str) -> None:
        if self._lease is not None:
            os.close(self._lease)
            self._lease = None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
