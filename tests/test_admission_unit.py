"""broker/admission.py on its own: no sockets, no model; real protocol
structs and a real Registry. A session with a request in flight is busy (its
slab cannot be freed); an idle one can be hibernated, so it never makes an
open fail."""

from __future__ import annotations

import msgspec
import pytest

from kvmux.broker.admission import Admission, Pending, Refusal, percentiles
from kvmux.broker.config import BrokerConfig
from kvmux.broker.registry import Registry, SessionEntry, WorkerEntry
from kvmux.protocol import ErrorCode, Op, OpenSession, OverloadReason, ProtocolError, SessionOpened, WorkerReady


def ready(slabs: int) -> WorkerReady:
    return WorkerReady(
        model="m", slabs=slabs, slab_bytes=1, sink=4, max_window=64, version=1, pid=1, host="h", free_slabs=slabs
    )


def pending(route: bytes = b"c1", request_id: int = 1, owner: str = "alice", session_id: str = "") -> Pending:
    return Pending(route, request_id, b"", owner, 0.0, 0.0, session_id=session_id)


def add(
    reg: Registry, session_id: str, worker: WorkerEntry | None, owner: str = "zed", now: float = 0.0
) -> SessionEntry:
    opened = SessionOpened(session_id=session_id, worker_id="w", model="m", sink=4, window=64, slab_bytes=1)
    return reg.add_session(session_id, worker, b"c0", owner, now, opened)


def busy(reg: Registry, worker: WorkerEntry, session_id: str = "busy") -> SessionEntry:
    session = add(reg, session_id, worker)
    reg.track(b"c0", len(reg.requests) + 1, Op.GENERATE, worker, session_id)
    return session


def full(cfg: BrokerConfig) -> tuple[Registry, Admission, WorkerEntry]:
    """One worker whose only slab runs a generation."""
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    busy(reg, worker)
    return reg, Admission(cfg), worker


def test_reject_admits_while_a_slab_is_free_then_refuses_by_reason():
    reg, adm = Registry(), Admission(BrokerConfig(admission="reject", retry_after_s=2.5))
    assert adm.decide(reg, pending(), OpenSession(), 0.0) == Refusal(
        OverloadReason.NO_WORKER, "no worker is registered", 2.5
    )
    worker = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    assert adm.decide(reg, pending(), OpenSession(), 0.0) is worker
    busy(reg, worker)
    refused = adm.decide(reg, pending(), OpenSession(), 0.0)
    assert isinstance(refused, Refusal) and refused.reason is OverloadReason.NO_SLAB and "1 slabs" in refused.message
    assert not adm.queue


def test_every_refusal_is_counted_by_reason_and_draining_has_no_retry_hint():
    adm = Admission(BrokerConfig())
    assert adm.refuse(OverloadReason.DRAINING, "the broker is draining").retry_after_s is None
    assert adm.refuse(OverloadReason.WORKER_STALLED, "not reading").retry_after_s == 1.0
    adm.refuse(OverloadReason.WORKER_STALLED, "not reading")
    assert adm.refused == {OverloadReason.DRAINING: 1, OverloadReason.WORKER_STALLED: 2} and adm.rejected == 3


def test_queue_is_fifo_bounded_in_depth_and_in_wait():
    reg, adm, worker = full(BrokerConfig(admission="queue", queue_depth=2, queue_wait_s=5.0))
    first, second = pending(b"c1"), pending(b"c2")
    assert adm.decide(reg, first, OpenSession(), 1.0) is first
    assert adm.decide(reg, second, OpenSession(), 2.0) is second
    assert (first.enqueued, first.deadline, second.deadline) == (1.0, 6.0, 7.0)
    assert adm.is_queued(b"c1", 1) and not adm.is_queued(b"c1", 2)
    refused = adm.decide(reg, pending(b"c3"), OpenSession(), 2.5)
    assert isinstance(refused, Refusal) and refused.reason is OverloadReason.QUEUE_FULL
    assert adm.next_admitted(reg, 3.0) is None  # no slab yet
    reg.finish(reg.requests[(b"c0", 1)])
    reg.drop_session("busy")
    assert adm.next_admitted(reg, 4.0) == (first, worker)  # first in, first out
    assert adm.wait_percentiles() == (3.0, 3.0)
    assert adm.timed_out(6.9) == [] and adm.timed_out(7.0) == [second]
    assert not adm.queue and adm.refused == {OverloadReason.QUEUE_FULL: 1}


