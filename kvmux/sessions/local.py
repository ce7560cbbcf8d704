"""The session store in a directory: every session's record and snapshots
under the daemon's state dir.

    <state_dir>/sessions/<session_id>/record.msgpack      settings, conversation, tokens
    <state_dir>/sessions/<session_id>/slab-<n>.safetensors the slab when last snapshotted

The record is rewritten after every request a worker completes (a few KB to
a few hundred KB: it holds the token history). Every write is atomic (temp
file, fsync, rename, fsync of the dir): a crash at any instant leaves the
previous state readable. Files are 0600 in 0700 dirs. Two processes share
this store when they run on one host with one state dir (`store_id`).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from kvmux.protocol import DECODE_ERRORS

from .files import atomic_write
from .record import RecordHead, SessionRecord, StoreError, decode_head, decode_record, encode, is_session_id
from .store import SessionStore

RECORD = "record.msgpack"
_SNAPSHOTS = "slab-*.safetensors"


def store_id(state_dir: Path | str) -> str:
    """How workers and the broker tell that they share a store."""
    return f"{socket.gethostname()}:{Path(state_dir).expanduser().resolve()}"


class LocalStore(SessionStore):
    def __init__(self, state_dir: Path | str):
        self.root = Path(state_dir) / "sessions"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        self.store_id = store_id(state_dir)

    def dir(self, session_id: str) -> Path:
        if not is_session_id(session_id):
            raise StoreError(f"not a session id: {session_id!r}")
        return self.root / session_id

    def exists(self, session_id: str) -> bool:
        return (self.dir(session_id) / RECORD).exists()

    def save(self, record: SessionRecord) -> int:
        folder = self.dir(record.session_id)
        folder.mkdir(exist_ok=True, mode=0o700)
        data = encode(record)
        atomic_write(folder / RECORD, data)  # mkstemp makes it 0600
        return len(data)

    def load(self, session_id: str) -> SessionRecord:
        return self._read(session_id, decode_record)

    def head(self, session_id: str) -> RecordHead:
        return self._read(session_id, decode_head)

    def _read(self, session_id: str, decode):
        path = self.dir(session_id) / RECORD
        try:
            record = decode(path.read_bytes())
        except FileNotFoundError:
            raise StoreError(f"no record for session {session_id}") from None
        except (OSError, *DECODE_ERRORS) as exc:
            raise StoreError(f"session {session_id}: unreadable record ({exc})") from None
        if record.session_id != session_id:
            raise StoreError(f"session {session_id}: the record names {record.session_id}")
        return record

    def save_snapshot(self, session_id: str, slab: list, logits) -> tuple[str, int]:
        from . import snapshot  # MLX: only a worker writes snapshots

        folder = self.dir(session_id)
        folder.mkdir(exist_ok=True, mode=0o700)
        name = f"slab-{time.time_ns()}.safetensors"
        return name, snapshot.save(folder / name, slab, logits)

    def load_snapshot(self, session_id: str, name: str, slab: list):
        from . import snapshot

        return snapshot.load(self.dir(session_id) / name, slab)

    def prune_snapshots(self, session_id: str, keep: str | None) -> None:
        for path in self.dir(session_id).glob(_SNAPSHOTS):
            if path.name != keep:
                path.unlink(missing_ok=True)

    def delete(self, session_id: str) -> None:
        shutil.rmtree(self.dir(session_id), ignore_errors=True)

    def session_ids(self) -> Iterator[str]:
        for path in self.root.iterdir():
            if is_session_id(path.name) and (path / RECORD).exists():
                yield path.name

    def bytes_stored(self, session_id: str) -> int:
        try:
            return sum(p.stat().st_size for p in self.dir(session_id).iterdir())
        except OSError:
            return 0
