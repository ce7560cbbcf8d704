"""The sync and asyncio Python clients offer one surface: the same public
methods with the same signatures (coroutines on the asyncio side), and the
same behaviour where no broker answers. No broker, no model."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from kvmux import protocol as p
from kvmux.client import (
    AsyncClient,
    AsyncSession,
    AsyncStream,
    Client,
    InvalidArgument,
    KvmuxError,
    Session,
    SessionNotFound,
    Stream,
    Timeout,
)

# Every documented difference, and only those: iteration, context managers,
# a stream's close (aclose, as for async generators), and how a stream is
# made (by generate(), never by the user).
SYNC_CM, ASYNC_CM = {"__enter__", "__exit__"}, {"__aenter__", "__aexit__"}
DIFFERENCES = {
    (Stream, AsyncStream): (
        {"__iter__", "__next__", "close", "__init__"} | SYNC_CM,
        {"__aiter__", "__anext__", "aclose", "__init__"} | ASYNC_CM,
    ),
    (Session, AsyncSession): (SYNC_CM, ASYNC_CM),
    (Client, AsyncClient): (SYNC_CM, ASYNC_CM),
}
# The asyncio side's plain methods: the rest of it is coroutines.
NOT_COROUTINES = {"chat", "generate", "detach", "__init__", "__aiter__"}
DUNDERS = {"__init__"} | {"__iter__", "__next__", "__aiter__", "__anext__"} | SYNC_CM | ASYNC_CM


def surface(cls) -> dict[str, object]:
    """Public methods and properties, with the protocol dunders."""
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if (not name.startswith("_") or name in DUNDERS) and (callable(member) or isinstance(member, property))
    }


def parameters(method) -> list[tuple]:
    # names, kinds and defaults; annotations differ by design (Stream vs AsyncStream)
    return [(q.name, q.kind, q.default) for q in inspect.signature(method).parameters.values()]


@pytest.mark.parametrize(("sync", "aio"), list(DIFFERENCES))
def test_both_sides_offer_the_same_methods_with_the_same_signatures(sync, aio):
    only_sync, only_aio = DIFFERENCES[(sync, aio)]
    ours, theirs = surface(sync), surface(aio)
    assert only_sync <= set(ours) and only_aio <= set(theirs)
    assert set(ours) - only_sync == set(theirs) - only_aio
    for name in set(ours) - only_sync:
        mine, other = ours[name], theirs[name]
        if isinstance(mine, property) or isinstance(other, property):
            assert isinstance(mine, property) and isinstance(other, property), name
        else:
            assert parameters(mine) == parameters(other), name


@pytest.mark.parametrize(("sync", "aio"), list(DIFFERENCES))
def test_the_asyncio_side_is_coroutines_but_for_the_stream_makers(sync, aio):
    for name, member in surface(sync).items():
        assert not inspect.iscoroutinefunction(member), name
    for name, member in surface(aio).items():
        if not isinstance(member, property):
            assert inspect.iscoroutinefunction(member) == (name not in NOT_COROUTINES), name


# --------------------------------------- the same behaviour, no broker answering

OPENED = p.SessionOpened(session_id="s-1", worker_id="w-1", model="m", sink=4, window=64, slab_bytes=1)


@pytest.fixture
def nobody(tmp_path) -> str:
    return f"ipc://{tmp_path}/nobody.ipc"


def test_a_stream_that_times_out_is_abandoned(nobody):
    with Client(nobody, timeout=0.2) as client:
        stream = Session(client, OPENED).generate(max_tokens=1)
        assert stream.request_id is not None  # generate() sent it
        with pytest.raises(Timeout):
            next(stream)
        assert list(stream) == [] and stream.result is None
        assert not client._calls._queues  # nothing left waiting

    async def main():
        async with AsyncClient(nobody, timeout=0.2) as client:
            stream = AsyncSession(client, OPENED).generate(max_tokens=1)
            assert stream.request_id is None  # goes out on the first __anext__
            with pytest.raises(Timeout):
                await stream.__anext__()
            assert stream.request_id is not None
            assert [c async for c in stream] == [] and stream.result is None
            assert not client._calls._queues

    asyncio.run(main())


def test_a_call_forgets_its_request_however_its_wait_ends(nobody):
    with Client(nobody, timeout=0.2) as client:
        with pytest.raises(Timeout):
            client.ping()
        assert not client._calls._queues

    async def main():
        async with AsyncClient(nobody, timeout=0.2) as client:
            with pytest.raises(Timeout):
                await client.ping()
            task = asyncio.create_task(client.stats(timeout=30))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not client._calls._queues

    asyncio.run(main())


def test_closed_sessions_and_clients_refuse_at_the_same_calls(nobody):
    client = Client(nobody, timeout=0.2)
    session = Session(client, OPENED)
    with pytest.raises(Timeout):
        session.close()  # nobody answers; it is closed here all the same
    with pytest.raises(SessionNotFound):
        session.generate()
    with pytest.raises(SessionNotFound):
        session.chat("Hi.")
    with pytest.raises(SessionNotFound):
        session.append(token_ids=[1])
    assert session.close() is None
    client.close()
    with pytest.raises(KvmuxError, match="client is closed"):
        Session(client, OPENED).generate()

    async def main():
        client = AsyncClient(nobody, timeout=0.2)
        session = AsyncSession(client, OPENED)
        with pytest.raises(Timeout):
            await session.close()
        with pytest.raises(SessionNotFound):
            session.generate()
        with pytest.raises(SessionNotFound):
            session.chat("Hi.")
        with pytest.raises(SessionNotFound):
            await session.append(token_ids=[1])
        assert await session.close() is None
        await client.close()
        with pytest.raises(KvmuxError, match="client is closed"):
            AsyncSession(client, OPENED).generate()

    asyncio.run(main())


@pytest.mark.parametrize("kwargs", [["enable_thinking"], "enable_thinking=false", {1: True}])
def test_chat_template_kwargs_that_are_no_dict_are_refused_before_sending(nobody, kwargs):
    with Client(nobody, timeout=0.2) as client:
        with pytest.raises(InvalidArgument):
            client.open_session(chat_template_kwargs=kwargs)
        assert not client._calls._queues  # nothing was sent

    async def main():
        async with AsyncClient(nobody, timeout=0.2) as client:
            with pytest.raises(InvalidArgument):
                await client.open_session(chat_template_kwargs=kwargs)

    asyncio.run(main())
