"""The asyncio client (AsyncClient) against the real stack."""

from __future__ import annotations

import asyncio

import pytest

from kvmux import protocol as p
from kvmux.client import AsyncClient, Busy, InvalidArgument, SessionNotFound, Timeout
from kvmux.client.aio import AsyncSession


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_multi_turn_chat_and_info(shared_stack):
    async def main():
        async with AsyncClient(shared_stack.frontend, timeout=60) as client:
            assert isinstance(await client.ping(), p.Pong)
            async with await client.open_session(system="You are terse.", max_tokens=6) as session:
                results = []
                for text in ("Name a fruit.", "And a vegetable?"):
                    stream = session.chat(text)
                    chunks = [c async for c in stream]
                    assert chunks and stream.result.completion_tokens == sum(len(c.token_ids) for c in chunks) <= 6
                    results.append(stream.result)
                assert 0 < results[1].prompt_tokens < results[0].history_tokens
                info = await session.info()
                assert info.history_tokens == results[1].history_tokens
                stats = await client.stats()
                assert stats.sessions >= 1 and stats.workers

    run(main())


def test_break_and_task_cancellation_cancel_the_generation(shared_stack):
    async def main():
        async with AsyncClient(shared_stack.frontend, timeout=60) as client:
            session = await client.open_session()
            # A token per pass (no speculative bursts), so the generation is still
            # running when the cancel lands.
            stream = session.chat("Write a long poem about rivers.", max_tokens=64, speculative="off")
            async for _ in stream:
                break
            await stream.aclose()
            assert stream.result.stop_reason == "cancelled"

            got = asyncio.Event()

            async def consume():
                # One chunk of credit: the worker sends the next only after this
                # task has read one, so the task waits on the stream when the
                # cancel lands. With more, a test process starved of the CPU
                # found the whole reply queued and finished before the cancel.
                async for _ in session.chat("Another long poem, please.", max_tokens=64, speculative="off", credit=1):
                    got.set()

            task = asyncio.create_task(consume())
            await got.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the cancelled stream is drained before the next turn runs
            stream = session.chat("Thanks.", max_tokens=2)
            assert [c async for c in stream] and stream.result.stop_reason in ("eos", "max_tokens")
            await session.close()

    run(main())


def test_concurrent_sessions_from_one_client(shared_stack):
    async def main():
        async with AsyncClient(shared_stack.frontend, timeout=60) as client:

            async def turn(i: int) -> p.GenerateResult:
                async with await client.open_session() as session:
                    stream = session.chat(f"Say the number {i}.", max_tokens=3)
                    async for _ in stream:
                        pass
                    return stream.result

            results = await asyncio.gather(*(turn(i) for i in range(3)))
            assert all(r.completion_tokens >= 1 for r in results)

    run(main())


def test_errors(shared_stack, tmp_path):
    async def main():
        async with AsyncClient(shared_stack.frontend, timeout=60) as client:
            with pytest.raises(InvalidArgument):
                await client.open_session(sink=-1)
            session = await client.open_session()
            # credit holds the generation in flight however fast the worker decodes
            stream = session.chat("Describe a mountain.", max_tokens=64, credit=2)
            await stream.__anext__()
            with pytest.raises(Busy):
                await AsyncSession(client, session.opened).append(token_ids=[28])
            await stream.aclose()
            await session.close()
            with pytest.raises(SessionNotFound):
                await AsyncSession(client, session.opened).info()
        async with AsyncClient(f"ipc://{tmp_path}/nobody.ipc", timeout=0.3) as dead:
            with pytest.raises(Timeout):
                await dead.stats()

    run(main())
