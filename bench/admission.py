"""`kvmux bench admission`: what admission costs a client.

- free: round trip of an `open` while slabs are free (then closed again).
- queued: every slab held, an `open` waits in the queue; measured from the
  moment a holder's `close` is sent to the queued open's answer (the broker
  admits it on the worker's Closed, then the worker opens it).
- load: `clients` clients open at once against the daemon's queue, each chats
  a few tokens and closes; then the broker's stats.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgspec

from kvmux.client import Client

from . import spawn
from .report import latency_summary, machine, now_iso, write_json_atomic


def free_opens(client: Client, rounds: int) -> list[float]:
    """Milliseconds per open while slabs are free."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        session = client.open_session()
        times.append(1000 * (time.perf_counter() - start))
        session.close()
    return times


def queued_opens(client: Client, slabs: int, rounds: int) -> list[float]:
    """Milliseconds from a holder's close to the queued open's answer."""
    held = [client.open_session() for _ in range(slabs)]
    times = []
    for _ in range(rounds):
        opened: list = []
        waiter = threading.Thread(
            target=lambda opened=opened: opened.append((client.open_session(), time.perf_counter()))
        )
        waiter.start()
        time.sleep(0.3)  # the open is queued by now
        released = time.perf_counter()
        held.pop(0).close()
        waiter.join()
        session, answered = opened[0]
        times.append(1000 * (answered - released))
        held.append(session)
    for session in held:
        session.close()
    return times


def load(frontend: str, clients: int, max_tokens: int) -> dict:
    tokens: dict[int, int] = {}

    def one(i: int) -> None:
        with Client(frontend, timeout=300) as client, client.open_session() as session:
            stream = session.chat(f"Say hello to client {i}.", max_tokens=max_tokens)
            tokens[i] = sum(len(c.token_ids) for c in stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"clients": clients, "completed": len(tokens), "tokens": sum(tokens.values())}


def run(output: Path, *, workers: int, slabs: int, rounds: int, clients: int, max_tokens: int) -> dict:
    serve_args = ("--admission", "queue", "--queue-depth", str(clients), "--queue-wait-s", "300")
    with (
        spawn.serve(workers=workers, slabs=slabs, serve_args=serve_args) as frontend,
        Client(frontend, timeout=300) as client,
    ):
        free = free_opens(client, rounds)
        queued = queued_opens(client, workers * slabs, rounds)
        loaded = load(frontend, clients, max_tokens)
        stats = msgspec.to_builtins(client.stats())
    doc = {
        "bench": "admission",
        "created": now_iso(),
        "machine": machine(),
        "config": {"workers": workers, "slabs": slabs, "rounds": rounds, "clients": clients, "max_tokens": max_tokens},
        "open_free": latency_summary(free),
        "open_queued_after_release": latency_summary(queued),
        "load": loaded,
        "stats_after_load": stats,
    }
    write_json_atomic(output, doc)
    return doc
