"""Three concurrent sessions on one asyncio client, one cancelled mid-reply.

kvmux serve --slabs 4 &
python clients/python/examples/async_chat.py [ENDPOINT]
"""

import asyncio
import sys

from kvmux.client import AsyncClient


async def ask(client: AsyncClient, question: str) -> str:
    async with await client.open_session(max_tokens=24) as session:
        text = "".join([chunk.text async for chunk in session.chat(question)])
        return f"{question} -> {text.strip()!r}"


async def main(endpoint: str | None) -> None:
    async with AsyncClient(endpoint, timeout=60) as client:
        questions = ["Name a planet.", "Name a metal.", "Name a river."]
        for line in await asyncio.gather(*(ask(client, q) for q in questions)):
            print(line)
        # Cancelling the task that reads a stream cancels the generation.
        session = await client.open_session()
        task = asyncio.create_task(ask_forever(session))
        await asyncio.sleep(1.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        stream = session.chat("Say OK.", max_tokens=4)  # the session carries on
        print("after cancel:", "".join([c.text async for c in stream]).strip(), stream.result.stop_reason)
        print(await client.stats())


async def ask_forever(session) -> None:
    async for chunk in session.chat("Tell me a very long story.", max_tokens=256):
        print(chunk.text, end="", flush=True)


asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else None))
