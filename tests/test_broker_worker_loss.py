"""A worker killed with SIGKILL mid-generation: the client gets `worker
lost` within 3 heartbeat intervals, the session hibernates (its record holds
what completed), the broker stays up and a new worker serves it and new
sessions."""

from __future__ import annotations

import time

import pytest

from kvmux import protocol as p
from kvmux.client import Client, WorkerLost

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)


def test_worker_killed_mid_generation(stack_factory):
    stack = stack_factory(workers=1, slabs=2)
    with Client(stack.frontend, timeout=60) as client:
        session = client.open_session(system="Be brief.")
        assert len(list(session.chat("Name a fruit.", max_tokens=2))) == 2  # a completed turn
        kept = session.info().history_tokens
        stream = session.chat("Write a long story about a lighthouse.", max_tokens=16)
        next(stream)  # generating now
        killed = time.monotonic()
        stack.kill_worker(0)
        with pytest.raises(WorkerLost):
            for _ in stream:
                pass
        assert time.monotonic() - killed < 3 * p.HEARTBEAT_INTERVAL_S
        info = session.info()  # answered from the store: the session lives on, less the request in flight
        assert info.state == "hibernated" and info.messages == 3 and info.history_tokens == kept
        stats = client.stats()
        assert stats.workers == [] and stats.in_flight == 0 and stats.slabs_total == 0
        assert stats.sessions == stats.sessions_hibernated == 1

        stack.add_worker()
        assert len(list(session.chat("Just one word.", max_tokens=2))) == 2  # restored on the new worker
        assert session.info().state == "live" and session.info().restores == 1
        fresh = client.open_session()
        chunks = list(stream := fresh.chat("Hi", max_tokens=2))
        assert sum(len(c.token_ids) for c in chunks) == stream.result.completion_tokens == 2
        fresh.close()
