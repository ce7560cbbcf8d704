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
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from kvmux.client import Client, KvmuxError

from . import spawn
from .report import latency_summary, machine, now_iso, write_json_atomic

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
    output: Path, *, sessions: int, slabs: int, turns: int, max_tokens: int, repeats: int, phases: tuple[str, ...]
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
        },
    }
    measures = (
        (
            "hibernating",
            slabs,
            lambda f: round_robin(f, sessions, turns, max_tokens, f"{sessions} sessions / {slabs} slabs"),
        ),
        ("resident", sessions, lambda f: round_robin(f, sessions, turns, max_tokens, f"{sessions} sessions resident")),
        ("restore_vs_prefill", 1, lambda f: restore_vs_prefill(f, 2052, repeats)),
    )
    for name, phase_slabs, measure in measures:
        if name not in phases:
            continue
        with spawn.serve(slabs=phase_slabs) as frontend:
            doc[name] = measure(frontend)
        write_json_atomic(output, doc)  # a phase's figures survive a later one's failure
    if "crash_recovery" in phases:
        doc["crash_recovery"] = crash_recovery(repeats)
        write_json_atomic(output, doc)
    return doc
