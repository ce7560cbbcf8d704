"""Sessions and the broker: an idle one is closed by the idle timeout and
its client hears `session expired`; a client that vanishes mid-stream has
its generation cancelled on the worker, and its session stays resumable."""

from __future__ import annotations

import time

import pytest
from conftest import stacks_at_once
from test_broker_frames import Raw

from kvmux import protocol as p
from kvmux.client import Client, SessionExpired
from kvmux.protocol import Op

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)

IDLE_S = 1.0


@pytest.fixture(scope="module")
def stacks():
    """One with the idle timeout, one without (a session there must stay), started at once."""
    with stacks_at_once(
        idle={"slabs": 2, "broker_args": ["--idle-timeout-s", str(IDLE_S)]}, plain={"slabs": 2}
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