def test_a_free_slab_never_lets_a_newcomer_jump_the_queue():
    reg, adm, _worker = full(BrokerConfig(admission="queue"))
    waiting, newcomer = pending(b"c1"), pending(b"c2")
    adm.decide(reg, waiting, OpenSession(), 0.0)
    reg.finish(reg.requests[(b"c0", 1)])
    reg.drop_session("busy")
    assert adm.decide(reg, newcomer, OpenSession(), 0.1) is newcomer
    assert list(adm.queue) == [waiting, newcomer]


def test_session_overrides_are_checked_against_the_daemon():
    adm = Admission(BrokerConfig(admission="reject", queue_wait_s=10.0))
    assert adm.policy(OpenSession()) == ("reject", 10.0)
    assert adm.policy(OpenSession(admission="queue", queue_wait_s=2.0)) == ("queue", 2.0)
    for bad in (OpenSession(admission="lottery"), OpenSession(queue_wait_s=60.0), OpenSession(queue_wait_s=0.0)):
        with pytest.raises(ProtocolError) as exc:
            adm.policy(bad)
        assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    strict = Admission(BrokerConfig(allow_session_override=False))
    with pytest.raises(ProtocolError):
        strict.policy(OpenSession(admission="queue"))


def test_a_session_override_queues_under_a_reject_daemon_with_its_own_wait():
    reg, adm, _worker = full(BrokerConfig(admission="reject", queue_wait_s=10.0))
    mine = pending()
    assert adm.decide(reg, mine, OpenSession(admission="queue", queue_wait_s=2.0), 1.0) is mine
    assert mine.deadline == 3.0


def test_an_idle_session_makes_any_policy_wait_for_its_slab():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    idle = add(reg, "idle", worker)
    adm = Admission(BrokerConfig(admission="reject", queue_wait_s=5.0))
    waiting = pending()
    assert adm.decide(reg, waiting, OpenSession(), 1.0) is waiting and waiting.deadline == 6.0
    reg.hibernating(idle)  # its HIBERNATE is on its way: still worth waiting for
    second = pending(b"c2")
    assert adm.decide(reg, second, OpenSession(), 1.0) is second and list(adm.queue) == [waiting, second]
    assert not adm.refused


def test_opens_wait_for_the_daemons_own_workers_while_they_start():
    reg, adm = Registry(), Admission(BrokerConfig(admission="reject", worker_wait_s=60.0))
    waiting = pending()
    assert adm.decide(reg, waiting, OpenSession(), 1.0, workers_starting=True) is waiting
    assert waiting.deadline == 61.0
    worker = reg.add_worker(b"w1", ready(slabs=1), now=2.0)
    assert adm.next_admitted(reg, 3.0) == (waiting, worker)


def test_quota_counts_queued_opens_and_skips_calls_on_existing_sessions():
    reg, adm, _worker = full(BrokerConfig(admission="queue", client_quota=2))
    add(reg, "mine", None, owner="alice")  # hibernated: still alice's
    adm.decide(reg, pending(b"c1", 2), OpenSession(), 0.0)  # queued: alice's second
    refused = adm.decide(reg, pending(b"c1", 3), OpenSession(), 0.0)
    assert isinstance(refused, Refusal) and refused.reason is OverloadReason.QUOTA and "'alice'" in refused.message
    call = pending(b"c1", 4, session_id="mine")  # a call on her hibernated session needs a slab, not quota
    assert adm.decide(reg, call, None, 0.0) is call
    assert [p.is_open for p in adm.queue] == [True, False] and adm.queued_for("alice") == 1


def test_max_sessions_bounds_live_hibernated_opening_and_queued_sessions():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    add(reg, "asleep", None)
    reg.track(b"c0", 1, Op.OPEN, worker, "opening", owner="zed")
    adm = Admission(BrokerConfig(admission="queue", max_sessions=3))
    adm.decide(reg, pending(b"c1"), OpenSession(), 0.0)
    refused = adm.decide(reg, pending(b"c2"), OpenSession(), 0.0)
    assert isinstance(refused, Refusal) and refused.reason is OverloadReason.QUOTA and "maximum of 3" in refused.message


