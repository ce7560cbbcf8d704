"""The broker's pure modules, no sockets and no model: the registry's slab
accounting (broker/registry.py) and admission's decisions
(broker/admission.py), on real protocol structs."""

from __future__ import annotations

import pytest

from kvmux.broker.admission import Admission, PendingOpen, Refusal, percentiles
from kvmux.broker.config import BrokerConfig
from kvmux.broker.registry import Registry, Worker
from kvmux.protocol import ErrorCode, Op, OpenSession, OverloadReason, ProtocolError, WorkerReady


def ready(slabs: int = 2, free: int | None = None) -> WorkerReady:
    return WorkerReady(
        model="m",
        slabs=slabs,
        slab_bytes=1,
        sink=4,
        max_window=64,
        version=1,
        pid=1,
        host="h",
        free_slabs=slabs if free is None else free,
    )


def pending(route: bytes = b"c1", request_id: int = 1, owner: str = "alice", now: float = 0.0) -> PendingOpen:
    return PendingOpen(route, request_id, b"", owner, now, now)


# ------------------------------------------------------------------ registry


def test_free_slabs_are_derived_from_sessions_opens_and_foreign_slabs():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(slabs=4, free=3), now=0.0)  # one slab held by a session we never opened
    assert worker.foreign == 1 and worker.free_slabs == 3
    reg.track(b"c1", 1, Op.OPEN, worker, "s1", owner="alice")
    assert worker.free_slabs == 2 and worker.opening == 1  # an open in flight reserves its slab
    req = reg.requests[(b"c1", 1)]
    reg.finish(req)
    reg.add_session("s1", worker, b"c1", "alice", now=0.0)
    assert worker.free_slabs == 2 and worker.opening == 0 and worker.in_flight == 0
    reg.drop_session("s1")
    assert worker.free_slabs == 3 and reg.slabs_free() == 3 and reg.slabs_total() == 4


def test_track_and_finish_count_per_session_and_finish_twice_is_harmless():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(), now=0.0)
    session = reg.add_session("s1", worker, b"c1", "alice", now=0.0)
    req = reg.track(b"c1", 7, Op.GENERATE, worker, "s1")
    assert session.in_flight == 1 and worker.in_flight == 1
    reg.finish(req)
    reg.finish(req)
    assert session.in_flight == 0 and worker.in_flight == 0 and not reg.requests


def test_removing_a_worker_fails_its_requests_and_remembers_why_its_sessions_went():
    reg = Registry()
    lost_worker = reg.add_worker(b"w1", ready(), now=0.0)
    other = reg.add_worker(b"w2", ready(), now=0.0)
    reg.add_session("s1", lost_worker, b"c1", "alice", now=0.0)
    reg.add_session("s2", other, b"c1", "alice", now=0.0)
    mine = reg.track(b"c1", 1, Op.GENERATE, lost_worker, "s1")
    theirs = reg.track(b"c1", 2, Op.INFO, other, "s2")
    assert reg.remove_worker(lost_worker, "silent") == [mine]
    assert list(reg.requests.values()) == [theirs]
    assert "s1" not in reg.sessions and "s2" in reg.sessions
    code, why = reg.gone["s1"]
    assert code is ErrorCode.SESSION_NOT_FOUND and "silent" in why


def test_place_picks_the_most_free_and_skips_draining_or_full_workers():
    reg = Registry()
    small = reg.add_worker(b"w1", ready(slabs=2), now=0.0)
    big = reg.add_worker(b"w2", ready(slabs=4), now=0.0)
    assert reg.place() is big
    big.draining = True
    assert reg.place() is small
    reg.add_session("a", small, b"c", "o", 0.0)
    reg.add_session("b", small, b"c", "o", 0.0)
    assert reg.place() is None


def test_quota_counts_sessions_and_opens_in_flight_of_an_owner():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(slabs=8), now=0.0)
    reg.add_session("s1", worker, b"c1", "alice", now=0.0)
    reg.track(b"c1", 1, Op.OPEN, worker, "s2", owner="alice")
    reg.add_session("s3", worker, b"c2", "bob", now=0.0)
    assert reg.live_sessions_of("alice") == 2 and reg.live_sessions_of("bob") == 1


# ----------------------------------------------------------------- admission


