"""`kvmux bench telemetry`: what metrics and traces cost a chat turn. Two
daemons side by side, each with one worker and one session: one plain,
one with its Prometheus endpoint scraped every second and OpenTelemetry
on (every process exporting its spans over OTLP/HTTP to a receiver in this
process, the bench's own turn a span whose context the client carries).
Turns alternate between them in pairs, the order swapped every pair, so a
busy moment of the shared machine hits both: the report gives each side's
turn time and time to first token (p50, p99) and the ratio of the p50s.
"""

from __future__ import annotations

import http.server
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from kvmux.client import Client

from . import spawn
from .report import machine, now_iso, write_json_atomic

PROMPTS = ("List six colours.", "List six fruits.", "List six cities.", "List six rivers.")  # replies of many tokens


class _Sink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that takes every export and keeps nothing."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _turn(session, text: str, max_tokens: int) -> tuple[float, float]:
    """(turn seconds, time to first token) of one chat turn."""
    started = time.perf_counter()
    first = None
    for _ in session.chat(text, max_tokens=max_tokens, temperature=0.0):
        first = first or time.perf_counter() - started
    return time.perf_counter() - started, first or 0.0


def _scrape(url: str, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        with urllib.request.urlopen(url, timeout=5) as reply:
            reply.read()


def _summary(samples: list[float]) -> dict:
    cuts = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 else samples * 99
    return {"p50_ms": cuts[49] * 1000, "p99_ms": cuts[98] * 1000, "n": len(samples)}


def run(output: Path, *, pairs: int, max_tokens: int) -> dict:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    collector = f"http://127.0.0.1:{sink.server_address[1]}"
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{collector}/v1/traces")))
    tracer = provider.get_tracer("kvmux-bench")
    metrics_port = int(spawn.tcp_endpoint().rsplit(":", 1)[1])
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector}
    doc = {
        "bench": "telemetry",
        "created": now_iso(),
        "machine": machine(),
        "config": {"pairs": pairs, "max_tokens": max_tokens, "scrape_s": 1.0},
    }
    samples = {side: {"turn": [], "ttft": []} for side in ("off", "on")}
    stop = threading.Event()
    with (
        spawn.serve(workers=1, slabs=1) as plain,
        spawn.serve(workers=1, slabs=1, serve_args=("--metrics-port", str(metrics_port)), env=otel) as observed,
        Client(plain, timeout=120) as off_client,
        Client(observed, timeout=120) as on_client,
    ):
        scraper = threading.Thread(target=_scrape, args=(f"http://127.0.0.1:{metrics_port}/metrics", stop))
        scraper.start()
        sessions = {"off": off_client.open_session(), "on": on_client.open_session()}
        try:
            for side in ("off", "on"):  # warm-up: the first turn loads what the rest reuse
                _turn(sessions[side], "Hello.", max_tokens)
            for pair in tqdm(range(pairs), desc="telemetry on vs off", unit="pair"):
                text = PROMPTS[pair % len(PROMPTS)]
                for side in ("off", "on") if pair % 2 == 0 else ("on", "off"):
                    if side == "on":
                        with tracer.start_as_current_span("turn"):
                            turn, first = _turn(sessions[side], text, max_tokens)
                    else:
                        turn, first = _turn(sessions[side], text, max_tokens)
                    samples[side]["turn"].append(turn)
                    samples[side]["ttft"].append(first)
        finally:
            stop.set()
            scraper.join()
            provider.shutdown()
            sink.shutdown()
    results = {side: {name: _summary(values) for name, values in kinds.items()} for side, kinds in samples.items()}
    doc["results"] = results
    doc["ratio_on_to_off"] = {
        name: results["on"][name]["p50_ms"] / results["off"][name]["p50_ms"] for name in ("turn", "ttft")
    }
    doc["samples_s"] = samples
    write_json_atomic(output, doc)
    return doc
