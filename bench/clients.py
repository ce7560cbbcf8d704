"""`kvmux bench clients`: the Python and Node clients side by side, in one
run, over ipc and tcp: round trip of a session-info call (broker -> worker
and back) and time to first token of a short chat (a fresh session each)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from kvmux.client import Client

from . import spawn
from .report import latency_summary, machine, now_iso, write_json_atomic

NODE_PACKAGE = Path(__file__).resolve().parent.parent / "clients" / "typescript"


def python_client(endpoint: str, info_calls: int, chats: int) -> dict:
    with Client(endpoint, timeout=120) as client:
        with client.open_session() as session:
            for _ in range(20):  # warm-up
                session.info()
            info = []
            for _ in range(info_calls):
                start = time.perf_counter()
                session.info()
                info.append(1000 * (time.perf_counter() - start))
        ttft = []
        for _ in range(chats):
            with client.open_session() as session:
                start = time.perf_counter()
                stream = session.chat("Hi!", max_tokens=4)
                next(stream)
                ttft.append(1000 * (time.perf_counter() - start))
                stream.close()
    return {"info_ms": info, "ttft_ms": ttft}


def node_client(endpoint: str, info_calls: int, chats: int) -> dict:
    out = subprocess.run(
        ["node", "bench/latency.mjs", endpoint, str(info_calls), str(chats)],
        cwd=NODE_PACKAGE,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(output: Path, *, info_calls: int, chats: int) -> dict:
    results = {}
    for transport in ("ipc", "tcp"):
        with spawn.serve(workers=1, slabs=4, transport=transport) as endpoint:
            for name, measure in (("python", python_client), ("node", node_client)):
                raw = measure(endpoint, info_calls, chats)
                results[f"{name}_{transport}"] = {
                    "info_rtt": latency_summary(raw["info_ms"]),
                    "ttft": latency_summary(raw["ttft_ms"]),
                }
    doc = {
        "bench": "clients",
        "created": now_iso(),
        "machine": machine(),
        "config": {"info_calls": info_calls, "chats": chats},
        "results": results,
    }
    write_json_atomic(output, doc)
    return doc