def test_remove_and_flush_take_opens_out_of_the_queue():
    reg, adm, _worker = full(BrokerConfig(admission="queue"))
    a1, a2, b1 = pending(b"a", 1), pending(b"a", 2), pending(b"b", 1)
    for p in (a1, a2, b1):
        adm.decide(reg, p, OpenSession(), 0.0)
    assert adm.remove(b"a", 2) == [a2] and adm.remove(b"a", 2) == []
    assert adm.remove(b"a") == [a1]
    assert adm.flush() == [b1] and not adm.queue


def test_idle_picks_sessions_past_the_idle_timeout_or_the_ttl_with_nothing_running():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(slabs=8), now=0.0)
    old = add(reg, "old", worker)
    asleep = add(reg, "asleep", None)
    busy(reg, worker)
    new = add(reg, "new", worker, now=5.0)
    reg.hibernating(add(reg, "hibernating", worker))
    add(reg, "ending", worker).ending = ErrorCode.SESSION_EXPIRED
    assert Admission(BrokerConfig(idle_timeout_s=10.0, session_ttl_s=0)).idle(reg, 12.0) == [old, asleep]
    assert Admission(BrokerConfig(idle_timeout_s=0, session_ttl_s=100.0)).idle(reg, 12.0) == []
    assert Admission(BrokerConfig(idle_timeout_s=0, session_ttl_s=100.0)).idle(reg, 106.0) == [old, asleep, new]
    assert Admission(BrokerConfig(idle_timeout_s=0, session_ttl_s=0)).idle(reg, 1e9) == []


def test_percentiles():
    assert percentiles([]) == (0.0, 0.0)
    assert percentiles([2.0]) == (2.0, 2.0)
    assert percentiles([float(i) for i in range(101)]) == (50.0, 99.0)


def test_each_model_is_admitted_and_queued_on_its_own():
    """A model whose only slab runs holds back its own opens, never another
    model's: a second model's open is admitted at once, and served first
    from the queue when its slab frees though the first model's waited longer."""
    reg, adm = Registry(), Admission(BrokerConfig(admission="queue", queue_depth=1))
    small = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    big = reg.add_worker(b"w2", msgspec.structs.replace(ready(slabs=1), model="g"), now=0.0)
    busy(reg, small)
    waiting = pending(request_id=2)
    waiting.model = "m"
    assert adm.decide(reg, waiting, OpenSession(), 0.0) is waiting
    other = pending(request_id=3)
    other.model = "g"
    assert adm.decide(reg, other, OpenSession(), 1.0) is big  # m's queue is not g's
    full_m = pending(request_id=4)
    full_m.model = "m"
    refused = adm.decide(reg, full_m, OpenSession(), 1.0)
    assert isinstance(refused, Refusal) and refused.reason is OverloadReason.QUEUE_FULL  # depth counts per model
    reg.track(b"c0", 99, Op.OPEN, big, "x")
    later = pending(request_id=5)
    later.model = "g"
    assert adm.decide(reg, later, OpenSession(), 2.0) is later
    reg.finish(reg.requests[(b"c0", 99)])
    assert adm.next_admitted(reg, 3.0) == (later, big)  # m's first still has no slab: g's is served
    assert adm.next_admitted(reg, 3.0) is None and list(adm.queue) == [waiting]


def test_the_client_quota_counts_per_model():
    reg, adm = Registry(), Admission(BrokerConfig(client_quota=1))
    reg.add_worker(b"w1", ready(slabs=2), now=0.0)
    gemma = reg.add_worker(b"w2", msgspec.structs.replace(ready(slabs=2), model="g"), now=0.0)
    add(reg, "s1", reg.workers[b"w1"], owner="alice")  # alice's one session of "m"
    again = pending()
    again.model = "m"
    refused = adm.decide(reg, again, OpenSession(), 0.0)
    assert isinstance(refused, Refusal) and refused.reason is OverloadReason.QUOTA and "of m" in refused.message
    other = pending(request_id=2)
    other.model = "g"
    assert adm.decide(reg, other, OpenSession(), 0.0) is gemma
