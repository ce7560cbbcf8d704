"""A worker killed with SIGKILL mid-generation: the client gets `worker
lost` within 3 heartbeat intervals, the session hibernates (its record holds
what completed), the broker stays up and a new worker serves it and new
sessions. A broker stopped for longer than its deadline on a worker's
silence (SIGSTOP: as an fsync behind a disk's writeback stalls it) loses
no worker: its own time away is not the worker's silence."""

from __future__ import annotations

import os
import signal
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
        stream = session.chat("Write a long story about a lighthouse.", max_tokens=16, credit=2)
        next(stream)  # generating now, held by its credit however fast the worker decodes
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


def test_a_stalled_broker_loses_no_worker(stack_factory):
    # The broker beats every 0.2 s and drops a worker silent for 1.5 s; the
    # worker beats every 1 s and gives the broker 2.5 s: a 1.9 s stop is
    # past the broker's deadline (a worker's last frame is at least that
    # old when it resumes) and inside the worker's.
    stack = stack_factory(workers=1, slabs=2, broker_args=["--heartbeat-s", "0.2", "--heartbeat-liveness", "7.5"])
    with Client(stack.frontend, timeout=60) as client:
        session = client.open_session()
        stream = session.chat("Count from one to twenty.", max_tokens=24, temperature=0.0)
        tokens = list(next(stream).token_ids)  # generating now
        os.kill(stack.broker.pid, signal.SIGSTOP)
        try:
            time.sleep(1.9)
        finally:
            os.kill(stack.broker.pid, signal.SIGCONT)
        tokens += [t for chunk in stream for t in chunk.token_ids]  # no WorkerLost
        assert len(tokens) == stream.result.completion_tokens > 1
        info = session.info()
        assert info.state == "live" and info.restores == 0
    broker_log = (stack.dir / "broker.log").read_text()
    assert "broker_stalled" in broker_log and "worker_lost" not in broker_log, stack.logs()
