"""OpenTelemetry traces across processes: the test's own SDK (its
in-memory span exporter) opens a span, the Python client and the gateway
carry it in the protocol, and the broker and the worker, configured by
OTEL_* only, export their spans over OTLP/HTTP to a receiver the test
runs: one trace id, the spans in order (admission, placement, restore,
prefill, decode, hibernate). Without OTEL_* a process imports nothing of
OpenTelemetry."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time

import pytest
from conftest import KEY, api, free_tcp_port, http_gateway
from opentelemetry import propagate
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmux.client import Client


class Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, with its service."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", free_tcp_port()), _Receive)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def of_trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return sorted((s for s in self.spans if s["trace_id"] == trace_id), key=lambda s: s["start"])


class _Receive(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
        for resource in request.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            for scope in resource.scope_spans:
                with self.server.lock:
                    self.server.spans.extend(
                        {
                            "service": service,
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano,
                            "attributes": {a.key: a.value for a in span.attributes},
                        }
                        for span in scope.spans
                    )
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def collector():
    server = Collector()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def otel_env(collector: Collector) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture
def tracer():
    """The test's own SDK: its spans in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def wait_spans(collector: Collector, trace_id: str, names: set[str], timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = collector.of_trace(trace_id)
        missing = names - {s["name"] for s in spans}
        if not missing:
            return spans
        assert time.monotonic() < deadline, f"missing {missing} of {trace_id}: {spans}"
        time.sleep(0.2)


def say(session, text: str) -> str:
    return "".join(chunk.text for chunk in session.chat(text, max_tokens=6))


@pytest.mark.stack
def test_one_trace_from_the_client_through_the_broker_to_the_worker(stack_factory, collector, tracer):
    tracer, memory = tracer
    stack = stack_factory(workers=1, slabs=1, env=otel_env(collector))
    with Client(stack.frontend, timeout=60) as client:
        first = client.open_session("You are terse.")
        say(first, "Name a colour.")
        second = client.open_session("You are terse.")  # the one slab: the first session hibernates
        say(second, "Name a fruit.")
        with tracer.start_as_current_span("turn") as turn:  # the first comes back: restored, the second hibernated
            say(first, "Another?")
    (root,) = memory.get_finished_spans()
    trace_id, root_id = f"{turn.get_span_context().trace_id:032x}", f"{root.context.span_id:016x}"
    wanted = {"kvmux.admission", "kvmux.queue_wait", "kvmux.placement", "kvmux.hibernate", "kvmux.restore"}
    spans = wait_spans(collector, trace_id, wanted | {"kvmux.prefill", "kvmux.decode"})
    by_name = {s["name"]: s for s in spans}
    assert {s["service"] for s in spans} == {"kvmux-broker", "kvmux-worker"}
    assert all(s["parent"] == root_id for s in spans)
    assert by_name["kvmux.placement"]["attributes"]["restore"].bool_value
    # The call waits while the slab's session hibernates, is placed, restored, prefilled, decoded.
    order = ["kvmux.hibernate", "kvmux.admission", "kvmux.placement", "kvmux.restore", "kvmux.prefill", "kvmux.decode"]
    ends = [by_name[name]["end"] for name in order]
    assert ends == sorted(ends), [(name, by_name[name]["start"], by_name[name]["end"]) for name in order]
    assert by_name["kvmux.admission"]["start"] <= by_name["kvmux.hibernate"]["start"]
    assert by_name["kvmux.restore"]["end"] <= by_name["kvmux.prefill"]["start"] <= by_name["kvmux.decode"]["start"]
    assert by_name["kvmux.decode"]["attributes"]["tokens"].int_value > 0
    assert root.start_time <= by_name["kvmux.admission"]["start"] and by_name["kvmux.decode"]["end"] <= root.end_time


@pytest.mark.stack
def test_the_gateway_continues_its_callers_trace(stack_factory, collector, tracer, tmp_path, monkeypatch):
    tracer, _ = tracer
    stack = stack_factory(workers=1, slabs=2, env=otel_env(collector))
    for name, value in otel_env(collector).items():
        monkeypatch.setenv(name, value)  # the gateway the test starts reads its OTEL_* as any process would
    with http_gateway(stack, tmp_path, [KEY]) as base, tracer.start_as_current_span("agent step") as step:
        headers: dict[str, str] = {}
        propagate.inject(headers)
        api(base).chat.completions.create(
            model="kvmux", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_headers=headers
        )
    trace_id = f"{step.get_span_context().trace_id:032x}"
    spans = wait_spans(collector, trace_id, {"POST chat_completions", "kvmux.prefill", "kvmux.decode"})
    (server,) = [s for s in spans if s["service"] == "kvmux-http"]
    assert server["name"] == "POST chat_completions"
    assert server["parent"] == f"{step.get_span_context().span_id:016x}"
    # The daemon's spans of the reply's generate are the gateway span's children, inside it.
    decode = next(s for s in spans if s["name"] == "kvmux.decode")
    assert decode["parent"] == server["span_id"]
    assert server["start"] <= decode["start"] and decode["end"] <= server["end"]


def test_without_otel_settings_nothing_of_opentelemetry_is_imported():
    code = (
        "import sys; from kvmux import tracing; from kvmux.client import wire;"
        "tracing.setup('x'); wire.generate_body(None);"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry'))))"
    )
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", "import json;" + code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []
