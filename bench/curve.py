"""`kvmux bench curve`: what CURVE costs a round trip. Two daemons side by
side on tcp loopback, one plain and one with CURVE on both its endpoints
(`--curve-secret`, `--client-keys`; its local worker gets its own key), each
with one worker and one session. Blocks of round trips alternate between
them (A B A B), so a busy moment of the shared machine hits both:

- ping: the broker answers itself (one CURVE hop each way);
- info: the broker forwards to the worker and back (two CURVE hops).

The report gives p50/p99 per path and transport (medians over the blocks),
and the CURVE/plain ratios.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from kvmux import keys

from . import roundtrip, spawn
from .report import machine, now_iso, write_json_atomic


def run(output: Path, *, n: int, blocks: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvc-"))
    keys.new("server", tmp)
    keys.new("bench", tmp / "clients")
    curve = (str(tmp / "server.key"), str(tmp / "clients" / "bench.key_secret"))
    secured = ("--curve-secret", str(tmp / "server.key_secret"), "--client-keys", str(tmp / "clients"))
    doc = {"bench": "curve", "created": now_iso(), "machine": machine(), "config": {"n": n, "blocks": blocks}}
    samples: dict[str, dict[str, list[dict]]] = {"plain": {"ping": [], "info": []}, "curve": {"ping": [], "info": []}}
    with (
        spawn.serve(workers=1, slabs=1, transport="tcp") as plain_endpoint,
        spawn.serve(workers=1, slabs=1, transport="tcp", serve_args=secured) as curve_endpoint,
    ):
        targets = {"plain": (plain_endpoint, None), "curve": (curve_endpoint, curve)}
        sessions = {name: roundtrip.open_raw_session(ep, curve=c) for name, (ep, c) in targets.items()}
        for _ in tqdm(range(blocks), desc="curve vs plain", unit="block"):
            for name, (endpoint, keys_) in targets.items():
                info = roundtrip.info_frames(sessions[name])
                samples[name]["ping"].append(
                    roundtrip.round_trips(endpoint, roundtrip.ping_frames, n=n, warmup=n // 10, curve=keys_)
                )
                samples[name]["info"].append(roundtrip.round_trips(endpoint, info, n=n, warmup=n // 10, curve=keys_))
        for name, (endpoint, keys_) in targets.items():
            roundtrip.close_raw_session(endpoint, sessions[name], curve=keys_)
    results = {
        name: {
            path: {q: statistics.median(block[q] for block in blocks_) for q in ("p50_us", "p99_us")}
            for path, blocks_ in paths.items()
        }
        for name, paths in samples.items()
    }
    doc["results"] = results
    doc["ratio_curve_to_plain"] = {
        path: {q: results["curve"][path][q] / results["plain"][path][q] for q in ("p50_us", "p99_us")}
        for path in ("ping", "info")
    }
    doc["blocks"] = samples
    write_json_atomic(output, doc)
    return doc
