"""A session store that never fills the disk, on a real daemon: the store
counts its bytes as records and snapshots are written; past
`max_store_bytes` the least recently used idle hibernated sessions expire
(typed, counted, logged with their owner), never a live one, and the
daemon keeps serving; a full disk (a small tmpfs) answers a typed error
and loses nothing already stored."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import zmq
from conftest import broker_stats
from test_metrics import scrape, value

from kvmux import protocol as p
from kvmux.bench import redis_server as bench_redis
from kvmux.client import Client, Overloaded, SessionExpired, SessionNotFound
from kvmux.sessions import LocalStore, SessionRecord, StoreFull
from kvmux.sessions.redis_store import RedisStore


def say(session, text: str) -> str:
    return "".join(chunk.text for chunk in session.chat(text, max_tokens=8))


def wait_for(check, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return found


@pytest.mark.stack
def test_past_its_budget_the_store_expires_the_oldest_idle_sessions(stack_factory):
    stack = stack_factory(workers=1, slabs=1, metrics=True)
    with Client(stack.frontend, timeout=60) as client:
        sessions = {}
        for name in "abcd":  # one slab: each open hibernates the one before
            sessions[name] = client.open_session("You are terse.", client_name=f"owner-{name}")
            say(sessions[name], "Name a colour.")
        ids = {name: s.id for name, s in sessions.items()}
        wait_for(lambda: stack.stats().sessions_hibernated == 3, "3 hibernated")
        sizes = {s.session_id: s.bytes_on_disk for s in client.list_sessions()}
        total = stack.stats().store_bytes
        assert total == sum(sizes.values())  # counted as written: what the files take
        # Room for all but the two oldest: a, then b, must go; c (idle, newer) and d (live) stay.
        budget = total - sizes[ids["a"]] - sizes[ids["b"]] // 2
        for session in sessions.values():
            session.detach()
    stack.broker_cmd += ["--max-store-bytes", str(budget)]
    stack.restart_broker()
    stack.wait_workers(1)
    with Client(stack.frontend, timeout=60) as client:

        def stored_once_b_is_gone() -> set[str] | None:
            rows = {s.session_id for s in client.list_sessions()}
            return rows if ids["b"] not in rows else None

        left = wait_for(stored_once_b_is_gone, "b never expired")
        assert left == {ids["c"], ids["d"]}
        assert stack.stats().store_bytes <= budget
        for gone in "ab":
            with pytest.raises(SessionExpired):
                say(client.resume_session(ids[gone]), "Still there?")
        assert value(scrape(stack.metrics), "kvmux_sessions_expired_total", reason="store_budget") == 2
        # It keeps serving: the live session and a new one.
        assert say(client.resume_session(ids["d"]), "Another?")
        assert say(client.open_session(), "Hello.")
    log = (stack.dir / "broker.log").read_text()
    assert '"reason": "store_budget"' in log and '"owner": "owner-a"' in log and '"owner": "owner-b"' in log


@contextlib.contextmanager
def tmpfs(size: str):
    """A small tmpfs of its own (root only), unmounted after."""
    where = Path(tempfile.mkdtemp(prefix="kvmux-full-", dir="/tmp"))
    mounted = (
        os.geteuid() == 0
        and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]).returncode == 0
    )
    if not mounted:
        where.rmdir()
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def fill(where: Path) -> Path:
    """Take every free byte of the filesystem at `where`."""
    filler = where / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


@pytest.mark.stack
def test_a_full_disk_is_a_typed_error_and_loses_nothing_stored(stack_factory):
    with tmpfs("16m") as state:
        stack = stack_factory(
            workers=1, slabs=4, broker_args=["--state-dir", str(state)], worker_args=["--state-dir", str(state)]
        )
        with Client(stack.frontend, timeout=60) as client:
            kept = client.open_session("You are terse.")
            say(kept, "Name a colour.")
            stored = kept.info()
            busy = client.open_session("You are terse.")
            say(busy, "Name a fruit.")
            before = busy.info()
            closing = client.open_session("You are terse.")
            filler = fill(state)
            with pytest.raises(Overloaded) as refused:
                say(busy, "Another one?")
            assert refused.value.reason == "store_full"
            with pytest.raises(Overloaded) as refused:
                client.open_session()
            assert refused.value.reason == "store_full"
            # A close sent behind a generation waits for it; the generation's
            # record finds no room, which drops the live copy: the close is
            # still answered, and closes what stands in the store.
            generated, closed = generate_then_close(stack.frontend, closing.id)
            assert isinstance(generated, p.Error) and generated.reason == "store_full", generated
            assert isinstance(closed, p.Closed), closed
            closing.detach()
            with pytest.raises(SessionNotFound):
                say(client.resume_session(closing.id), "Still there?")
            assert broker_stats(stack.admin) is not None  # the daemon serves on
            # The session stays as its record last stood: the turn that found no room is not in it.
            assert busy.info().messages == before.messages
            filler.unlink()
            assert kept.info().messages == stored.messages
            assert say(kept, "Another?")  # nothing stored was lost
            assert say(busy, "Another one?")
            assert busy.info().messages == before.messages + 2


def generate_then_close(endpoint: str, session_id: str) -> tuple:
    """GENERATE, then at once CLOSE, on one socket: the last reply of each."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        ask = p.Generate(messages=[p.ChatMessage(role="user", content="Write a long poem.")], max_tokens=32)
        sock.send_multipart([p.envelope(p.Op.GENERATE, 1, session_id), p.encode(ask)])
        sock.send_multipart([p.envelope(p.Op.CLOSE, 2, session_id), p.encode(p.Close())])
        last, deadline = {}, time.monotonic() + 30
        while len(last) < 2:
            waiting = sorted({1, 2} - set(last))
            assert time.monotonic() < deadline, f"no last reply to request {waiting} in 30 s"
            if not sock.poll(1000):
                continue
            env_raw, body = sock.recv_multipart()
            env = p.decode_envelope(env_raw)
            if env.op not in (p.Op.PARTIAL, p.Op.HEARTBEAT):  # (the broker's probes of a quiet client)
                last[env.request_id] = p.decode_reply(body)
        return last[1], last[2]
    finally:
        sock.close(linger=0)


