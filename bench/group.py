"""`kvmux bench group`: a worker group (`kvmux serve --pipeline N`: one
worker made of N processes, each holding a range of the model's layers)
against a single-process worker, side by side. Two daemons at their
default settings run at once; blocks alternate between them (A B A B), so
a busy moment of the shared machine hits both.

Per block, `n` sessions (1, then 8) decode at once from the same prompt:
generated tokens/s over all of them, and the per-token latency (each
stream's median gap between tokens, the median over streams). For the
group, the bytes its rank 0 sent to and received from the other ranks per
generated token (WorkerStats.link_bytes, read once a heartbeat has carried
the block's last count). The report gives the group/one-process ratios of
tokens/s and latency, and each worker process's resident memory at the end.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from kvmux.client import Client
from kvmux.protocol import HEARTBEAT_INTERVAL_S

from . import spawn
from .perf import PLAIN, STORY, at_once
from .report import machine, now_iso, ratio_summary, rss_kb, write_json_atomic


@dataclass
class GroupConfig:
    ranks: int = 2
    sessions: tuple[int, ...] = (1, 8)
    tokens: int = 32  # per session and block
    blocks: int = 3
    slabs: int = 8  # each worker's: the most sessions run at once


def _block(client: Client, n: int, tokens: int, group: bool = False) -> dict:
    """`n` sessions decoding at once: tokens/s over all, per-token latency,
    and for a `group` the bytes between its ranks per generated token."""
    sessions = [client.open_session() for _ in range(n)]
    for session in sessions:  # prefill outside the clock (and outside the group's count)
        session.append([{"role": "user", "content": STORY}])
    before = _link_bytes(client) if group else 0
    gaps: list[float] = [0.0] * n
    counts = [0] * n

    def run(i: int) -> None:
        stamps = []
        stream = sessions[i].generate(max_tokens=tokens, temperature=0, speculative=PLAIN)
        for chunk in stream:
            stamps.extend([time.perf_counter()] * len(chunk.token_ids))
        counts[i] = stream.result.completion_tokens
        gaps[i] = statistics.median(b - a for a, b in itertools.pairwise(stamps) if b > a)

    elapsed = at_once(n, run)
    out = {"tokens": sum(counts), "tokens_per_s": sum(counts) / elapsed, "token_ms": 1000 * statistics.median(gaps)}
    if group:
        out["link_bytes_per_token"] = round((_link_bytes(client) - before) / sum(counts))
    for session in sessions:
        session.close()
    return out


def _link_bytes(client: Client) -> int:
    """The group's count, once a heartbeat has carried its latest value."""
    time.sleep(2 * HEARTBEAT_INTERVAL_S)
    return client.stats().workers[0].link_bytes


def _workers_rss_mb(broker_pid: int) -> list[float]:
    """The resident memory of each of a daemon's worker processes."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == broker_pid:
            out.append(round(rss_kb(int(stat.parent.name)) / 1024, 1))
    return sorted(out, reverse=True)


def run(cfg: GroupConfig, output: Path) -> dict:
    doc = {"bench": "group", "created": now_iso(), "machine": machine(), "config": asdict(cfg)}
    pipeline = ("--pipeline", str(cfg.ranks))
    with (
        spawn.daemon(slabs=cfg.slabs) as one_daemon,
        spawn.daemon(slabs=cfg.slabs, serve_args=pipeline) as group_daemon,
        Client(one_daemon.frontend, timeout=600) as one,
        Client(group_daemon.frontend, timeout=600) as group,
    ):
        layout = group.stats().workers[0].compute.layout
        _block(one, 1, 4), _block(group, 1, 4)  # warm both
        results = {}
        for n in cfg.sessions:
            blocks = []
            for _ in tqdm(range(cfg.blocks), desc=f"{n} sessions: group vs one process", unit="block"):
                alone, grouped = _block(one, n, cfg.tokens), _block(group, n, cfg.tokens, group=True)
                blocks.append({"one": alone, "group": grouped})
            results[str(n)] = {
                "tokens_per_s": ratio_summary([(b["one"]["tokens_per_s"], b["group"]["tokens_per_s"]) for b in blocks]),
                "token_ms": ratio_summary([(b["one"]["token_ms"], b["group"]["token_ms"]) for b in blocks]),
                "link_bytes_per_token": statistics.median(b["group"]["link_bytes_per_token"] for b in blocks),
                "blocks": blocks,
            }
        # After the 8-session phase: every slab has held a session.
        doc["rss_mb"] = {"one": _workers_rss_mb(one_daemon.pid), "group": _workers_rss_mb(group_daemon.pid)}
    doc["layout"] = layout
    doc["results"] = results
    doc["summary"] = {
        n: {
            "tokens_per_s_group_over_one": r["tokens_per_s"]["median"],
            "token_ms_group_over_one": r["token_ms"]["median"],
            "link_bytes_per_token": r["link_bytes_per_token"],
        }
        for n, r in results.items()
    }
    write_json_atomic(output, doc)
    return doc
