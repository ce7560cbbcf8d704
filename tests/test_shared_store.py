"""Sessions beyond one host: a real redis-server as the session store, and
workers with state dirs of their own (two hosts, as far as the store is
concerned). A worker SIGKILLed loses only its request in flight; a worker
declared lost that comes back cannot overwrite what the session's new
worker wrote; a second broker is refused while the first holds the store;
redis-server restarted (AOF) loses nothing."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import msgspec
import pytest
from conftest import Stack, kvmux_command

from kvmux.bench import redis_server as bench_redis
from kvmux.client import Client, WorkerLost
from kvmux.sessions import Fenced, LocalStore, SessionRecord
from kvmux.sessions.redis_store import RedisStore

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)

GREEDY = {"temperature": 0.0, "speculative": "off"}


@pytest.fixture
def redis_server(tmp_path):
    with bench_redis.redis_server(tmp_path / "redis") as server:
        yield server


def two_hosts(redis_url: str, tmp_path, **kwargs) -> Stack:
    """A broker and a worker (1 slab) on the store, and a second worker with
    a state dir of its own (2 slabs) over tcp."""
    store = ["--store", redis_url]
    stack = Stack(workers=1, slabs=1, transport="tcp", broker_args=store, worker_args=store, **kwargs)
    stack.add_worker("--state-dir", str(tmp_path / "second-host"), slabs=2)
    return stack


def worker_id(proc: subprocess.Popen) -> str:
    return f"{socket.gethostname()}-{proc.pid}"  # a worker's default id


def turn(session, text: str, max_tokens: int = 8) -> list[int]:
    stream = session.chat(text, max_tokens=max_tokens, **GREEDY)
    return [t for chunk in stream for t in chunk.token_ids]


def test_a_killed_hosts_sessions_resume_on_the_other_with_their_history(redis_server, tmp_path):
    stack = two_hosts(redis_server.url, tmp_path)
    try:
        with Client(stack.frontend, timeout=120) as client:
            sessions = [client.open_session(system="Be brief.") for _ in range(3)]
            on_second = [s for s in sessions if s.opened.worker_id == worker_id(stack.workers[1])]
            assert len(on_second) == 2
            for i, session in enumerate(sessions):
                turn(session, f"Name a fruit that starts with {'ABC'[i]}.")
            before = {s.id: s.info(token_ids=True).token_ids for s in sessions}

            stack.kill_worker(1)  # the second host, with two of the sessions
            time.sleep(3.5)  # its heartbeats stop: the broker declares it lost
            assert all(s.info().state == "hibernated" for s in on_second)  # from the shared store

            for session in on_second:  # each restored on the first host in turn (1 slab)
                info = session.info(token_ids=True)
                assert info.token_ids == before[session.id]
                reply = turn(session, "And one more?")
                control = client.open_session(system="Be brief.")  # the same conversation, never moved
                turn(control, f"Name a fruit that starts with {'ABC'[sessions.index(session)]}.")
                assert turn(control, "And one more?") == reply
                control.close()
                assert session.info().restores >= 1
    finally:
        stack.stop()


def test_a_worker_declared_lost_cannot_overwrite_the_sessions_new_home(redis_server, tmp_path):
    stack = two_hosts(redis_server.url, tmp_path)
    try:
        with Client(stack.frontend, timeout=120) as client:
            opened = [client.open_session(system="Be brief.") for _ in range(2)]
            stale = stack.workers[1]
            (session,) = [s for s in opened if s.opened.worker_id == worker_id(stale)]  # on the second host
            (first,) = [s for s in opened if s is not session]
            turn(session, "Name a fruit.")
            stream = session.chat("Write a long story about a lighthouse.", max_tokens=48, credit=2, **GREEDY)
            next(stream)  # held by its credit however fast the worker decodes
            stale.send_signal(signal.SIGSTOP)  # frozen mid-generation: silent, then declared lost
            with pytest.raises(WorkerLost):
                for _ in stream:
                    pass
            first.close()  # a slab for the session on the first host
            turn(session, "Just one word?")  # restored there: a new placement
            home = session.info(token_ids=True)
            assert home.state == "live" and home.worker_id == worker_id(stack.workers[0])

            # Woken, it finishes the story and tries to save it (refused:
            # its placement is stale), unless the broker's close of its copy
            # (the session is claimed twice) stops the story first.
            stale.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 60
            while not any(
                event in (stack.dir / "worker1.log").read_text() for event in ("session_fenced", '"kept": true')
            ):
                assert time.monotonic() < deadline, stack.logs()
                time.sleep(0.2)
            record = RedisStore(redis_server.url).load(session.id)
            assert record.history + record.pending == home.token_ids  # the new home's, untouched
            assert session.info(token_ids=True).token_ids == home.token_ids
            assert len(turn(session, "Thanks.")) > 0
    finally:
        if stack.workers[1].poll() is None:
            stack.workers[1].send_signal(signal.SIGCONT)  # never left stopped: stop() must reach it
        stack.stop()


def test_one_broker_per_store_and_a_standby_serves_every_session(redis_server, tmp_path):
    store = ["--store", redis_server.url]
    # ipc, not tcp: a client and a worker keep reconnecting to the dead
    # broker's endpoint, and a local tcp port that nothing holds any more
    # can end up connected to the reconnecting socket itself (a source port
    # equal to the destination) or to another test's socket: a request
    # sent there is lost, and the client waited its whole timeout.
    stack = Stack(workers=0, broker_args=store)
    standby = {name: f"ipc://{stack.dir}/standby-{name}.ipc" for name in ("frontend", "backend")}
    # Worker and client know both brokers: each goes to whichever serves.
    stack.add_worker("--store", redis_server.url, "--connect", f"{stack.backend},{standby['backend']}")
    second = None

    def serve_standby() -> subprocess.Popen:
        options = [f"--{name}={endpoint}" for name, endpoint in standby.items()]
        options.append(f"--admin-endpoint=ipc://{tmp_path}/standby-admin")
        cmd = kvmux_command("serve", "--workers", "0", *store, "--state-dir", str(tmp_path / "standby"), *options)
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    try:
        with Client(f"{stack.frontend},{standby['frontend']}", timeout=120) as client:
            session = client.open_session(system="Be brief.")
            turn(session, "Name a fruit.")
            history = session.info(token_ids=True).token_ids

            refused = serve_standby()  # while the first broker holds the store's lease
            out, _ = refused.communicate(timeout=60)
            assert refused.returncode == 2 and "another broker serves the session store" in out

            stack.broker.send_signal(signal.SIGKILL)  # the first host is gone
            stack.broker.wait(timeout=30)
            second = serve_standby()  # on "another host": its own endpoints and state dir, the same store
            deadline = time.monotonic() + 60
            while not client.stats().workers:  # the worker moves over once the first broker is silent
                assert time.monotonic() < deadline, stack.logs()
                time.sleep(0.2)
            assert session.info(token_ids=True).token_ids == history  # the same client, the same session
            assert len(turn(session, "And another?")) > 0
    finally:
        if second is not None:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=30)
        stack.stop()


def test_redis_restarted_loses_nothing(redis_server, tmp_path):
    stack = Stack(
        workers=1, slabs=1, broker_args=["--store", redis_server.url], worker_args=["--store", redis_server.url]
    )
    try:
        with Client(stack.frontend, timeout=120) as client:
            session = client.open_session(system="Be brief.")
            turn(session, "Name a fruit.")
            other = client.open_session(system="Be brief.")  # the only slab: the first hibernates to Redis
            turn(other, "Name a colour.")
            history = session.info(token_ids=True).token_ids

            redis_server.kill()  # SIGKILL: only what the AOF holds survives
            redis_server.start()
            assert session.info(token_ids=True).token_ids == history  # restored from the restarted store
            assert len(turn(session, "And another?")) > 0
            assert session.info().restores == 1
    finally:
        stack.stop()


def test_a_stale_placements_write_is_refused_by_both_backends(redis_server, tmp_path):
    session_id = "ab" * 16
    record = SessionRecord(session_id=session_id, model="m", updated=0.0, sink=4, window=64, history=[1, 2])
    for store in (RedisStore(redis_server.url), LocalStore(tmp_path / "state")):
        old = store.claim(session_id)
        store.save(record, old)
        new = store.claim(session_id)  # placed again: the old placement's writes are refused from now on
        with pytest.raises(Fenced):
            store.save(msgspec.structs.replace(record, history=[9]), old)
        assert store.load(session_id).history == [1, 2]
        store.save(msgspec.structs.replace(record, history=[1, 2, 3]), new)
        assert store.load(session_id).history == [1, 2, 3]
        store.delete(session_id)
        assert not store.exists(session_id) and session_id not in list(store.session_ids())


def test_without_a_shared_store_a_remote_hosts_sessions_stay_with_it_and_go_with_it(tmp_path):
    stack = Stack(workers=1, slabs=1, transport="tcp", broker_args=["--hibernate-after-s", "1"])
    remote_dir = tmp_path / "remote-host"
    remote = stack.add_worker("--state-dir", str(remote_dir), slabs=1)
    try:
        with Client(stack.frontend, timeout=120) as client:
            opened = [client.open_session(system="Be brief.") for _ in range(2)]
            (there,) = [s for s in opened if s.opened.worker_id == worker_id(remote)]
            (here,) = [s for s in opened if s is not there]
            for session in opened:
                turn(session, "Name a fruit.")
            before = there.info(token_ids=True).token_ids
            deadline = time.monotonic() + 30
            while {s.session_id: s.state for s in client.list_sessions()}[there.id] != "hibernated":
                # idle past 1 s (a listing does not count as use): into the remote host's own store
                assert time.monotonic() < deadline, stack.logs()
                time.sleep(0.2)
            assert there.info(token_ids=True).token_ids == before  # answered by the host that stores it
            owners = {s.session_id: s.owner for s in client.list_sessions()}

            stack.restart_broker()  # a broker that never read the remote host's store
            stack.wait_workers(2)  # the remote worker lists what its store holds when it registers again
            assert {s.session_id: s.owner for s in client.list_sessions()} == owners
            assert there.info(token_ids=True).token_ids == before
            turn(there, "And one more?")  # restored where its record is
            info = there.info()
            assert info.state == "live" and info.worker_id == worker_id(remote) and info.restores == 1

            stack.kill_worker(1)  # the remote host is lost, and its store with it
            deadline = time.monotonic() + 30
            while len(client.stats().workers) > 1:
                assert time.monotonic() < deadline, stack.logs()
                time.sleep(0.2)
            with pytest.raises(WorkerLost):
                there.info()
            assert (remote_dir / "sessions" / there.id).exists()
            stack.add_worker("--state-dir", str(remote_dir), slabs=1)  # back: what was reported lost goes
            while (remote_dir / "sessions" / there.id).exists():
                assert time.monotonic() < deadline + 60, stack.logs()
                time.sleep(0.2)
            assert len(turn(here, "And another?")) > 0  # the broker's own host's session is untouched
    finally:
        stack.stop()
