"""broker/registry.py on its own: no sockets, no model, real protocol
structs. Free slabs are derived (slabs - foreign - live sessions - opens in
flight), so every test checks them after the change it makes."""

from __future__ import annotations

from kvmux.broker.registry import Registry, SessionEntry, State, WorkerEntry
from kvmux.protocol import ErrorCode, Op, SessionOpened, WorkerReady


def ready(slabs: int = 2, free: int | None = None, store: str = "") -> WorkerReady:
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
        store=store,
    )


def add(
    reg: Registry, session_id: str, worker: WorkerEntry | None, owner: str = "alice", now: float = 0.0
) -> SessionEntry:
    opened = SessionOpened(session_id=session_id, worker_id="w", model="m", sink=4, window=64, slab_bytes=1)
    return reg.add_session(session_id, worker, b"c1", owner, now, opened)


def test_free_slabs_are_slabs_minus_foreign_sessions_and_opens():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(slabs=4, free=3), now=0.0)  # one slab held by a session we never opened
    assert worker.foreign == 1 and worker.free_slabs == 3
    opening = reg.track(b"c1", 1, Op.OPEN, worker, "s1", owner="alice")
    assert worker.opening == 1 and worker.free_slabs == 2  # an open in flight reserves its slab
    reg.finish(opening)
    add(reg, "s1", worker)
    assert worker.opening == 0 and worker.in_flight == 0 and worker.free_slabs == 2
    add(reg, "s2", worker)
    add(reg, "s3", worker)
    assert worker.free_slabs == 0 and reg.slabs_free() == 0
    reg.drop_session("s1")
    assert worker.free_slabs == 1 and reg.slabs_free() == 1 and reg.slabs_total() == 4


def test_track_and_finish_count_per_worker_and_session_and_finishing_twice_is_harmless():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(), now=0.0)
    session = add(reg, "s1", worker)
    generate = reg.track(b"c1", 7, Op.GENERATE, worker, "s1")
    info = reg.track(b"c1", 8, Op.INFO, worker, "s1")
    assert session.in_flight == 2 and worker.in_flight == 2 and worker.opening == 0
    assert reg.requests[(b"c1", 7)] is generate
    reg.finish(generate)
    reg.finish(generate)
    assert session.in_flight == 1 and worker.in_flight == 1 and list(reg.requests.values()) == [info]
    reg.finish(info)
    assert session.in_flight == 0 and worker.in_flight == 0 and not reg.requests


def test_removing_a_worker_fails_its_requests_and_remembers_why_its_sessions_went():
    reg = Registry()
    lost, other = reg.add_worker(b"w1", ready(), now=0.0), reg.add_worker(b"w2", ready(), now=0.0)
    add(reg, "s1", lost)
    add(reg, "s2", other)
    mine = reg.track(b"c1", 1, Op.GENERATE, lost, "s1")
    theirs = reg.track(b"c1", 2, Op.INFO, other, "s2")
    assert reg.remove_worker(lost, "silent for 3.0s", stored=False) == [mine]
    assert list(reg.workers.values()) == [other] and list(reg.requests.values()) == [theirs]
    assert lost.in_flight == 0 and "s1" not in reg.sessions and "s2" in reg.sessions
    code, why, _owner = reg.gone["s1"]
    assert code is ErrorCode.WORKER_LOST and "w1" in why and "silent for 3.0s" in why


def test_a_lost_worker_sharing_our_store_leaves_its_sessions_hibernated():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(store="h:/state"), now=0.0)
    session = add(reg, "s1", worker)
    reg.track(b"c1", 1, Op.GENERATE, worker, "s1")
    assert len(reg.remove_worker(worker, "disconnected", stored=True)) == 1
    assert reg.sessions["s1"] is session and session.worker is None and session.state is State.HIBERNATED
    assert session.in_flight == 0 and "s1" not in reg.gone


def test_place_picks_the_most_free_and_skips_draining_full_or_other_store_workers():
    reg = Registry()
    small = reg.add_worker(b"w1", ready(slabs=2, store="a"), now=0.0)
    big = reg.add_worker(b"w2", ready(slabs=4, store="b"), now=0.0)
    assert reg.place() is big
    assert reg.place("a") is small  # a restore needs a worker reading the session's store
    big.draining = True
    assert reg.place() is small and reg.place("b") is None
    add(reg, "x", small)
    add(reg, "y", small)
    assert reg.place() is None


def test_hibernating_frees_the_slab_and_placing_takes_one_to_restore():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(slabs=1), now=0.0)
    session = add(reg, "s1", worker)
    assert worker.free_slabs == 0 and session.state is State.LIVE
    reg.hibernated(session)
    assert session.worker is None and worker.free_slabs == 1 and reg.sessions["s1"] is session
    reg.place_session(session, worker)
    assert session.worker is worker and session.state is State.RESTORING and worker.free_slabs == 0
    reg.hibernated(session)
    assert session.state is State.HIBERNATED and worker.free_slabs == 1


def test_idle_live_lists_hibernation_candidates_least_recently_used_first():
    reg = Registry()
    here = reg.add_worker(b"w1", ready(slabs=8, store="a"), now=0.0)
    there = reg.add_worker(b"w2", ready(slabs=8, store="b"), now=0.0)
    newer, older = add(reg, "newer", here, now=5.0), add(reg, "older", here, now=1.0)
    elsewhere = add(reg, "elsewhere", there, now=0.0)
    reg.track(b"c1", 1, Op.GENERATE, here, add(reg, "busy", here).session_id)
    reg.closing(add(reg, "closing", here), ErrorCode.SESSION_EXPIRED)
    add(reg, "ending", here).ending = ErrorCode.SESSION_EXPIRED
    reg.place_session(add(reg, "restoring", None), here)
    reg.hibernated(add(reg, "asleep", here))
    assert reg.idle_live() == [elsewhere, older, newer]
    assert reg.idle_live("a") == [older, newer]


def test_quota_counts_live_and_hibernated_sessions_and_opens_of_an_owner():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(slabs=8), now=0.0)
    add(reg, "live", worker)
    add(reg, "asleep", None)
    add(reg, "ending", worker).ending = ErrorCode.SESSION_EXPIRED
    reg.track(b"c1", 1, Op.OPEN, worker, "opening", owner="alice")
    reg.track(b"c1", 2, Op.OPEN, worker, "orphan", owner="alice").orphaned = True
    add(reg, "bobs", worker, owner="bob")
    assert reg.live_sessions_of("alice") == 3 and reg.live_sessions_of("bob") == 1


def test_dropped_sessions_are_remembered_with_their_reason_and_the_memory_is_bounded():
    reg = Registry()
    worker = reg.add_worker(b"w1", ready(), now=0.0)
    add(reg, "closed", worker)
    reg.drop_session("closed")
    assert worker.free_slabs == 2 and "closed" not in reg.gone  # a client close needs no reason
    add(reg, "s0", worker)
    reg.drop_session("s0", ErrorCode.SESSION_EXPIRED, "idle")
    assert reg.gone["s0"] == (ErrorCode.SESSION_EXPIRED, "idle", "alice")  # the owner: told only to it
    for i in range(1, 4097):
        reg.drop_session(f"s{i}", ErrorCode.SESSION_NOT_FOUND, "lost")
    assert len(reg.gone) == 4096 and "s0" not in reg.gone and "s4096" in reg.gone
