"""The session store on a Redis server: records and slab snapshots any
worker on any host can read, so a session hibernated or stranded on one
host is restored on another.

    kvmux:s:<id>              hash: record (msgpack), epoch (the fencing counter)
    kvmux:s:<id>:snaps        set: the session's snapshot names
    kvmux:s:<id>:snap:<name>  hash: n, bytes, 0..n-1 (chunks of the safetensors file)
    kvmux:sessions            set: every session with a record
    kvmux:broker              string: the broker lease's holder (expires)
    kvmux:bytes               string: what records and snapshots take (bytes_total)

A record write is one Lua script that compares the session's epoch and
sets the record: a stale placement's write cannot land between the check
and the set. A snapshot is written in CHUNK-sized pieces, all of them
before the record that names it, so a crash mid-write leaves the record
pointing at the previous, whole snapshot; `prune_snapshots` drops the
rest. Every write and delete adds its change in size to `kvmux:bytes`
(the record's in the same script). A server at its maxmemory answers a
write with OOM: StoreFull, the session's stored state as it was (a
snapshot's pieces already written are deleted). Durability is the
server's: run it with AOF (docs/operations.md, "Session store").
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Iterator

import redis

from .prefixes import RedisPrefixes
from .record import Fenced, SessionRecord, StoreFull, StoreUnavailable, encode
from .store import SessionStore

PREFIX = "kvmux:"
CHUNK = 4 << 20  # bytes per snapshot piece: one Redis reply stays small
_SESSIONS = PREFIX + "sessions"
_LEASE = PREFIX + "broker"
_BYTES = PREFIX + "bytes"

_SAVE = """
local current = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
if current ~= tonumber(ARGV[2]) then return current end
local before = redis.call('HSTRLEN', KEYS[1], 'record')
redis.call('HSET', KEYS[1], 'record', ARGV[1])
redis.call('SADD', KEYS[2], ARGV[3])
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('INCRBY', KEYS[3], string.len(ARGV[1]) - before) end
return -1
"""
_COUNT = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('INCRBY', KEYS[1], ARGV[1]) end
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
"""
_LEASE_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return holder end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""


def _key(session_id: str) -> str:
    return f"{PREFIX}s:{session_id}"


def public_url(url: str) -> str:
    """The URL without its password: the store's id, safe to log and to
    send in READY."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.hostname or ""
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@contextlib.contextmanager
def _reachable(url: str) -> Iterator[None]:
    """Redis' connection failures as the store's typed error."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise StoreUnavailable(f"session store {url}: {exc}") from None
    except redis.OutOfMemoryError as exc:  # at its maxmemory (a script's write says so as its own error)
        raise StoreFull(f"session store {url}: out of memory: {exc}") from None
    except redis.ResponseError as exc:  # e.g. NOAUTH, WRONGPASS
        if "maxmemory" in str(exc):
            raise StoreFull(f"session store {url}: out of memory: {exc}") from None
        raise StoreUnavailable(f"session store {url}: {exc}") from None


