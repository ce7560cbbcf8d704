"""Scale-out over tcp: a second worker that joins while the first is full
takes the next sessions at once; killing it fails only its own sessions."""

from __future__ import annotations

import pytest

from kvmux.client import Client, Overloaded, WorkerLost

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)


def test_tcp_worker_joins_and_leaves(stack_factory):
    stack = stack_factory(workers=1, slabs=1, transport="tcp")
    assert stack.backend.startswith("tcp://")
    with Client(stack.frontend, timeout=60) as client:
        first = client.open_session(system="Be brief.")
        running = first.chat("Tell me a long story.", max_tokens=256, credit=1)
        next(running)  # waits for credit: the only slab stays busy
        with pytest.raises(Overloaded) as full:
            client.open_session()
        assert full.value.reason == "no_slab"
        running.close()

        stack.add_worker(slabs=2)  # registered once this returns
        second, third = client.open_session(), client.open_session()
        assert second.opened.worker_id == third.opened.worker_id != first.opened.worker_id
        stats = client.stats()
        assert stats.slabs_total == 3 and stats.slabs_used == 3 and len(stats.workers) == 2

        stream = second.chat("Tell me a long story.", max_tokens=16, credit=2)  # held by its credit
        next(stream)
        stack.kill_worker(1)
        with pytest.raises(WorkerLost):
            for _ in stream:
                pass
        assert third.info().state == "hibernated"  # its worker shared our store: it waits there
        chunks = list(reply := first.chat("Hi", max_tokens=2))  # the first worker's session is untouched
        assert sum(len(c.token_ids) for c in chunks) == reply.result.completion_tokens == 2
        stats = client.stats()
        assert len(stats.workers) == 1 and stats.slabs_total == 1
        assert stats.sessions == 3 and stats.sessions_live == 1 and stats.sessions_hibernated == 2
        first.close()
