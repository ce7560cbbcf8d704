"""Admission under load: 2 workers x 2 slabs, every slab running a
generation (an idle slab never refuses anyone: its session hibernates for
the newcomer). Then `reject` refuses 20 clients at once with `no_slab`,
and `queue` (depth 16, wait 30 s) holds 16 clients and serves them all once
the slabs are released, every token delivered once; a queued open whose
client vanished leaves the queue."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import Stack

from kvmux import protocol as p
from kvmux.client import Client, Overloaded

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)

CLIENTS = 20
QUEUED = 16


@pytest.fixture(scope="module")
def stack():
    # The daemon queues; the reject test asks for `reject` per session.
    stack = Stack(
        workers=2, slabs=2, broker_args=["--admission", "queue", "--queue-depth", "16", "--queue-wait-s", "30"]
    )
    yield stack
    stack.stop()


class Holders:
    """Four sessions, each running a long generation paused by credit 1
    (the worker waits for a grant without computing): every slab is busy."""

    def __init__(self, stack: Stack):
        self.client = Client(stack.frontend, timeout=60)
        self.sessions = [self.client.open_session() for _ in range(4)]
        self.streams = []
        for session in self.sessions:
            stream = session.chat("Tell a very long story about the sea.", max_tokens=256, credit=1)
            next(stream)
            self.streams.append(stream)

    def release(self) -> None:
        for stream in self.streams:
            stream.close()

    def close(self) -> None:
        self.release()
        self.client.close()


def test_reject_refuses_everyone_while_every_slab_runs(stack):
    holders = Holders(stack)
    before = stack.stats()
    # placed on the worker with the most free slabs: 2 and 2
    assert sorted(Counter(s.opened.worker_id for s in holders.sessions).values()) == [2, 2]
    barrier = threading.Barrier(CLIENTS)

    def open_one(_):
        with Client(stack.frontend, timeout=60) as client:
            barrier.wait()
            try:
                return client.open_session(admission="reject")
            except Overloaded as exc:
                return exc

    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(open_one, range(CLIENTS)))
        assert all(isinstance(r, Overloaded) for r in results), results
        assert all(e.reason == "no_slab" and e.retry_after_s > 0 and e.queue_depth == 0 for e in results)
        stats = stack.stats()
        assert stats.rejected - before.rejected == CLIENTS and stats.admitted == before.admitted
        assert {r.reason: r.count for r in stats.refused}["no_slab"] >= CLIENTS
        assert stats.slabs_used == 4 and all(w.slabs_used == 2 for w in stats.workers)
        holders.release()
        with Client(stack.frontend, timeout=60) as client:
            assert client.open_session(admission="reject") is not None  # an idle slab: its session hibernates
    finally:
        holders.close()


def test_queue_serves_everyone(stack):
    holders = Holders(stack)
    before = stack.stats()
    tokens: dict[int, tuple[int, int]] = {}
    queued = threading.Event()

    def run(i: int) -> None:
        with Client(stack.frontend, timeout=90) as client:
            session = client.open_session(system="Be brief.")
            assert queued.is_set()  # nobody got in before the slabs were released
            stream = session.chat(f"Count to {i}.", max_tokens=3)
            seen = sum(len(chunk.token_ids) for chunk in stream)
            tokens[i] = (seen, stream.result.completion_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(QUEUED)]
    try:
        for i, thread in enumerate(threads):
            thread.start()
            _wait_for(lambda i=i: stack.stats().queue_depth == i + 1)
        queued.set()
        holders.release()
        for thread in threads:
            thread.join(180)
    finally:
        holders.close()
    assert len(tokens) == QUEUED
    assert all(seen == reported == 3 for seen, reported in tokens.values()), tokens

    stats = stack.stats()
    assert stats.queue_depth == 0 and stats.in_flight == 0
    assert stats.admitted - before.admitted == QUEUED and stats.rejected == before.rejected
    assert stats.hibernations > before.hibernations  # slabs went from idle sessions to the queue
    assert 0 < stats.queue_wait_p50_s <= stats.queue_wait_p99_s < 60
    assert sum(w.frames_forwarded for w in stats.workers) == stats.frames_forwarded


def test_a_queued_open_whose_client_vanished_is_dropped_before_it_takes_a_slab(stack):
    """Nothing is sent to a client whose open waits in the queue: the
    broker's heartbeats find it gone, and its open leaves the queue while
    every slab is still held (it would else open a session nobody owns)."""
    holders = Holders(stack)
    try:
        before = stack.stats()
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from kvmux.client import Client; Client({stack.frontend!r}, timeout=60).open_session()",
            ]
        )
        _wait_for(lambda: stack.stats().queue_depth == 1)
        child.kill()
        child.wait()
        _wait_for(lambda: stack.stats().queue_depth == 0, timeout_s=5 * p.HEARTBEAT_INTERVAL_S)
        stats = stack.stats()
        assert stats.sessions == before.sessions and stats.admitted == before.admitted
    finally:
        holders.close()


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
