"""A generate stream on the client side, from real reply frames: the pure
stream state (clients/python/wire.py), the request table that routes the
frames, and the reader both shells run (clients/python/core.py). No broker,
no model."""

from __future__ import annotations

import asyncio
import queue

import pytest

from kvmux import protocol as p
from kvmux.client import AsyncClient, Client
from kvmux.client import errors as client_errors
from kvmux.client.calls import Calls
from kvmux.client.core import StreamReader
from kvmux.client.wire import Reply, StreamState, parse


def frame(op: str, body, request_id: int = 5, session_id: str = "s") -> list[bytes]:
    return [p.envelope(op, request_id, session_id), p.encode(body)]


def chunk(text: str) -> p.Chunk:
    return p.Chunk(token_ids=[len(text)], text=text)


def result() -> p.GenerateResult:
    return p.GenerateResult(
        stop_reason=p.StopReason.EOS,
        prompt_tokens=3,
        completion_tokens=2,
        prefill_s=0.1,
        decode_s=0.2,
        truncated_tokens=0,
        history_tokens=9,
    )


def take(state: StreamState, op: str, body) -> p.Chunk | None:
    return state.take(parse(frame(op, body)))


# ------------------------------------------------------------- stream state


def test_chunks_then_the_result_then_done():
    state = StreamState(5, "s", credit=0)
    assert take(state, p.Op.PARTIAL, chunk("Hi")).text == "Hi" and not state.done
    assert take(state, p.Op.PARTIAL, chunk(" there")).text == " there" and not state.done
    assert take(state, p.Op.FINAL, result()) is None
    assert state.done and state.result == result()


def test_an_error_ends_the_stream_with_its_typed_exception():
    state = StreamState(5, "s", credit=0)
    take(state, p.Op.PARTIAL, chunk("Hi"))
    with pytest.raises(client_errors.WorkerLost) as exc:
        take(state, p.Op.ERROR, p.Error(code=p.ErrorCode.WORKER_LOST, message="gone"))
    assert state.done and state.result is None
    assert exc.value.request_id == 5 and exc.value.session_id == "s" and exc.value.message == "gone"


def test_an_unexpected_reply_in_a_stream_is_internal():
    state = StreamState(5, "s", credit=0)
    with pytest.raises(client_errors.Internal):
        take(state, p.Op.FINAL, p.Ack())
    assert state.done


def test_credit_is_granted_back_at_half_the_credit():
    state = StreamState(5, "s", credit=4)
    grants = []
    for i in range(5):
        take(state, p.Op.PARTIAL, chunk(str(i)))
        grants.append(state.grant())
    assert grants == [0, 2, 0, 2, 0]
    take(state, p.Op.FINAL, result())
    assert state.grant() == 0  # nothing to grant once it is done
    one = StreamState(5, "s", credit=1)
    take(one, p.Op.PARTIAL, chunk("a"))
    assert one.grant() == 1  # never less than a chunk at a time
    off = StreamState(5, "s", credit=0)
    take(off, p.Op.PARTIAL, chunk("a"))
    assert off.grant() == 0  # no flow control, no grants


def test_credit_and_cancel_frames_name_the_stream_request():
    state = StreamState(5, "s", credit=4)
    env, body = state.credit_frames(2, request_id=77)
    assert p.decode_envelope(env) == p.Envelope(p.PROTOCOL_VERSION, p.Op.CREDIT, 77, "s")
    assert p.decode_body(p.Op.CREDIT, body) == p.Credit(request_id=5, n=2)
    assert not state.cancel_sent
    env, body = state.cancel_frames(request_id=9)
    assert state.cancel_sent
    assert p.decode_envelope(env) == p.Envelope(p.PROTOCOL_VERSION, p.Op.CANCEL, 9, "s")
    assert p.decode_body(p.Op.CANCEL, body) == p.Cancel(request_id=5)


def test_unreadable_replies_are_dropped_or_typed():
    assert parse([b"only one part"]) is None
    assert parse([b"\xc1", b""]) is None  # not an envelope
    reply = parse([p.envelope(p.Op.FINAL, 3, "s"), b"\xc1"])
    assert isinstance(reply, Reply) and isinstance(reply.body, client_errors.MalformedFrame)


# ------------------------------------------------------------ request table


def test_replies_go_to_their_request_and_the_last_one_forgets_it():
    calls = Calls()
    a, b = queue.SimpleQueue(), queue.SimpleQueue()
    ra, rb = calls.next_id(), calls.next_id()
    calls.add(ra, a)
    calls.add(rb, b)
    calls.deliver(frame(p.Op.PARTIAL, chunk("b"), request_id=rb))
    calls.deliver(frame(p.Op.FINAL, result(), request_id=ra))
    calls.deliver(frame(p.Op.FINAL, result(), request_id=ra))  # its request is gone: dropped
    calls.deliver(frame(p.Op.ERROR, p.Error(code=p.ErrorCode.BUSY, message="busy"), request_id=rb))
    calls.deliver([b"unreadable"])
    assert [a.get_nowait().body for _ in range(a.qsize())] == [result()]
    assert [r.body for r in (b.get_nowait(), b.get_nowait())] == [
        chunk("b"),
        p.Error(code=p.ErrorCode.BUSY, message="busy"),
    ]
    assert calls.pop(ra) is None and calls.pop(rb) is None  # FINAL and ERROR forgot them


# ------------------------------------------------- the reader, in both shells

STREAM = [
    frame(p.Op.PARTIAL, chunk("a"), request_id=7),
    frame(p.Op.PARTIAL, chunk("b"), request_id=7),
    frame(p.Op.FINAL, result(), request_id=7),
]


def reader_for(client) -> StreamReader:
    """A reader for request 7 with its frames already delivered."""
    reader = StreamReader(client, 7, "s", 0, client._queue_class(), None)
    client._calls.add(7, reader.replies)
    for parts in STREAM:
        client._calls.deliver(parts)
    return reader


def test_both_shells_read_a_stream_alike(tmp_path):
    endpoint = f"ipc://{tmp_path}/nobody.ipc"
    with Client(endpoint, timeout=1) as client:
        reader = reader_for(client)
        sync = [client._run(reader.next()) for _ in range(4)]
        client._run(reader.drain())  # a finished stream: nothing to cancel
        assert reader.state.result == result() and not reader.state.cancel_sent and not client._calls._queues

    async def main():
        async with AsyncClient(endpoint, timeout=1) as client:
            reader = reader_for(client)
            got = [await client._run(reader.next()) for _ in range(4)]
            await client._run(reader.drain())
            assert reader.state.result == result() and not reader.state.cancel_sent and not client._calls._queues
            return got

    aio = asyncio.run(main())
    assert [c and c.text for c in sync] == [c and c.text for c in aio] == ["a", "b", None, None]
