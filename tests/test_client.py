"""The sync Python client against the real stack (broker + worker + model)."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from kvmux import protocol as p
from kvmux.client import (
    Busy,
    Cancelled,
    Client,
    FrameTooLarge,
    InvalidArgument,
    KvmuxError,
    MalformedFrame,
    Overloaded,
    SessionExpired,
    SessionNotFound,
    Timeout,
    UnknownOp,
    VersionMismatch,
    WorkerLost,
)
from kvmux.client.sync import Session

SHORT = {"max_tokens": 8}


@pytest.fixture(scope="module")
def client(shared_stack):
    with Client(shared_stack.frontend, timeout=60) as c:
        yield c


def ghost(session) -> Session:
    """A second handle on the same session id, to reach server-side checks
    (busy, unknown session) that one well-behaved handle never triggers."""
    return Session(session.client, session.opened)


def raw_call(client: Client, envelope: bytes, body: bytes, timeout: float = 10.0):
    """Send hand-made frames through the client and unwrap the reply."""
    rid = msgspec.msgpack.decode(envelope)[2]
    replies: queue.SimpleQueue = queue.SimpleQueue()
    client._calls._queues[rid] = replies  # a hand-made request id the client did not mint
    client._post([envelope, body])
    return client._run(client._answer(rid, replies, timeout, "raw"))


def test_imports_without_mlx():
    code = "import sys, kvmux.client; assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'transformers', 'structlog', 'typer')], sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_multi_turn_chat(client):
    with client.open_session(system="You are terse.") as session:
        stream = session.chat("Name a colour.", **SHORT)
        chunks = list(stream)
        first = stream.result
        assert first is not None and first.stop_reason in ("eos", "max_tokens", "stop")
        assert first.completion_tokens == sum(len(c.token_ids) for c in chunks) > 0
        assert "".join(c.text for c in chunks).strip()
        stream = session.chat("And another one?", **SHORT)
        for _ in stream:
            pass
        second = stream.result
        # the second turn prefills only its new message, never the history
        assert 0 < second.prompt_tokens < first.history_tokens
        assert second.history_tokens > first.history_tokens
        info = session.info(token_ids=True)
        assert info.session_id == session.id
        assert info.history_tokens == second.history_tokens == len(info.token_ids)
        assert info.kv_live_bytes > 0 and not info.busy


def test_append_then_generate(client):
    with client.open_session() as session:
        appended = session.append([{"role": "user", "content": "Count: one, two,"}])
        assert appended.new_tokens > 0 and appended.history_tokens == appended.new_tokens
        raw = session.append(token_ids=[28, 1130])
        assert raw.new_tokens == 2 and raw.history_tokens == appended.history_tokens + 2
        stream = session.generate(max_tokens=4)
        assert len(list(stream)) >= 1 and stream.result.prompt_tokens == 0


def test_break_cancels_and_session_continues(client):
    with client.open_session() as session:
        # Room for ~2 s of decoding, as test_cancel_mid_stream's.
        stream = session.chat("Write a long story about a dragon.", max_tokens=256)
        for _ in stream:
            break
        stream.close()
        assert stream.result.stop_reason == "cancelled"
        assert stream.result.completion_tokens < 256
        # a plain `break` on a dropped iterator: the next turn still works
        for _ in session.chat("Shorter, please.", max_tokens=16):
            break
        again = session.chat("Thanks.", max_tokens=2)
        assert len(list(again)) >= 1 and again.result.stop_reason in ("eos", "max_tokens")


def test_cancel_mid_stream(client):
    with client.open_session() as session:
        # Room for ~2 s of decoding: 16 tokens took less than the cancel's way in once steps got fast.
        stream = session.chat("Tell me about the sea.", max_tokens=256)
        next(stream)
        assert isinstance(session.cancel(), p.Ack)
        rest = list(stream)
        assert stream.result.stop_reason == "cancelled"
        assert stream.result.completion_tokens == 1 + sum(len(c.token_ids) for c in rest) < 256


def test_interleaved_streams_and_threads_share_one_client(client):
    a, b = client.open_session(), client.open_session()
    try:
        sa, sb = a.chat("Say hi.", max_tokens=4), b.chat("Say bye.", max_tokens=4)
        got = {"a": 0, "b": 0}
        for name, stream in (("a", sa), ("b", sb)) * 4:
            if next(stream, None) is not None:
                got[name] += 1
        assert sa.result is None or sa.result.stop_reason != "cancelled"
        list(sa), list(sb)
        assert sa.result.completion_tokens >= got["a"] >= 1 and sb.result.completion_tokens >= got["b"] >= 1
    finally:
        a.close(), b.close()

    results, failures = [], []

    def turn(i: int) -> None:
        try:
            with client.open_session() as s:
                st = s.chat(f"Number {i}?", max_tokens=2)
                list(st)
                results.append(st.result)
        except Exception as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures and len(results) == 3


def test_credit_bounds_what_a_slow_reader_buffers(client):
    with client.open_session() as session:
        stream = session.chat("List ten animals.", max_tokens=8, credit=2)
        next(stream)
        time.sleep(1.5)  # the worker could have produced ~15 tokens meanwhile
        assert stream._reader.replies.qsize() <= 2
        list(stream)  # re-granted credit lets it finish
        assert stream.result.completion_tokens >= 3


def test_server_errors_map_to_classes(client, shared_stack):
    session = client.open_session()
    try:
        with pytest.raises(InvalidArgument):
            client.open_session(window=10**9)
        with pytest.raises(InvalidArgument, match="tokenize"):
            client.open_session(chat_template_kwargs={"tokenize": True})  # apply_chat_template's own option
        with pytest.raises(InvalidArgument):
            session.append()  # neither messages nor token ids
        # credit holds the generation in flight however fast the worker decodes
        stream = session.chat("Describe a forest in detail.", max_tokens=64, credit=2)
        next(stream)
        with pytest.raises(Busy):
            ghost(session).append(token_ids=[28])
        stream.close()
        with pytest.raises(UnknownOp):
            client._call("teleport", "", p.Ping(), 10)
        with pytest.raises(MalformedFrame):
            client._call(p.Op.STATS, "", [1, 2], 10)
        with pytest.raises(VersionMismatch):
            raw_call(client, msgspec.msgpack.encode([2, p.Op.PING, 999_999, ""]), p.encode(p.Ping()))
        with pytest.raises(FrameTooLarge):
            session.append(token_ids=[70_000] * (2 * 1024 * 1024))
        assert session.info().history_tokens > 0  # still serving
    finally:
        session.close()
    with pytest.raises(SessionNotFound) as err:
        ghost(session).info()
    assert err.value.code == p.ErrorCode.SESSION_NOT_FOUND and isinstance(err.value, KvmuxError)
    with pytest.raises(SessionNotFound):
        session.info()  # closed here: the client knows without asking


def test_cancelled_append(client):
    """CANCEL during a long prefill ends the append with ERROR cancelled."""
    with client.open_session() as session:
        raised: list[BaseException] = []

        def long_append() -> None:
            try:
                session.append(token_ids=list(range(1000, 1600)))
            except KvmuxError as exc:
                raised.append(exc)

        t = threading.Thread(target=long_append)
        t.start()
        time.sleep(0.3)
        session.cancel()
        t.join(60)
        assert raised and isinstance(raised[0], Cancelled), raised
        assert not session.info().busy  # the session answers and is idle again


def test_dead_broker_is_a_timeout(tmp_path):
    started = time.monotonic()
    with Client(f"ipc://{tmp_path}/nobody.ipc", timeout=0.5) as c, pytest.raises(Timeout) as err:
        c.ping()
    assert isinstance(err.value, TimeoutError) and time.monotonic() - started < 5


@pytest.mark.stack
def test_overloaded_worker_lost_and_expired(stack_factory):
    stack = stack_factory(workers=1, slabs=1, broker_args=["--idle-timeout-s", "3"])
    with Client(stack.frontend, timeout=30) as c:
        session = c.open_session()
        stream = session.chat("Tell me a long story.", max_tokens=16, credit=2)  # held by its credit
        next(stream)  # the only slab runs a generation: nothing to hibernate
        with pytest.raises(Overloaded) as err:
            c.open_session(admission="reject")
        assert err.value.reason == p.OverloadReason.NO_SLAB.value
        stack.kill_worker(0)
        killed = time.monotonic()
        with pytest.raises(WorkerLost):
            list(stream)
        assert time.monotonic() - killed < 3 * p.HEARTBEAT_INTERVAL_S + 1.0
        assert session.info().state == "hibernated"  # what completed is kept in the store
        session.close()
        with pytest.raises(SessionNotFound):
            session.client.resume_session(session.id)
        stack.add_worker()
        fresh = c.open_session()
        stream = fresh.chat("Hi.", max_tokens=2)
        assert len(list(stream)) >= 1
        time.sleep(4.5)  # idle past --idle-timeout-s; the broker closes it
        with pytest.raises(SessionExpired):
            fresh.info()
