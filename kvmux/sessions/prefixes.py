"""Shared prefix snapshots in the session store: the KV of an opening that
many sessions share (a system prompt, tools, few-shot examples), computed
once and restored by every session that starts with it, on any worker
that reads the same store (worker/prefixes.py decides when).

A prefix is named by its keys (worker/prefixes.py: a hash chain over the
token ids, a key per block boundary, seeded by the model's digest and the
slab's geometry), never by its text. It is stored as one blob under its
last key: a head (that key, its tokens, the payload's sha256) and the
payload, a slab snapshot (snapshot.py) of exactly the prefix's tokens; an
index names the blob for each of its keys, so an opening that shares only
its first blocks finds it too (and takes those blocks of it). A blob whose
checksum, key or shape does not hold is deleted and reads as missing: a
session then prefills cold, never from a wrong prefix.

Prefixes live under their own byte budget (`prefix_store_bytes`), apart
from sessions: past it, the least recently used are deleted, never a pinned
one. A session's record never points at a prefix: a restore reads the
session's own snapshot and chunks, so evicting a prefix loses nothing.
A read is one whole read (a file read into memory, one HGETALL), so an
eviction running beside it cannot cut it short.

    <state_dir>/prefixes/<key>.prefix      the blob
    <state_dir>/prefixes/<key>.pin         present while the prefix is pinned
    <state_dir>/prefixes/index/<key>       the blob holding a block boundary's key
    kvmux:p:<key>                          Redis hash: n, 0..n-1 (the blob in chunks)
    kvmux:prefixes                         sorted set: key -> last use (wall clock)
    kvmux:prefixes:bytes                   hash: key -> blob size
    kvmux:prefixes:pinned                  set: pinned keys
    kvmux:prefixes:index                   hash: a block boundary's key -> its blob's key
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import time
from pathlib import Path

import msgspec

from kvmux import logs

from .files import atomic_write

log = logs.get("sessions.prefixes")

_SUFFIX = ".prefix"
_PIN = ".pin"


class PrefixHead(msgspec.Struct, array_like=True):
    key: str
    tokens: int  # the prefix's tokens: the snapshot holds exactly these
    sha256: str  # of the payload


class PrefixInfo(msgspec.Struct, kw_only=True):
    """A stored prefix, as `kvmux prefix list` shows it."""

    key: str
    tokens: int
    bytes: int
    pinned: bool
    used: float  # wall-clock seconds of its last write or hit


def _is_key(key: str) -> bool:
    return len(key) == 32 and all(c in "0123456789abcdef" for c in key)


def pack(key: str, tokens: int, payload: bytes) -> bytes:
    head = msgspec.msgpack.encode(PrefixHead(key, tokens, hashlib.sha256(payload).hexdigest()))
    return len(head).to_bytes(4, "little") + head + payload


def unpack(key: str, blob: bytes) -> tuple[int, bytes]:
    """(tokens, payload) of a blob stored under `key`; raises ValueError
    where its head, key or checksum does not hold."""
    try:
        size = int.from_bytes(blob[:4], "little")
        head = msgspec.msgpack.decode(blob[4 : 4 + size], type=PrefixHead)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"prefix {key}: unreadable head ({exc})") from None
    payload = blob[4 + size :]
    if head.key != key:
        raise ValueError(f"prefix {key}: the blob names {head.key}")
    if hashlib.sha256(payload).hexdigest() != head.sha256:
        raise ValueError(f"prefix {key}: checksum mismatch (a corrupt or cut blob)")
    return head.tokens, payload


class PrefixStore(abc.ABC):
    """Prefix blobs beside a session store, under `budget` bytes."""

    def __init__(self, budget: int):
        self.budget = budget

    def put(self, chain: list[str], tokens: int, payload: bytes, pinned: bool = False) -> list[str]:
        """Store a prefix under the last of its keys `chain` (one per block
        boundary, each indexed), then evict the least recently used unpinned
        others past the budget; returns the keys evicted. Raises ValueError
        where the prefix alone exceeds what the budget leaves beside the
        pinned ones."""
        key = chain[-1]
        blob = pack(key, tokens, payload)
        entries = {e.key: e for e in self.entries()}
        pinned_bytes = sum(e.bytes for e in entries.values() if e.pinned and e.key != key)
        if pinned_bytes + len(blob) > self.budget:
            raise ValueError(
                f"a prefix of {len(blob)} bytes does not fit the prefix budget ({self.budget} bytes,"
                f" {pinned_bytes} of them pinned)"
            )
        self._write(key, blob, pinned or (key in entries and entries[key].pinned))
        self._index(chain)
        total = sum(e.bytes for k, e in entries.items() if k != key) + len(blob)
        evicted = []
        for entry in sorted(entries.values(), key=lambda e: e.used):
            if total <= self.budget:
                break
            if entry.pinned or entry.key == key:
                continue
            self.drop(entry.key)
            total -= entry.bytes
            evicted.append(entry.key)
        if evicted:
            log.info("prefixes_evicted", keys=evicted, budget=self.budget)
        return evicted

    def get(self, key: str) -> tuple[int, bytes] | None:
        """(tokens, payload) of a stored prefix, its use noted; None when it
        is missing, or fails its checks (then it is deleted)."""
        blob = self._read(key)
        if blob is None:
            return None
        try:
            found = unpack(key, blob)
        except ValueError as exc:
            log.warning("prefix_dropped", key=key, why=str(exc))
            self.drop(key)
            return None
        self._touch(key)
        return found

    def find(self, chain: list[str]) -> tuple[int, str] | None:
        """The longest stored prefix of an opening whose keys are `chain`
        (shortest first): (its blocks, the key of the blob that holds them)."""
        blobs = self._indexed(chain)
        for k in range(len(chain), 0, -1):
            if blobs[k - 1] is not None:
                return k, blobs[k - 1]
        return None

    @abc.abstractmethod
    def _write(self, key: str, blob: bytes, pinned: bool) -> None: ...

    @abc.abstractmethod
    def _read(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def _touch(self, key: str) -> None: ...

    @abc.abstractmethod
    def _index(self, chain: list[str]) -> None:
        """Name the blob `chain[-1]` for each key of `chain`."""

    @abc.abstractmethod
    def _indexed(self, chain: list[str]) -> list[str | None]:
        """The blob each key names, None where there is none (or its blob
        is gone: the entry is dropped then)."""

    @abc.abstractmethod
    def pin(self, key: str, pinned: bool) -> bool:
        """Pin or unpin a stored prefix; False when there is none."""

    @abc.abstractmethod
    def drop(self, key: str) -> bool:
        """Delete a prefix (pinned or not); False when there was none."""

    @abc.abstractmethod
    def entries(self) -> list[PrefixInfo]:
        """Every stored prefix."""


class LocalPrefixes(PrefixStore):
    def __init__(self, state_dir: Path | str, budget: int):
        super().__init__(budget)
        self.root = Path(state_dir) / "prefixes"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, key: str, suffix: str = _SUFFIX) -> Path:
        if not _is_key(key):
            raise ValueError(f"not a prefix key: {key!r}")
        return self.root / f"{key}{suffix}"

    def _write(self, key: str, blob: bytes, pinned: bool) -> None:
        atomic_write(self._path(key), blob)
        if pinned:
            atomic_write(self._path(key, _PIN), b"")

    def _read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def _touch(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._path(key))

    def _index(self, chain: list[str]) -> None:
        index = self.root / "index"
        index.mkdir(exist_ok=True, mode=0o700)
        for key in chain:
            self._path(key)  # checked
            atomic_write(index / key, chain[-1].encode())

    def _indexed(self, chain: list[str]) -> list[str | None]:
        out = []
        for key in chain:
            entry = self.root / "index" / key
            try:
                blob = entry.read_text()
            except (FileNotFoundError, NotADirectoryError):
                blob = None
            if blob is not None and not (_is_key(blob) and self._path(blob).exists()):
                entry.unlink(missing_ok=True)
                blob = None
            out.append(blob)
        return out

    def pin(self, key: str, pinned: bool) -> bool:
        if not self._path(key).exists():
            return False
        if pinned:
            atomic_write(self._path(key, _PIN), b"")
        else:
            self._path(key, _PIN).unlink(missing_ok=True)
        return True

    def drop(self, key: str) -> bool:
        self._path(key, _PIN).unlink(missing_ok=True)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def entries(self) -> list[PrefixInfo]:
        out = []
        for path in self.root.glob(f"*{_SUFFIX}"):
            key = path.name.removesuffix(_SUFFIX)
            try:
                stat = path.stat()
                with path.open("rb") as f:
                    size = int.from_bytes(f.read(4), "little")
                    head = msgspec.msgpack.decode(f.read(size), type=PrefixHead)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                continue  # gone meanwhile, or unreadable: a read drops it
            pinned = self._path(key, _PIN).exists()
            out.append(PrefixInfo(key=key, tokens=head.tokens, bytes=stat.st_size, pinned=pinned, used=stat.st_mtime))
        return out


class RedisPrefixes(PrefixStore):
    CHUNK = 4 << 20
    _INDEX = "kvmux:prefixes"
    _BYTES = "kvmux:prefixes:bytes"
    _PINNED = "kvmux:prefixes:pinned"
    _INDEX_KEYS = "kvmux:prefixes:index"

    def __init__(self, store, budget: int):
        super().__init__(budget)
        self.store = store  # the RedisStore beside it: its connection and its errors
        self.redis = store.redis

    @staticmethod
    def _key(key: str) -> str:
        if not _is_key(key):
            raise ValueError(f"not a prefix key: {key!r}")
        return f"kvmux:p:{key}"

    def _write(self, key: str, blob: bytes, pinned: bool) -> None:
        pieces = {str(i): blob[at : at + self.CHUNK] for i, at in enumerate(range(0, len(blob), self.CHUNK))}
        with self.store.reachable():
            pipe = self.redis.pipeline()
            pipe.delete(self._key(key))
            pipe.hset(self._key(key), mapping={**pieces, "n": len(pieces)})
            pipe.hset(self._BYTES, key, len(blob))
            pipe.zadd(self._INDEX, {key: time.time()})
            if pinned:
                pipe.sadd(self._PINNED, key)
            pipe.execute()

    def _read(self, key: str) -> bytes | None:
        with self.store.reachable():
            fields = self.redis.hgetall(self._key(key))
        if not fields:
            return None
        try:
            return b"".join(fields[str(i).encode()] for i in range(int(fields[b"n"])))
        except (KeyError, ValueError):
            return b""  # incomplete: fails its checks, and is dropped

    def _touch(self, key: str) -> None:
        with self.store.reachable():
            self.redis.zadd(self._INDEX, {key: time.time()}, xx=True)

    def _index(self, chain: list[str]) -> None:
        with self.store.reachable():
            self.redis.hset(self._INDEX_KEYS, mapping=dict.fromkeys(chain, chain[-1]))

    def _indexed(self, chain: list[str]) -> list[str | None]:
        with self.store.reachable():
            blobs = [b.decode() if b else None for b in self.redis.hmget(self._INDEX_KEYS, chain)]
            named = sorted({b for b in blobs if b is not None})
            pipe = self.redis.pipeline(transaction=False)
            for b in named:
                pipe.exists(self._key(b))
            alive = {b for b, n in zip(named, pipe.execute(), strict=True) if n}
            stale = [key for key, b in zip(chain, blobs, strict=True) if b is not None and b not in alive]
            if stale:
                self.redis.hdel(self._INDEX_KEYS, *stale)
        return [b if b in alive else None for b in blobs]

    def pin(self, key: str, pinned: bool) -> bool:
        with self.store.reachable():
            if not self.redis.exists(self._key(key)):
                return False
            (self.redis.sadd if pinned else self.redis.srem)(self._PINNED, key)
        return True

    def drop(self, key: str) -> bool:
        with self.store.reachable():
            pipe = self.redis.pipeline()
            pipe.delete(self._key(key))
            pipe.zrem(self._INDEX, key)
            pipe.hdel(self._BYTES, key)
            pipe.srem(self._PINNED, key)
            return bool(pipe.execute()[0])

    def entries(self) -> list[PrefixInfo]:
        with self.store.reachable():
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrange(self._INDEX, 0, -1, withscores=True)
            pipe.hgetall(self._BYTES)
            pipe.smembers(self._PINNED)
            used, sizes, pinned = pipe.execute()
            keys = [k.decode() for k, _ in used]
            heads = self.redis.pipeline(transaction=False)
            for k in keys:
                heads.hget(self._key(k), "0")
            firsts = heads.execute()
        out = []
        for (raw, score), first in zip(used, firsts, strict=True):
            if first is None:
                continue
            try:
                head = msgspec.msgpack.decode(first[4 : 4 + int.from_bytes(first[:4], "little")], type=PrefixHead)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            out.append(
                PrefixInfo(
                    key=raw.decode(),
                    tokens=head.tokens,
                    bytes=int(sizes.get(raw, 0)),
                    pinned=raw in pinned,
                    used=score,
                )
            )
        return out
