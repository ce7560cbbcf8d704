"""Admission under load: 2 workers x 2 slabs, 20 clients at once. `reject`
admits exactly 4 and refuses 16 with `overloaded`; `queue` (depth 16, wait
30 s) serves all 20 in arrival order with every token delivered once."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import Stack

from kvmux.client import Client, Overloaded

CLIENTS = 20


@pytest.fixture(scope="module")
def stack():
    # The daemon queues; the reject test asks for `reject` per session.
    stack = Stack(
        workers=2, slabs=2, broker_args=["--admission", "queue", "--queue-depth", "16", "--queue-wait-s", "30"]
    )
    yield stack
    stack.stop()


def test_reject_admits_exactly_the_free_slabs(stack):
    barrier = threading.Barrier(CLIENTS)

    def open_one(_):
        client = Client(stack.frontend, timeout=60)
        barrier.wait()
        try:
            return client, client.open_session(admission="reject")
        except Overloaded as exc:
            return client, exc

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(open_one, range(CLIENTS)))
    try:
        sessions = [r for _, r in results if not isinstance(r, Overloaded)]
        refusals = [r for _, r in results if isinstance(r, Overloaded)]
        assert len(sessions) == 4 and len(refusals) == 16
        assert all(e.reason == "no_slab" and e.retry_after_s > 0 and e.queue_depth == 0 for e in refusals)
        # placed on the worker with the most free slabs: 2 and 2
        assert sorted(Counter(s.opened.worker_id for s in sessions).values()) == [2, 2]
        stats = stack.stats()
        assert (stats.slabs_used, stats.sessions, stats.rejected, stats.admitted) == (4, 4, 16, 4)
        assert all(w.slabs_used == 2 and w.sessions == 2 for w in stats.workers)
    finally:
        for client, _ in results:
            client.close()
    assert stack.stats().slabs_used == 0


def test_queue_serves_everyone_in_order(stack):
    opened: list[int] = []
    tokens: dict[int, tuple[int, int]] = {}
    changed = threading.Condition()
    all_queued = threading.Event()
    one_close_at_a_time = threading.Lock()
    before = stack.stats()

    def run(i: int) -> None:
        with Client(stack.frontend, timeout=60) as client:
            session = client.open_session(system="Be brief.")
            with changed:
                opened.append(i)
                changed.notify_all()
            assert all_queued.wait(60)
            stream = session.chat(f"Count to {i}.", max_tokens=3)
            seen = sum(len(chunk.token_ids) for chunk in stream)
            tokens[i] = (seen, stream.result.completion_tokens)
            # Free one slab at a time and wait until the queue's head took it,
            # so the order sessions open in is the order of admission.
            with one_close_at_a_time:
                count = len(opened)
                session.close()
                with changed:
                    assert changed.wait_for(lambda: len(opened) > count or count == CLIENTS, 60)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    for i, thread in enumerate(threads):
        thread.start()
        if i < 4:  # the four that get a slab at once
            with changed:
                assert changed.wait_for(lambda i=i: len(opened) == i + 1, 30)
        else:  # queued one after the other: arrival order is known
            _wait_for(lambda i=i: stack.stats().queue_depth == i - 3)
    all_queued.set()
    for thread in threads:
        thread.join(120)
    assert opened == list(range(CLIENTS))
    assert len(tokens) == CLIENTS
    assert all(seen == reported == 3 for seen, reported in tokens.values()), tokens

    stats = stack.stats()
    assert stats.queue_depth == 0 and stats.slabs_used == 0 and stats.sessions == 0 and stats.in_flight == 0
    assert stats.admitted - before.admitted == CLIENTS and stats.rejected == before.rejected
    assert 0 < stats.queue_wait_p50_s <= stats.queue_wait_p99_s < 60
    assert sum(w.frames_forwarded for w in stats.workers) == stats.frames_forwarded


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