def record(session_id: str, tokens: int) -> SessionRecord:
    return SessionRecord(session_id=session_id, model="m", updated=0.0, sink=4, window=64, history=list(range(tokens)))


@pytest.mark.stack
def test_both_backends_count_their_bytes_and_a_redis_oom_is_store_full(tmp_path):
    with bench_redis.redis_server(tmp_path / "redis") as server:
        for store in (RedisStore(server.url), LocalStore(tmp_path / "state")):
            assert store.bytes_total() == 0
            ids = [uuid.uuid4().hex for _ in range(3)]
            epochs = {session_id: store.claim(session_id) for session_id in ids}
            for n, session_id in enumerate(ids, 1):
                store.save(record(session_id, 1000 * n), epochs[session_id])
            store.save(record(ids[2], 10), epochs[ids[2]])  # written again, smaller
            store.delete(ids[0])
            assert store.bytes_total() == sum(store.bytes_stored(session_id) for session_id in ids[1:]) > 0
        redis = RedisStore(server.url)
        session_id = uuid.uuid4().hex
        epoch = redis.claim(session_id)
        redis.save(record(session_id, 10), epoch)
        used = redis.redis.info("memory")["used_memory"]
        redis.redis.config_set("maxmemory", used + 64 * 1024)
        try:
            with pytest.raises(StoreFull, match="out of memory"):
                redis.save(record(session_id, 200_000), epoch)
        finally:
            redis.redis.config_set("maxmemory", 0)
        assert redis.load(session_id).history == list(range(10))  # as it was
