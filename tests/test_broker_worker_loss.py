"""A worker killed with SIGKILL mid-generation: the client gets `worker
lost` within 3 heartbeat intervals, the session answers `session not found`
afterwards, the broker stays up and a new worker serves new sessions."""

from __future__ import annotations

import time

import pytest

from kvmux import protocol as p
from kvmux.client import Client, SessionNotFound, WorkerLost


def test_worker_killed_mid_generation(stack_factory):
    stack = stack_factory(workers=1, slabs=2)
    with Client(stack.frontend, timeout=60) as client:
        session = client.open_session(system="Be brief.")
        stream = session.chat("Write a long story about a lighthouse.", max_tokens=16)
        next(stream)  # generating now
        killed = time.monotonic()
        stack.kill_worker(0)
        with pytest.raises(WorkerLost):
            for _ in stream:
                pass
        assert time.monotonic() - killed < 3 * p.HEARTBEAT_INTERVAL_S
        with pytest.raises(SessionNotFound, match="lost"):
            session.info()
        stats = client.stats()
        assert stats.workers == [] and stats.sessions == 0 and stats.in_flight == 0 and stats.slabs_total == 0

        stack.add_worker()
        fresh = client.open_session()
        chunks = list(stream := fresh.chat("Hi", max_tokens=2))
        assert sum(len(c.token_ids) for c in chunks) == stream.result.completion_tokens == 2
        fresh.close()
