"""The soak summary: what a report's per-turn records say about the two claims
(turns stay equally fast, memory stays flat), with the pass/fail verdicts.

A turn record is a dict with at least: session, turn (1-based), latency_s,
prefill_s, kv_live_bytes, truncated_tokens, slab_bytes, rss_bytes (None when
the worker's /proc is not readable), worker_pid and error (None when the turn
succeeded). A KV series that is zero or constant cannot show a bounded window
(it shows a number that is not measured), so it raises `SeriesError` rather
than passing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .report import percentile

PREFILL_DRIFT_MAX = 1.10
KV_SPREAD_MAX = 1.01
RSS_GROWTH_MAX = 1.05


class SeriesError(ValueError):
    """The records cannot support a verdict (no turns, or a zero or constant KV series)."""


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def check_kv_series(ok: list[dict]) -> None:
    if not ok:
        raise SeriesError("no successful turn: nothing to summarize")
    zero = [r["turn"] for r in ok if not r["kv_live_bytes"]]
    if zero:
        raise SeriesError(f"kv_live_bytes is zero at turns {zero[:5]}: the cache is not measured")
    by_session: dict[Any, list[int]] = defaultdict(list)
    for r in ok:
        by_session[r["session"]].append(r["kv_live_bytes"])
    for session, series in by_session.items():
        if len(series) < 2:
            raise SeriesError(f"session {session} has {len(series)} turn: a KV series needs at least 2")
        if len(set(series)) == 1:
            raise SeriesError(
                f"kv_live_bytes of session {session} is constant ({series[0]}) over {len(series)} turns: "
                "it never grew while the window filled, so it is not measured from the cache"
            )


def summarize(turns: list[dict]) -> dict:
    """Summary block of a soak report (see module docstring); raises SeriesError."""
    ok = sorted((r for r in turns if not r.get("error")), key=lambda r: (r["turn"], str(r["session"])))
    check_kv_series(ok)

    decile = max(1, len(ok) // 10)
    prefill_first = percentile((r["prefill_s"] for r in ok[:decile]), 50)
    prefill_last = percentile((r["prefill_s"] for r in ok[-decile:]), 50)
    drift = _ratio(prefill_last, prefill_first)

    kv = [r["kv_live_bytes"] for r in ok]
    capacity = min(r["slab_bytes"] for r in ok)
    filled = [r for r in ok if r["truncated_tokens"] > 0]
    # The slab is full once its arrays hold every slot it has: the window's,
    # and the spare ones a verify pass writes its drafts into, which fill
    # after the window starts dropping tokens. From then on the bytes must
    # stay flat. A run whose slab never filled cannot show that.
    full = next((r["turn"] for r in ok if r["kv_live_bytes"] >= capacity), None)
    after_fill = [r for r in ok if r["turn"] >= full] if full is not None else ok
    kv_after = [r["kv_live_bytes"] for r in after_fill]
    spread = max(kv_after) / min(kv_after)

    # RSS per worker process, from the first turn after the fill on.
    rss_by_pid: dict[Any, list[int]] = defaultdict(list)
    for r in after_fill:
        if r.get("rss_bytes"):
            rss_by_pid[r.get("worker_pid")].append(r["rss_bytes"])
    rss_growth = max((max(s) / s[0] for s in rss_by_pid.values()), default=None)

    latencies = [r["latency_s"] for r in ok]
    return {
        "turns": len(turns),
        "errors": len(turns) - len(ok),
        "sessions": len({r["session"] for r in turns}),
        "latency_p50_s": percentile(latencies, 50),
        "latency_p95_s": percentile(latencies, 95),
        "prefill_s_first_decile_p50": prefill_first,
        "prefill_s_last_decile_p50": prefill_last,
        "prefill_drift_ratio": drift,
        "prefill_tokens_p50": percentile((r["prompt_tokens"] for r in ok), 50),
        "decode_tokens_per_s_p50": percentile(
            (r["completion_tokens"] / r["decode_s"] for r in ok if r["decode_s"] > 0), 50
        ),
        "history_tokens_max": max(r["history_tokens"] for r in ok),
        "truncated_tokens_max": max(r["truncated_tokens"] for r in ok),
        "window_filled_at_turn": filled[0]["turn"] if filled else None,
        "slab_full_at_turn": full,
        "kv_live_bytes_min": min(kv),
        "kv_live_bytes_max": max(kv),
        "kv_bytes_after_fill_spread": spread if full is not None else None,
        "slab_bytes": capacity,
        "rss_bytes_first": next(iter(rss_by_pid.values()))[0] if rss_by_pid else None,
        "rss_bytes_max": max((max(s) for s in rss_by_pid.values()), default=None),
        "rss_growth_ratio": rss_growth,
        "prefill_bounded": drift is not None and drift <= PREFILL_DRIFT_MAX,
        "kv_bounded": full is not None and spread <= KV_SPREAD_MAX and max(kv) <= capacity,
        "rss_bounded": None if rss_growth is None else rss_growth <= RSS_GROWTH_MAX,
    }


def verdicts_pass(summary: dict) -> bool:
    return bool(summary["prefill_bounded"] and summary["kv_bounded"] and summary["rss_bounded"] is not False)
