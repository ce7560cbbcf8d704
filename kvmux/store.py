"""The session store: every session's durable record under the daemon's state
dir, so a session outlives the worker, the broker and the daemon.

    <state_dir>/sessions/<session_id>/record.msgpack      settings, conversation, tokens
    <state_dir>/sessions/<session_id>/slab-<n>.safetensors the slab when last snapshotted

The record is rewritten after every request a worker completes (a few KB to
a few hundred KB: it holds the token history). The slab snapshot is written
when the session is hibernated; tokens fed since the snapshot are listed in
the record as chunks (`replay`) and fed again, with the same boundaries, when
the session is restored after a crash. Every write is atomic (temp file,
fsync, rename, fsync of the dir): a crash at any instant leaves the previous
state readable. The broker reads records (msgspec only, no MLX); workers
write them. Files are 0600 in 0700 dirs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from kvmux.protocol import DECODE_ERRORS, ChatMessage, Sampling

RECORD_VERSION = 1
RECORD = "record.msgpack"
_SESSION_ID = re.compile(r"^[0-9a-f]{32}$")  # the broker's uuid4().hex


def is_session_id(value: object) -> bool:
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None


class StoreError(Exception):
    """A record that is missing, truncated or not a kvmux record."""


class SessionRecord(msgspec.Struct, kw_only=True):
    version: int = RECORD_VERSION
    session_id: str
    model: str
    owner: str  # the identity the per-client quota (and, with CURVE, ownership) counts
    created: float  # wall-clock seconds
    updated: float
    sink: int
    window: int
    tokens: int = 0  # len(history) + len(pending), readable without decoding them
    system: str | None = None
    sampling: Sampling | None = None
    messages: list[ChatMessage] = []
    rendered: str = ""  # the conversation's text fed so far (template pieces, replies as generated)
    chat_template_kwargs: dict[str, Any] = {}
    history: list[int] = []  # every token fed into the slab, those the window dropped too
    pending: list[int] = []  # appended, not fed yet
    raw: bool = False  # the last append was raw token ids
    snapshot: str | None = None  # slab file name, holding the first `snapshot_tokens` of history
    snapshot_tokens: int = 0
    replay: list[int] = []  # sizes of the chunks fed since the snapshot, in order
    restores: int = 0
    last_restore_s: float = 0.0


class RecordHead(msgspec.Struct, kw_only=True):
    """What the broker needs of a record (msgspec skips the rest unread)."""

    session_id: str
    model: str
    owner: str
    created: float
    updated: float
    sink: int
    window: int
    tokens: int = 0


_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(SessionRecord)
_head_decoder = msgspec.msgpack.Decoder(RecordHead)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """A temp path beside `path` (same suffix) for the caller to write; then
    fsynced and renamed over `path`, so a crash leaves the old or the new
    file, never a torn one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def atomic_write(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def sync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def store_id(state_dir: Path | str) -> str:
    """How workers and the broker tell that they share a store."""
    return f"{socket.gethostname()}:{Path(state_dir).expanduser().resolve()}"


class Store:
    def __init__(self, state_dir: Path | str):
        self.root = Path(state_dir) / "sessions"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)

    def dir(self, session_id: str) -> Path:
        if not is_session_id(session_id):
            raise StoreError(f"not a session id: {session_id!r}")
        return self.root / session_id

    def exists(self, session_id: str) -> bool:
        return (self.dir(session_id) / RECORD).exists()

    def save(self, record: SessionRecord) -> int:
        """Write the record atomically; returns the bytes written."""
        folder = self.dir(record.session_id)
        folder.mkdir(exist_ok=True, mode=0o700)
        data = _encoder.encode(record)
        atomic_write(folder / RECORD, data)  # mkstemp makes it 0600
        return len(data)

    def load(self, session_id: str) -> SessionRecord:
        return self._read(session_id, _record_decoder)

    def head(self, session_id: str) -> RecordHead:
        return self._read(session_id, _head_decoder)

    def _read(self, session_id: str, decoder: msgspec.msgpack.Decoder):
        path = self.dir(session_id) / RECORD
        try:
            record = decoder.decode(path.read_bytes())
        except FileNotFoundError:
            raise StoreError(f"no record for session {session_id}") from None
        except (OSError, *DECODE_ERRORS) as exc:
            raise StoreError(f"session {session_id}: unreadable record ({exc})") from None
        if record.session_id != session_id:
            raise StoreError(f"session {session_id}: the record names {record.session_id}")
        return record

    def slab_path(self, session_id: str, name: str) -> Path:
        return self.dir(session_id) / name

    def remove_stale_slabs(self, session_id: str, keep: str | None) -> None:
        """Delete snapshot files other than `keep` (left by a newer snapshot
        or by a crash between writing one and the record naming it)."""
        for path in self.dir(session_id).glob("slab-*.safetensors"):
            if path.name != keep:
                path.unlink(missing_ok=True)

    def delete(self, session_id: str) -> None:
        shutil.rmtree(self.dir(session_id), ignore_errors=True)

    def session_ids(self) -> Iterator[str]:
        for path in self.root.iterdir():
            if _SESSION_ID.match(path.name) and (path / RECORD).exists():
                yield path.name

    def bytes_on_disk(self, session_id: str) -> int:
        try:
            return sum(p.stat().st_size for p in self.dir(session_id).iterdir())
        except OSError:
            return 0
