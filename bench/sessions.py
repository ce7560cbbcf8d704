"""`kvmux bench sessions`: many more sessions than slabs.

- hibernating: N sessions on one worker with S slabs take T turns each,
  round robin, so nearly every turn first restores its session from the
  store (and hibernates another). Per-turn latency p50/p99, split into the
  restore (the worker's own timing) and the rest.
- resident: the same N x T turns on a daemon with N slabs: the baseline.
- restore vs re-prefill: one session with a full default window (sink +
  window tokens of history) is hibernated and restored; its restore time is
  compared with prefilling the same tokens again (what a runtime without
  a store pays), A B A B in one run, median with min and max.
- bytes on disk per session (the record and the slab snapshot).
- crash recovery: the daemon's worker is SIGKILLed between two turns of a
  session, a fresh daemon for each kill (a first crash, not a crash loop);
  the time from the kill to the next turn served (the restart's backoff, the
  model load, the restore), and whether that turn equals a control
  session's.
- migration: two workers of one slab each; a session live on one is
  hibernated and its next turn restored on the other: restore time and
  the turn's latency.

Every phase runs once per session store (`--stores local,redis`): the
state dir's directory, and a private redis-server (bench/redis_server.py)
that every worker shares. Hibernations are timed from the workers' own
HIBERNATED answers, as the broker logs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from kvmux.client import Client, KvmuxError

from . import spawn
from .redis_server import redis_server
from .report import latency_summary, machine, now_iso, write_json_atomic

STORES = ("local", "redis")

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs each evening, trimmed the wick, polished the lens and "
    "wrote the weather in a ledger that no one else would ever read. "
)


def round_robin(frontend: str, sessions: int, turns: int, max_tokens: int, label: str) -> dict:
    turn_ms, restore_ms = [], []
    with Client(frontend, timeout=600) as client:
        opened = [client.open_session(system="Be brief.") for _ in range(sessions)]
        restores = {s.id: 0 for s in opened}
        for turn in tqdm(range(turns), desc=label, unit="round"):
            for i, session in enumerate(opened):
                start = time.perf_counter()
                stream = session.chat(f"Round {turn}: name thing number {i}.", max_tokens=max_tokens)
                for _ in stream:
                    pass
                total = 1000 * (time.perf_counter() - start)
                info = session.info()
                restored = 1000 * info.last_restore_s if info.restores > restores[session.id] else 0.0
                restores[session.id] = info.restores
                turn_ms.append(total)
                restore_ms.append(restored)
        stats = client.stats()
        for session in opened:
            session.close()
    return {
        "turn": latency_summary(turn_ms),
        "restore": latency_summary(restored) if (restored := [r for r in restore_ms if r > 0]) else None,
        "turn_without_restore": latency_summary([t - r for t, r in zip(turn_ms, restore_ms, strict=True)]),
        "turns_restored": sum(1 for r in restore_ms if r > 0),
        "hibernations": stats.hibernations,
        "restores": stats.restores,
        "store_bytes_per_session": stats.store_bytes / max(1, stats.sessions),
    }


def restore_vs_prefill(frontend: str, tokens: int, repeats: int) -> dict:
    """Restore seconds of a session holding `tokens` of history, vs
    prefilling those tokens again, alternated in one run."""
    text = PASSAGE * (tokens // 25 + 1)  # ~30 tokens a passage: past the window, so the slab is full
    with Client(frontend, timeout=900) as client:
        prefill_s, restore_s, bytes_on_disk, history = [], [], 0, 0
        for _ in tqdm(range(repeats), desc="restore vs prefill", unit="pair"):
            held = client.open_session()
            appended = held.append([{"role": "user", "content": text}])
            history = appended.history_tokens
            prefill_s.append(appended.prefill_s)
            other = client.open_session()  # the only slab: `held` hibernates
            info = held.info()
            assert info.state == "hibernated", info
            held.append(token_ids=[198])  # restores it
            info = held.info()
            restore_s.append(info.last_restore_s)
            listing = {s.session_id: s for s in client.list_sessions()}
            bytes_on_disk = listing[held.id].bytes_on_disk
            other.close()
            held.close()
    ratio = [r / p for r, p in zip(restore_s, prefill_s, strict=True)]
    return {
        "history_tokens": history,
        "prefill_s": _spread(prefill_s),
        "restore_s": _spread(restore_s),
        "restore_over_prefill": _spread(ratio),
        "bytes_on_disk": bytes_on_disk,
    }


def migration(frontend: str, repeats: int) -> dict:
    """A session moved between two one-slab workers: opened and used on one,
    hibernated for another session, restored on the other (its only free
    slab) by its next turn."""
    restore_s, turn_s, moved = [], [], 0
    with Client(frontend, timeout=600) as client:
        for _ in tqdm(range(repeats), desc="migration", unit="move"):
            session = client.open_session(system="Be brief.")
            _reply(session, "Name a fruit.")
            elsewhere = client.open_session()  # the other worker's slab
            pusher = client.open_session()  # no slab free: `session`, idle longest, hibernates
            elsewhere.close()  # now the only free slab is on the other worker
            start = time.perf_counter()
            _reply(session, "Name a colour.")
            turn_s.append(time.perf_counter() - start)
            info = session.info()
            restore_s.append(info.last_restore_s)
            moved += info.worker_id != session.opened.worker_id
            pusher.close()
            session.close()
    return {"restore_s": _spread(restore_s), "turn_s": _spread(turn_s), "moved": moved, "n": repeats}


def hibernations(log: Path) -> dict | None:
    """Seconds and bytes of the hibernations in a daemon's log."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        if '"session_hibernated"' in line and '"bytes"' in line:
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    if not events:
        return None
    seconds = [e["seconds"] for e in events]
    return {"seconds": latency_summary([1000 * s for s in seconds]), "bytes": _spread([e["bytes"] for e in events])}


