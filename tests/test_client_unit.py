"""The Python client's pure parts, no broker: the sync and asyncio surfaces
match, and a stream's state follows the replies (clients/python)."""

from __future__ import annotations

import inspect

import pytest

from kvmux import protocol as p
from kvmux.client import AsyncClient, AsyncSession, AsyncStream, Client, Session, Stream
from kvmux.client import errors as client_errors
from kvmux.client.wire import Reply, StreamState, parse

# Where the two surfaces differ by design: iteration protocols, and the
# context-manager and finalizer hooks each kind of object needs.
SYNC_CM, ASYNC_CM = {"__enter__", "__exit__"}, {"__aenter__", "__aexit__"}
DIFFERENCES = {
    (Stream, AsyncStream): (
        {"__iter__", "__next__", "close"} | SYNC_CM,
        {"__aiter__", "__anext__", "aclose"} | ASYNC_CM,
    ),
    (Session, AsyncSession): (SYNC_CM, ASYNC_CM),
    (Client, AsyncClient): (SYNC_CM, ASYNC_CM),
}


PROTOCOL_METHODS = {
    "__iter__",
    "__next__",
    "__aiter__",
    "__anext__",
    "__enter__",
    "__exit__",
    "__aenter__",
    "__aexit__",
}


def public(cls) -> dict[str, inspect.Signature]:
    out = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name not in PROTOCOL_METHODS:
            continue
        if callable(member):
            out[name] = inspect.signature(member)
        elif isinstance(member, property):
            out[name] = None
    return out


@pytest.mark.parametrize(("sync", "aio"), list(DIFFERENCES))
def test_sync_and_async_offer_the_same_methods_and_signatures(sync, aio):
    only_sync, only_aio = DIFFERENCES[(sync, aio)]
    ours, theirs = public(sync), public(aio)
    assert set(ours) - only_sync == set(theirs) - only_aio
    for name in set(ours) - only_sync:
        mine, other = ours[name], theirs[name]
        if mine is None or other is None:
            assert mine is other, name
            continue
        # the same parameters, names, kinds and defaults (annotations name Async* types)
        assert [(q.name, q.kind, q.default) for q in mine.parameters.values()] == [
            (q.name, q.kind, q.default) for q in other.parameters.values()
        ], name


def test_session_calls_are_coroutines_on_the_async_side_except_the_stream_makers():
    for name in ("append", "cancel", "info", "close"):
        assert inspect.iscoroutinefunction(getattr(AsyncSession, name)), name
    for name in ("chat", "generate"):
        assert not inspect.iscoroutinefunction(getattr(AsyncSession, name)), name
    for name in ("open_session", "resume_session", "list_sessions", "stats", "ping", "drain", "close"):
        assert inspect.iscoroutinefunction(getattr(AsyncClient, name)), name


# ------------------------------------------------------------- stream state


def frame(op: str, body, request_id: int = 5, session_id: str = "s") -> list[bytes]:
    raw = body if isinstance(body, bytes) else p.encode(body)
    return [p.envelope(op, request_id, session_id), raw]


def result(**kw) -> p.GenerateResult:
    return p.GenerateResult(
        **{
            "stop_reason": p.StopReason.EOS,
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "prefill_s": 0.1,
            "decode_s": 0.2,
            "truncated_tokens": 0,
            "history_tokens": 9,
            **kw,
        }
    )


def test_chunks_then_the_result_then_nothing():
    state = StreamState(5, "s", credit=0)
    first = state.take(parse(frame(p.Op.PARTIAL, p.Chunk(token_ids=[1], text="Hi"))))
    assert first.text == "Hi" and not state.done
    assert state.take(parse(frame(p.Op.FINAL, result()))) is None
    assert state.done and state.result.stop_reason is p.StopReason.EOS


def test_an_error_ends_the_stream_with_its_typed_exception():
    state = StreamState(5, "s", credit=0)
    with pytest.raises(client_errors.WorkerLost) as exc:
        state.take(parse(frame(p.Op.ERROR, p.error_body(p.ErrorCode.WORKER_LOST, "gone"))))
    assert state.done and exc.value.request_id == 5 and exc.value.session_id == "s"


def test_an_unexpected_reply_in_a_stream_is_internal():
    state = StreamState(5, "s", credit=0)
    with pytest.raises(client_errors.Internal):
        state.take(parse(frame(p.Op.FINAL, p.Ack())))


def test_credit_is_granted_back_at_half_the_window():
    state = StreamState(5, "s", credit=4)
    grants = []
    for i in range(5):
        state.take(parse(frame(p.Op.PARTIAL, p.Chunk(token_ids=[i], text=str(i)))))
        grants.append(state.grant())
    assert grants == [0, 2, 0, 2, 0]
    env, body = state.credit_frames(2, request_id=77)
    assert p.decode_envelope(env) == p.Envelope(1, p.Op.CREDIT, 77, "s")
    assert p.decode_body(p.Op.CREDIT, body) == p.Credit(request_id=5, n=2)
    assert StreamState(5, "s", credit=0).grant() == 0  # no flow control, no grants


def test_cancel_names_the_stream_request():
    state = StreamState(5, "s", credit=0)
    env, body = state.cancel_frames(request_id=9)
    assert state.cancel_sent
    assert p.decode_envelope(env) == p.Envelope(1, p.Op.CANCEL, 9, "s")
    assert p.decode_body(p.Op.CANCEL, body) == p.Cancel(request_id=5)


def test_unreadable_replies_are_dropped_or_typed():
    assert parse([b"only one part"]) is None
    assert parse([b"\xc1", b""]) is None  # not an envelope
    reply = parse([p.envelope(p.Op.FINAL, 3, "s"), b"\xc1"])
    assert isinstance(reply, Reply) and isinstance(reply.body, client_errors.MalformedFrame)
