"""Frame-level broker behaviour on a bare DEALER (what no client library
sends): every bad frame gets its typed error, echoing the request id when it
is readable, and the broker keeps serving."""

from __future__ import annotations

import itertools
import json
import subprocess
import time

import msgspec
import pytest
import zmq
from conftest import kvmux_command

from kvmux import protocol as p
from kvmux.protocol import ErrorCode, Op


class Raw:
    """A bare DEALER speaking protocol v1 through protocol.codec."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)

    def send(self, op: str, body, session_id: str = "") -> int:
        request_id = next(self._ids)
        self.sock.send_multipart([p.envelope(op, request_id, session_id), p.encode(body)])
        return request_id

    def recv(self, timeout_s: float = 30.0) -> tuple[p.Envelope, object]:
        """The next reply (the broker's heartbeats skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))), f"no reply within {timeout_s}s"
            env, body = self.sock.recv_multipart()
            if (envelope := p.decode_envelope(env)).op != Op.HEARTBEAT:
                return envelope, p.decode_reply(body)

    def call(self, op: str, body, session_id: str = "", timeout_s: float = 30.0) -> tuple[p.Envelope, object]:
        """Send one request; return its last reply (partials are skipped)."""
        request_id = self.send(op, body, session_id)
        while True:
            env, reply = self.recv(timeout_s)
            assert env.request_id == request_id, (env, reply)
            if env.op != Op.PARTIAL:
                return env, reply

    def close(self) -> None:
        self.sock.close()


def expect_error(reply: tuple[p.Envelope, object], code: ErrorCode, request_id: int | None = None) -> p.Error:
    env, body = reply
    assert env.op == Op.ERROR and isinstance(body, p.Error), reply
    assert body.code == code, body
    if request_id is not None:
        assert env.request_id == request_id
    return body


@pytest.fixture
def raw(shared_stack):
    sock = Raw(shared_stack.frontend)
    yield sock
    sock.close()


def test_ping_and_stats(raw, shared_stack):
    before = time.time()
    env, pong = raw.call(Op.PING, p.Ping())
    assert env.op == Op.FINAL and isinstance(pong, p.Pong) and pong.time >= before - 1
    _, stats = raw.call(Op.STATS, p.Stats())
    assert stats.version == p.PROTOCOL_VERSION and not stats.draining
    assert len(stats.workers) == 1 and stats.workers[0].slabs_total == shared_stack.slabs
    assert stats.slabs_total == shared_stack.slabs


@pytest.mark.parametrize(
    ("parts", "code", "request_id"),
    [
        ([p.envelope(Op.PING, 7)], ErrorCode.MALFORMED_FRAME, 7),  # body missing
        ([p.envelope(Op.PING, 8), p.encode(p.Ping()), b"extra"], ErrorCode.MALFORMED_FRAME, 8),
        ([b"\xc1garbage", p.encode(p.Ping())], ErrorCode.MALFORMED_FRAME, 0),
        ([p.encode(["v1", "ping", 9, ""]), p.encode(p.Ping())], ErrorCode.MALFORMED_FRAME, 9),
        ([p.encode([2, "ping", 10, ""]), p.encode(p.Ping())], ErrorCode.VERSION_MISMATCH, 10),
        ([p.encode([2, "ping", 11, "", {"future": 1}]), b""], ErrorCode.VERSION_MISMATCH, 11),
        ([p.envelope("frobnicate", 12), p.encode({})], ErrorCode.UNKNOWN_OP, 12),
        ([p.envelope(Op.READY, 13), p.encode({})], ErrorCode.UNKNOWN_OP, 13),  # a worker's op
        ([p.envelope(Op.OPEN, 14), b"\x01"], ErrorCode.MALFORMED_FRAME, 14),  # body not a map
        ([p.envelope(Op.OPEN, 15), p.encode({"window": "wide"})], ErrorCode.MALFORMED_FRAME, 15),
        ([p.envelope(Op.INFO, 16, "no-such-session"), p.encode(p.Info())], ErrorCode.SESSION_NOT_FOUND, 16),
        ([p.envelope(Op.INFO, 17), p.encode(p.Info())], ErrorCode.INVALID_ARGUMENT, 17),  # no session id
        ([p.envelope(Op.CANCEL, 18), p.encode(p.Cancel(request_id=99))], ErrorCode.INVALID_ARGUMENT, 18),
        ([p.envelope(Op.DRAIN, 19), p.encode(p.Drain(grace_s=1.0))], ErrorCode.FORBIDDEN, 19),  # not admin
        ([p.envelope(Op.DRAIN, 20), b"\xc1"], ErrorCode.FORBIDDEN, 20),
    ],
)
def test_bad_frames_get_typed_errors(raw, parts, code, request_id):
    raw.sock.send_multipart(parts)
    expect_error(raw.recv(), code, request_id)
    _, pong = raw.call(Op.PING, p.Ping())  # still serving
    assert isinstance(pong, p.Pong)


def test_admin_endpoint_takes_drain_but_checks_it(shared_stack):
    admin = Raw(shared_stack.admin)
    try:
        expect_error(admin.call(Op.DRAIN, p.Drain(grace_s=-1.0)), ErrorCode.INVALID_ARGUMENT)
        _, stats = admin.call(Op.STATS, p.Stats())
        assert not stats.draining
        assert {e.name: e.endpoint for e in stats.endpoints}["admin"] == shared_stack.admin
        assert all("OPEN" not in e.protection for e in stats.endpoints), stats.endpoints
    finally:
        admin.close()


def test_worker_limits_on_tokens(raw):
    _, opened = raw.call(Op.OPEN, p.OpenSession())
    sid = opened.session_id
    try:
        error = expect_error(raw.call(Op.GENERATE, p.Generate(max_tokens=4097), sid), ErrorCode.INVALID_ARGUMENT)
        assert "4096" in error.message and "--max-tokens-limit" in error.message
        error = expect_error(raw.call(Op.APPEND, p.Append(token_ids=[1] * 32769), sid), ErrorCode.INVALID_ARGUMENT)
        assert "--max-append-tokens" in error.message
        text = "word " * 33000
        error = expect_error(
            raw.call(Op.APPEND, p.Append(messages=[p.ChatMessage("user", text)]), sid), ErrorCode.INVALID_ARGUMENT
        )
        assert "--max-append-tokens" in error.message
        _, info = raw.call(Op.INFO, p.Info(), sid)
        assert info.history_tokens == 0  # nothing of the refused appends stayed
        _, appended = raw.call(Op.APPEND, p.Append(messages=[p.ChatMessage("user", "Hi.")]), sid)
        assert appended.new_tokens > 0
    finally:
        raw.call(Op.CLOSE, p.Close(), sid)


def test_oversized_frame(raw):
    body = b"\x00" * p.DEFAULT_MAX_FRAME_BYTES  # with the envelope, one byte too many is enough
    raw.sock.send_multipart([p.envelope(Op.APPEND, 21, "some-session"), body])
    error = expect_error(raw.recv(), ErrorCode.FRAME_TOO_LARGE, 21)
    assert str(p.DEFAULT_MAX_FRAME_BYTES) in error.message
    _, pong = raw.call(Op.PING, p.Ping())
    assert isinstance(pong, p.Pong)


def test_session_ops_reach_the_worker_and_close_frees_the_slab(raw, shared_stack):
    env, opened = raw.call(Op.OPEN, p.OpenSession(system="Be brief."))
    assert isinstance(opened, p.SessionOpened) and len(opened.session_id) == 32  # minted by the broker
    assert env.session_id == opened.session_id
    used = shared_stack.stats().slabs_used
    assert used >= 1
    _, info = raw.call(Op.INFO, p.Info(), opened.session_id)
    assert isinstance(info, p.SessionInfo) and info.session_id == opened.session_id
    _, closed = raw.call(Op.CLOSE, p.Close(), opened.session_id)
    assert isinstance(closed, p.Closed)
    assert shared_stack.stats().slabs_used == used - 1
    expect_error(raw.call(Op.INFO, p.Info(), opened.session_id), ErrorCode.SESSION_NOT_FOUND)


def test_kvmux_stats_command(shared_stack):
    done = subprocess.run(
        kvmux_command("stats", "--endpoint", shared_stack.frontend, "--json"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    stats = msgspec.convert(json.loads(done.stdout), p.BrokerStats)
    assert len(stats.workers) == 1 and stats.slabs_total == shared_stack.slabs
    done = subprocess.run(
        kvmux_command("stats", "--endpoint", shared_stack.frontend), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "WORKER" in done.stdout and stats.workers[0].worker_id in done.stdout
    assert f"slabs {stats.slabs_used}/{stats.slabs_total} used" in done.stdout
    compute = stats.workers[0].compute  # what decides the worker's speed and exactness
    assert compute.mode == "default" and compute.blas in done.stdout
    assert ("near-tie" in done.stdout) == (not compute.exact)


def test_kvmux_stats_without_a_broker_fails_fast(tmp_path):
    started = time.monotonic()
    done = subprocess.run(
        kvmux_command("stats", "--endpoint", f"ipc://{tmp_path}/none.ipc", "--timeout-s", "1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "kvmux stats:" in done.stderr
    assert time.monotonic() - started < 30


def test_closes_that_wait_for_a_running_generation_each_get_their_answer(raw, shared_stack):
    """Two CLOSEs (from two connections) of a session while it generates:
    the worker stops the generation at its next token, closes once, and
    answers both (a second waiting close used to replace the first, which
    then never got an answer)."""
    other = Raw(shared_stack.frontend)
    try:
        # Its connection up first: a close sent on a connection still being
        # made can reach the worker after the first close has ended the
        # session (then it is rightly told there is no such session).
        other.call(Op.PING, p.Ping())
        _, opened = raw.call(Op.OPEN, p.OpenSession())
        sid = opened.session_id
        generating = raw.send(
            Op.GENERATE, p.Generate(messages=[p.ChatMessage("user", "Tell a long story.")], max_tokens=200), sid
        )
        env, _ = raw.recv()
        assert env.request_id == generating and env.op == Op.PARTIAL  # it runs
        first, second = raw.send(Op.CLOSE, p.Close(), sid), other.send(Op.CLOSE, p.Close(), sid)
        answers = {}
        while first not in answers:
            env, reply = raw.recv()
            if env.op != Op.PARTIAL:
                answers[env.request_id] = reply
        assert isinstance(answers[first], p.Closed)
        env, reply = other.recv()
        assert env.request_id == second and isinstance(reply, p.Closed), reply
    finally:
        other.close()