class RedisStore(SessionStore):
    def __init__(self, url: str):
        """`url`: redis://[user:password@]host:port/db, rediss://... (TLS;
        ssl_ca_certs, ssl_certfile, ssl_keyfile as query parameters) or
        unix:///path/redis.sock?db=N; checked by a PING now."""
        self.store_id = public_url(url)
        self.redis = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5, health_check_interval=30)
        with _reachable(self.store_id):
            self.redis.ping()
        self._save = self.redis.register_script(_SAVE)
        self._lease = self.redis.register_script(_LEASE_SCRIPT)
        self._release = self.redis.register_script(_RELEASE)
        self._add = self.redis.register_script(_COUNT)

    def reachable(self):
        """A context in which Redis' failures raise StoreUnavailable."""
        return _reachable(self.store_id)

    def exists(self, session_id: str) -> bool:
        with _reachable(self.store_id):
            return bool(self.redis.hexists(_key(session_id), "record"))

    def claim(self, session_id: str) -> int:
        with _reachable(self.store_id):
            return int(self.redis.hincrby(_key(session_id), "epoch", 1))

    def save(self, record: SessionRecord, epoch: int) -> int:
        data = encode(record)
        with _reachable(self.store_id):
            current = self._save(
                keys=[_key(record.session_id), _SESSIONS, _BYTES], args=[data, epoch, record.session_id]
            )
        if current != -1:
            raise Fenced(f"session {record.session_id} was placed again (epoch {current}, this write's {epoch})")
        return len(data)

    def record_bytes(self, session_id: str) -> bytes | None:
        with _reachable(self.store_id):
            return self.redis.hget(_key(session_id), "record")

    def save_snapshot(self, session_id: str, slab: list, logits, name: str | None = None) -> tuple[str, int]:
        from . import snapshot  # MLX: only a worker writes snapshots

        name, data = name or snapshot.name(), snapshot.to_bytes(slab, logits)
        pieces = {str(i): data[at : at + CHUNK] for i, at in enumerate(range(0, len(data), CHUNK))}
        snap = f"{_key(session_id)}:snap:{name}"
        try:
            with _reachable(self.store_id):
                pipe = self.redis.pipeline(transaction=False)
                for index, piece in pieces.items():
                    pipe.hset(snap, index, piece)
                pipe.hset(snap, mapping={"n": len(pieces), "bytes": len(data)})
                pipe.sadd(f"{_key(session_id)}:snaps", name)
                pipe.execute()
        except StoreFull:
            with _reachable(self.store_id):  # a delete frees memory: Redis takes it at its maxmemory
                self.redis.delete(snap)
            raise
        self._count(len(data))
        return name, len(data)

    def load_snapshot(self, session_id: str, name: str, slab: list):
        from . import snapshot

        with _reachable(self.store_id):
            fields = self.redis.hgetall(f"{_key(session_id)}:snap:{name}")
        try:
            data = b"".join(fields[str(i).encode()] for i in range(int(fields[b"n"])))
        except (KeyError, ValueError):
            raise ValueError(f"slab snapshot {name} is incomplete in the store") from None
        return snapshot.from_bytes(data, name, slab)

    def prune_snapshots(self, session_id: str, keep: str | None) -> None:
        from . import snapshot

        with _reachable(self.store_id):
            names = [n.decode() for n in self.redis.smembers(f"{_key(session_id)}:snaps")]
            stale = [n for n in names if snapshot.whole(n) != keep]
            if stale:
                freed = self._snapshot_bytes(session_id, stale)
                pipe = self.redis.pipeline()
                pipe.delete(*(f"{_key(session_id)}:snap:{n}" for n in stale))
                pipe.srem(f"{_key(session_id)}:snaps", *stale)
                pipe.execute()
                self._count(-freed)

    def delete(self, session_id: str) -> None:
        freed = self.bytes_stored(session_id)
        with _reachable(self.store_id):
            names = [n.decode() for n in self.redis.smembers(f"{_key(session_id)}:snaps")]
            pipe = self.redis.pipeline()
            pipe.delete(_key(session_id), f"{_key(session_id)}:snaps", *(f"{_key(session_id)}:snap:{n}" for n in names))
            pipe.srem(_SESSIONS, session_id)
            pipe.execute()
        self._count(-freed)

    def session_ids(self) -> Iterator[str]:
        with _reachable(self.store_id):
            members = self.redis.smembers(_SESSIONS)
        return iter(sorted(m.decode() for m in members))

    def bytes_stored(self, session_id: str) -> int:
        try:
            with _reachable(self.store_id):
                names = [n.decode() for n in self.redis.smembers(f"{_key(session_id)}:snaps")]
                pipe = self.redis.pipeline(transaction=False)
                pipe.hstrlen(_key(session_id), "record")
                for n in names:
                    pipe.hget(f"{_key(session_id)}:snap:{n}", "bytes")
                sizes = pipe.execute()
        except StoreUnavailable:
            return 0  # a listing's figure, not worth failing it for
        return sum(int(size or 0) for size in sizes)

    def _snapshot_bytes(self, session_id: str, names: list[str]) -> int:
        pipe = self.redis.pipeline(transaction=False)
        for n in names:
            pipe.hget(f"{_key(session_id)}:snap:{n}", "bytes")
        return sum(int(size or 0) for size in pipe.execute())

    def bytes_total(self) -> int:
        with _reachable(self.store_id):
            total = self.redis.get(_BYTES)
        if total is not None:
            return int(total)
        total = sum(self.bytes_stored(session_id) for session_id in self.session_ids())
        with _reachable(self.store_id):
            self.redis.set(_BYTES, total, nx=True)  # from now on, every write adds to it
        return total

    def _count(self, change: int) -> None:
        """Add `change` to the bytes counted, once a count is kept. The write
        it follows stands: a count the server misses is not its failure."""
        if change:
            with contextlib.suppress(StoreUnavailable, StoreFull), _reachable(self.store_id):
                self._add(keys=[_BYTES], args=[change])

    def prefixes(self, budget: int) -> RedisPrefixes:
        return RedisPrefixes(self, budget)

    def lease(self, holder: str, ttl_s: float) -> str:
        with _reachable(self.store_id):
            current = self._lease(keys=[_LEASE], args=[holder, int(ttl_s * 1000)])
        return current.decode() if isinstance(current, bytes) else str(current)

    def release(self, holder: str) -> None:
        with _reachable(self.store_id):
            self._release(keys=[_LEASE], args=[holder])