@contextlib.contextmanager
def store_args(store: str) -> Iterator[tuple[str, ...]]:
    """`kvmux serve` options for a session store of that kind."""
    if store == "local":
        yield ()
        return
    with redis_server() as server:
        yield ("--store", server.url)


def crash_recovery(repeats: int) -> dict:
    """Seconds from SIGKILL of the worker to the session's next turn served.
    Each kill is on a daemon of its own: kills in a row on one daemon would
    measure the crash-loop backoff (doubling with each crash in 5 minutes)."""
    seconds, identical = [], []
    for _ in tqdm(range(repeats), desc="crash recovery", unit="kill"):
        with spawn.serve(slabs=2) as frontend, Client(frontend, timeout=300) as client:
            session = client.open_session(system="Be brief.")
            first = _reply(session, "Name a fruit.")
            pid = client.stats().workers[0].pid
            killed = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            second = _reply_when_served(session, "Name a colour.")
            seconds.append(time.perf_counter() - killed)
            control = client.open_session(system="Be brief.")
            identical.append(_reply(control, "Name a fruit.") == first and _reply(control, "Name a colour.") == second)
            control.close()
            session.close()
    return {"kill_to_next_turn_s": _spread(seconds), "identical": all(identical)}


def _reply(session, text: str) -> list[int]:
    return [t for chunk in session.chat(text, max_tokens=8) for t in chunk.token_ids]


def _reply_when_served(session, text: str) -> list[int]:
    """The reply as soon as a worker serves it (retrying while none is up)."""
    while True:
        try:
            return _reply(session, text)
        except KvmuxError:
            time.sleep(0.05)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run(
    output: Path,
    *,
    sessions: int,
    slabs: int,
    turns: int,
    max_tokens: int,
    repeats: int,
    phases: tuple[str, ...],
    stores: tuple[str, ...] = STORES,
) -> dict:
    doc = {
        "bench": "sessions",
        "created": now_iso(),
        "machine": machine(),
        "config": {
            "sessions": sessions,
            "slabs": slabs,
            "turns": turns,
            "max_tokens": max_tokens,
            "repeats": repeats,
            "window": "serve default (2048 + sink 4)",
            "phases": list(phases),
            "stores": list(stores),
            "redis": "redis-server on loopback, appendonly yes, appendfsync always",
        },
        "stores": {},
    }
    measures = (
        (
            "hibernating",
            1,
            slabs,
            lambda f: round_robin(f, sessions, turns, max_tokens, f"{sessions} sessions / {slabs} slabs"),
        ),
        (
            "resident",
            1,
            sessions,
            lambda f: round_robin(f, sessions, turns, max_tokens, f"{sessions} sessions resident"),
        ),
        ("restore_vs_prefill", 1, 1, lambda f: restore_vs_prefill(f, 2052, repeats)),
        ("migration", 2, 1, lambda f: migration(f, repeats)),
    )
    for store in stores:
        results = doc["stores"][store] = {}
        for name, workers, phase_slabs, measure in measures:
            if name not in phases:
                continue
            with store_args(store) as args, spawn.daemon(workers=workers, slabs=phase_slabs, serve_args=args) as d:
                results[name] = measure(d.frontend)
                results[name]["hibernate_ms"] = hibernations(d.log)
            write_json_atomic(output, doc)  # a phase's figures survive a later one's failure
    if "crash_recovery" in phases:
        doc["crash_recovery"] = crash_recovery(repeats)
        write_json_atomic(output, doc)
    return doc
