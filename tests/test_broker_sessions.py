"""Sessions and the broker: an idle one is closed by the idle timeout and
its client hears `session expired`; a client that vanishes mid-stream has
its generation cancelled on the worker, and its session stays resumable,
even when the stream was paused on its credit (found by the broker's
heartbeats, which a live client's paused stream outlasts), and when its
process stopped answering the broker's heartbeats (a host or network gone);
and clients that flood the broker and leave do not take it down."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
import zmq
from conftest import stacks_at_once
from test_broker_frames import Raw

from kvmux import protocol as p
from kvmux.client import Client, SessionExpired
from kvmux.protocol import Op

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)

IDLE_S = 1.0
CLIENT_LIVENESS_S = 2.0
HEARTBEAT_S = 0.1


@pytest.fixture(scope="module")
def stacks():
    """One with the idle timeout, one without (a session there must stay), started at once."""
    with stacks_at_once(
        idle={"slabs": 2, "broker_args": ["--idle-timeout-s", str(IDLE_S)]},
        # Ten heartbeats a second: where the broker's sockets had ZeroMQ's own
        # heartbeats, flooding and leaving aborted it within 30 rounds so.
        plain={
            "slabs": 2,
            "broker_args": [
                *("--client-liveness-s", str(CLIENT_LIVENESS_S)),
                *("--heartbeat-s", str(HEARTBEAT_S), "--heartbeat-liveness", "30"),
            ],
        },
    ) as stacks:
        yield stacks


def test_idle_session_expires(stacks):
    stack = stacks["idle"]
    with Client(stack.frontend, timeout=30) as client:
        idle = client.open_session()
        busy = client.open_session()
        before = client.stats().expired
        deadline = time.monotonic() + 3 * IDLE_S
        while time.monotonic() < deadline:
            busy.info()  # in use: never expires
            time.sleep(IDLE_S / 4)
        with pytest.raises(SessionExpired, match="idle"):
            idle.info()
        assert busy.info().session_id == busy.id
        stats = client.stats()
        assert stats.expired == before + 1 and stats.sessions == 1 and stats.slabs_used == 1
        busy.close()


def test_client_vanishing_mid_stream_cancels_it_and_keeps_the_session(stacks):
    stack = stacks["plain"]  # no idle timeout here: the session must stay
    raw = Raw(stack.frontend)
    _, opened = raw.call(Op.OPEN, p.OpenSession())
    raw.send(
        Op.GENERATE,
        p.Generate(messages=[p.ChatMessage("user", "Tell me a long story.")], max_tokens=64),
        opened.session_id,
    )
    env, chunk = raw.recv()
    assert env.op == Op.PARTIAL and isinstance(chunk, p.Chunk)
    before = stack.stats().sessions
    raw.close()  # gone, without a word
    gone = time.monotonic()
    while (stats := stack.stats()).in_flight or any(w.running for w in stats.workers):
        assert time.monotonic() - gone < 3.0, f"still generating: {stats}"  # cancelled at a token boundary
        time.sleep(0.02)
    assert stats.sessions == before  # the session stays, resumable by id from any client
    other = Raw(stack.frontend)
    _, resumed = other.call(Op.RESUME, p.Resume(), opened.session_id)
    assert isinstance(resumed, p.SessionOpened) and resumed.session_id == opened.session_id
    _, info = other.call(Op.INFO, p.Info(), opened.session_id)
    assert info.history_tokens > 0 and not info.busy
    other.call(Op.CLOSE, p.Close(), opened.session_id)
    other.close()


def test_a_client_vanishing_while_its_stream_waits_on_credit_is_found(stacks):
    """No frame goes to a client whose stream waits for its credit, so its
    vanishing shows only to the broker's heartbeats: within a few intervals
    the stream is cancelled and the session freed. A client that is still
    there keeps its paused stream through the same heartbeats."""
    stack = stacks["plain"]
    story = p.Generate(messages=[p.ChatMessage("user", "Tell me a long story.")], max_tokens=64, credit=1)
    live, doomed = Raw(stack.frontend), Raw(stack.frontend)
    _, kept = live.call(Op.OPEN, p.OpenSession())
    _, lost = doomed.call(Op.OPEN, p.OpenSession())
    kept_id = live.send(Op.GENERATE, story, kept.session_id)
    doomed.send(Op.GENERATE, story, lost.session_id)
    assert live.recv()[0].op == Op.PARTIAL and doomed.recv()[0].op == Op.PARTIAL
    doomed.close()  # gone, without a word, while its stream waits on credit
    gone = time.monotonic()
    while (stats := stack.stats()).in_flight > 1:
        assert time.monotonic() - gone < 5 * p.HEARTBEAT_INTERVAL_S, f"still waiting: {stats}"
        time.sleep(0.05)
    other = Raw(stack.frontend)
    _, info = other.call(Op.INFO, p.Info(), lost.session_id)
    assert info.history_tokens > 0 and not info.busy  # the stream was cancelled, its tokens kept
    other.call(Op.CLOSE, p.Close(), lost.session_id)
    other.close()

    env = None
    while env is None or env.op == Op.PARTIAL:  # paused for seconds, and still there: read on
        live.send(Op.CREDIT, p.Credit(request_id=kept_id, n=1), kept.session_id)
        env, result = live.recv()
    assert env.op == Op.FINAL and result.stop_reason != p.StopReason.CANCELLED, (env, result)
    live.call(Op.CLOSE, p.Close(), kept.session_id)
    live.close()


def test_a_client_that_stops_answering_is_dropped_and_its_stream_cancelled(stacks):
    """A client paused on its credit longer than --client-liveness-s keeps
    its stream while it answers the broker's heartbeats. Stopped (SIGSTOP:
    its connection stays open, as a dead host's or a cut network's can), it
    answers none: after --client-liveness-s it is gone, its paused stream
    cancelled and its session freed, resumable by id."""
    stack = stacks["plain"]
    script = textwrap.dedent(f"""
        import time
        from kvmux.client import Client
        session = Client({stack.frontend!r}, timeout=60).open_session()
        stream = session.chat("Tell me a long story.", max_tokens=64, credit=1)
        next(stream)
        print(session.id, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        session_id = child.stdout.readline().strip()
        assert len(session_id) == 32, session_id
        time.sleep(CLIENT_LIVENESS_S * 2)
        assert stack.stats().in_flight == 1  # quiet, answering: there
        child.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while (stats := stack.stats()).in_flight:
            assert time.monotonic() - stopped < CLIENT_LIVENESS_S + 5 * p.HEARTBEAT_INTERVAL_S, f"still held: {stats}"
            time.sleep(0.1)
        assert time.monotonic() - stopped > CLIENT_LIVENESS_S / 2  # the client's silence, not something else
    finally:
        child.kill()
        child.wait()
    with Client(stack.frontend, timeout=30) as client:
        resumed = client.resume_session(session_id)
        info = resumed.info()
        assert info.history_tokens > 0 and not info.busy
        resumed.close()


def test_clients_that_flood_the_broker_and_leave_do_not_take_it_down(stacks):
    """Each round a client sends far past the broker's high-water mark, so
    its queue there is full, and disconnects: the broker serves on."""
    stack = stacks["plain"]
    ping = [p.envelope(Op.PING, 1), p.encode(p.Ping())]
    for _ in range(30):
        flood = zmq.Context.instance().socket(zmq.DEALER)
        flood.setsockopt(zmq.SNDHWM, 0)
        flood.connect(stack.frontend)
        for _ in range(20000):
            flood.send_multipart(ping)
        time.sleep(0.02)  # on the wire, up to the broker's mark
        flood.close(linger=0)
        time.sleep(2 * HEARTBEAT_S)
        assert stack.broker.poll() is None, stack.logs()
    with Client(stack.frontend, timeout=30) as client:
        assert client.ping() and client.stats().workers