def test_reject_admits_while_a_slab_is_free_then_refuses_by_reason():
    reg, adm = Registry(), Admission(BrokerConfig(admission="reject"))
    assert adm.decide(reg, pending(), OpenSession(), 0.0) == Refusal(
        OverloadReason.NO_WORKER, "no worker is registered", 1.0
    )
    worker = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    assert adm.decide(reg, pending(), OpenSession(), 0.0) is worker
    reg.add_session("s1", worker, b"c1", "alice", now=0.0)
    refused = adm.decide(reg, pending(), OpenSession(), 0.0)
    assert isinstance(refused, Refusal) and refused.reason is OverloadReason.NO_SLAB
    assert adm.refused == {OverloadReason.NO_WORKER: 1, OverloadReason.NO_SLAB: 1} and adm.rejected == 2


def test_queue_is_fifo_bounded_in_depth_and_in_wait():
    reg, adm = Registry(), Admission(BrokerConfig(admission="queue", queue_depth=2, queue_wait_s=5.0))
    worker = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    reg.add_session("s1", worker, b"c0", "zed", now=0.0)
    first, second = pending(b"c1", 1, now=1.0), pending(b"c2", 1, now=2.0)
    assert adm.decide(reg, first, OpenSession(), 1.0) is first
    assert adm.decide(reg, second, OpenSession(), 2.0) is second
    full = adm.decide(reg, pending(b"c3"), OpenSession(), 2.5)
    assert isinstance(full, Refusal) and full.reason is OverloadReason.QUEUE_FULL
    assert adm.next_admitted(reg, 3.0) is None  # no slab yet
    reg.drop_session("s1")
    assert adm.next_admitted(reg, 4.0) == (first, worker)  # first in, first out
    assert adm.wait_percentiles() == (3.0, 3.0)
    assert adm.timed_out(6.9) == [] and adm.timed_out(7.0) == [second]
    assert not adm.queue


def test_a_free_slab_never_lets_a_newcomer_jump_the_queue():
    reg, adm = Registry(), Admission(BrokerConfig(admission="queue"))
    worker = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    reg.add_session("s1", worker, b"c0", "zed", now=0.0)
    waiting = pending(b"c1")
    adm.decide(reg, waiting, OpenSession(), 0.0)
    reg.drop_session("s1")
    assert adm.decide(reg, pending(b"c2"), OpenSession(), 0.1) is not worker


def test_quota_counts_queued_opens_too():
    reg, adm = Registry(), Admission(BrokerConfig(admission="queue", client_quota=2))
    worker = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    reg.add_session("s1", worker, b"c1", "alice", now=0.0)
    adm.decide(reg, pending(b"c1", 2), OpenSession(), 0.0)  # queued: alice's second
    refused = adm.decide(reg, pending(b"c1", 3), OpenSession(), 0.0)
    assert isinstance(refused, Refusal) and refused.reason is OverloadReason.QUOTA


def test_session_overrides_are_checked_against_the_daemon():
    adm = Admission(BrokerConfig(admission="reject", queue_wait_s=10.0))
    assert adm.policy(OpenSession(admission="queue", queue_wait_s=2.0)) == ("queue", 2.0)
    for bad in (OpenSession(admission="lottery"), OpenSession(queue_wait_s=60.0)):
        with pytest.raises(ProtocolError) as exc:
            adm.policy(bad)
        assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    strict = Admission(BrokerConfig(allow_session_override=False))
    with pytest.raises(ProtocolError):
        strict.policy(OpenSession(admission="queue"))


def test_idle_picks_only_idle_sessions_past_the_timeout():
    reg, adm = Registry(), Admission(BrokerConfig(idle_timeout_s=10.0))
    worker: Worker = reg.add_worker(b"w1", ready(slabs=4), now=0.0)
    old = reg.add_session("old", worker, b"c", "o", now=0.0)
    busy = reg.add_session("busy", worker, b"c", "o", now=0.0)
    reg.add_session("new", worker, b"c", "o", now=5.0)
    reg.track(b"c", 1, Op.GENERATE, worker, "busy")
    assert adm.idle(reg, 12.0) == [old]
    assert busy.in_flight == 1
    assert Admission(BrokerConfig()).idle(reg, 1e9) == []  # off by default


def test_percentiles():
    assert percentiles([]) == (0.0, 0.0)
    assert percentiles([2.0]) == (2.0, 2.0)
    p50, p99 = percentiles([float(i) for i in range(101)])
    assert p50 == 50.0 and p99 == 99.0
