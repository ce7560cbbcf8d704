"""Queue limits and quota on one worker with one slab kept busy by a running
generation (an idle slab would be hibernated for the newcomer): a queued
open that waits too long, a full queue, a cancelled queued open (its place
frees), and a client over its quota each get `overloaded` with the right
reason."""

from __future__ import annotations

import time

import pytest
from conftest import Stack
from test_broker_frames import Raw, expect_error

from kvmux import protocol as p
from kvmux.protocol import ErrorCode, Op

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)


@pytest.fixture(scope="module")
def stack():
    stack = Stack(
        workers=1,
        slabs=1,
        broker_args=["--admission", "queue", "--queue-depth", "2", "--queue-wait-s", "20", "--client-quota", "2"],
    )
    yield stack
    stack.stop()


@pytest.fixture
def raws(stack):
    made: list[Raw] = []

    def make() -> Raw:
        made.append(Raw(stack.frontend))
        return made[-1]

    yield make
    for raw in made:
        raw.close()


def _queue_depth_is(stack, depth: int) -> None:
    deadline = time.monotonic() + 10
    while stack.stats().queue_depth != depth:
        assert time.monotonic() < deadline, f"queue depth never reached {depth}"
        time.sleep(0.02)


def _overloaded(reply, reason: str) -> p.Error:
    error = expect_error(reply, ErrorCode.OVERLOADED)
    assert error.reason == reason, error
    return error


def busy(raw: Raw, session_id: str) -> int:
    """Start a long generation and read one chunk: with credit 1 the worker
    then waits for a grant, so the slab stays busy without computing."""
    story = [p.ChatMessage("user", "Tell a very long story about the sea.")]
    request_id = raw.send(Op.GENERATE, p.Generate(messages=story, max_tokens=256, credit=1), session_id)
    env, chunk = raw.recv()
    assert env.request_id == request_id and isinstance(chunk, p.Chunk), (env, chunk)
    return request_id


def test_queue_timeout_overflow_and_cancel(stack, raws):
    holder, late, c, d, e, f = (raws() for _ in range(6))
    _, held = holder.call(Op.OPEN, p.OpenSession())
    assert isinstance(held, p.SessionOpened)
    running = busy(holder, held.session_id)

    started = time.monotonic()
    error = _overloaded(late.call(Op.OPEN, p.OpenSession(queue_wait_s=0.5)), "queue_timeout")
    assert 0.5 <= time.monotonic() - started < 5
    assert error.retry_after_s > 0

    c_open = c.send(Op.OPEN, p.OpenSession())
    _queue_depth_is(stack, 1)
    d_open = d.send(Op.OPEN, p.OpenSession())
    _queue_depth_is(stack, 2)
    error = _overloaded(e.call(Op.OPEN, p.OpenSession()), "queue_full")
    assert error.queue_depth == 2

    # c gives up its place: its open ends `cancelled`, the cancel is acked
    cancel = c.send(Op.CANCEL, p.Cancel(request_id=c_open))
    expect_error(c.recv(), ErrorCode.CANCELLED, c_open)
    env, ack = c.recv()
    assert env.request_id == cancel and isinstance(ack, p.Ack)
    _queue_depth_is(stack, 1)
    f_open = f.send(Op.OPEN, p.OpenSession())  # takes the freed place
    _queue_depth_is(stack, 2)

    # the holder's generation ends: its idle session hibernates for d (queued
    # first), whose new idle session hibernates in turn for f
    holder.send(Op.CANCEL, p.Cancel(request_id=running), held.session_id)
    env, opened_d = d.recv()
    assert env.request_id == d_open and isinstance(opened_d, p.SessionOpened)
    env, opened_f = f.recv()
    assert env.request_id == f_open and isinstance(opened_f, p.SessionOpened)
    for raw, session_id in ((d, opened_d.session_id), (f, opened_f.session_id)):
        raw.call(Op.CLOSE, p.Close(), session_id)
    stats = stack.stats()
    assert stats.queue_depth == 0 and stats.queue_wait_p99_s > 0 and stats.hibernations >= 2
    assert stats.sessions == 1 and stats.sessions_hibernated + stats.sessions_live == 1  # the holder's, resumable


def test_override_limits(stack, raws):
    raw = raws()
    expect_error(raw.call(Op.OPEN, p.OpenSession(admission="lottery")), ErrorCode.INVALID_ARGUMENT)
    error = expect_error(raw.call(Op.OPEN, p.OpenSession(queue_wait_s=3600.0)), ErrorCode.INVALID_ARGUMENT)
    assert "queue_wait_s" in error.message


def test_client_quota(stack, raws):
    first, second, third, other = (raws() for _ in range(4))
    _, held = first.call(Op.OPEN, p.OpenSession(client_name="app"))
    assert isinstance(held, p.SessionOpened)
    busy(first, held.session_id)
    queued = second.send(Op.OPEN, p.OpenSession(client_name="app"))  # a queued open counts too
    _queue_depth_is(stack, 1)
    error = _overloaded(third.call(Op.OPEN, p.OpenSession(client_name="app")), "quota")
    assert "app" in error.message
    other_open = other.send(Op.OPEN, p.OpenSession(client_name="another-app"))  # not over its quota: queued
    _queue_depth_is(stack, 2)

    closing = first.send(Op.CLOSE, p.Close(), held.session_id)  # cancels its generation, then closes
    while (reply := first.recv())[0].request_id != closing:
        pass  # the cancelled stream's last chunk and result
    assert isinstance(reply[1], p.Closed)
    env, opened = second.recv()
    assert env.request_id == queued and isinstance(opened, p.SessionOpened)
    second.call(Op.CLOSE, p.Close(), opened.session_id)
    env, opened = other.recv()
    assert env.request_id == other_open and isinstance(opened, p.SessionOpened)
    other.call(Op.CLOSE, p.Close(), opened.session_id)
