"""OpenTelemetry traces, when OpenTelemetry is installed and configured.

A daemon process (`kvmux serve`, `kvmux worker`, `kvmux http`) calls
`setup` at start: where OpenTelemetry's standard environment variables ask
for traces (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
or `OTEL_TRACES_EXPORTER`; `OTEL_SDK_DISABLED=true` or an exporter of
`none` turn them off) it installs the SDK's tracer provider with a batch
processor and that exporter (`otlp`, over HTTP/protobuf, or `console`).
Without them nothing here imports OpenTelemetry and every call is a no-op.

A request's trace context travels in the protocol as a W3C `traceparent`
string (OpenSession, Append, Generate, Hibernate): a client puts its
current span's there (`current`: only where its program has imported
OpenTelemetry itself), and the broker and the worker record their spans
(admission, queue wait, placement, restore, prefill, decode, hibernate) as
its children, with the times they measured (`record`)."""

from __future__ import annotations

import os
import sys
import time

import msgspec

_EXPORTERS = ("otlp", "console")


class _Process:
    tracer = None  # the SDK's tracer, once `setup` installed it


class Traced(msgspec.Struct):
    """The one field of a request body the broker reads when it traces."""

    traceparent: str | None = None


_traced = msgspec.msgpack.Decoder(Traced)


def configured() -> bool:
    """Whether OpenTelemetry's environment variables ask for traces."""
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if exporter == "none" or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(
        exporter
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup(service: str) -> None:
    """Install the SDK's tracer provider for this process, as the
    environment configures it (`service`: the default service.name)."""
    from kvmux import logs  # the daemons' logs (a client imports this module too, and needs none)

    log = logs.get("tracing")
    if not configured():
        return
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip() or "otlp"
    if exporter_name not in _EXPORTERS:
        log.error("tracing_refused", exporter=exporter_name, why=f"OTEL_TRACES_EXPORTER must be one of {_EXPORTERS}")
        return
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        if exporter_name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
    except ImportError as exc:
        log.error(
            "tracing_refused", why=f"OTEL_* asks for traces, but {exc.name} is missing: pip install 'kvmux[otel]'"
        )
        return
    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))  # shut down (flushed) at exit
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _Process.tracer = trace.get_tracer("kvmux")
    log.info("tracing", service=name, exporter=exporter_name)


def enabled() -> bool:
    return _Process.tracer is not None


def shutdown() -> None:
    """Export the spans still batched: what the SDK's own exit hook does,
    for a process that leaves by os._exit (a worker: worker/cli.py)."""
    if _Process.tracer is not None:
        from opentelemetry import trace

        trace.get_tracer_provider().shutdown()


def current() -> str | None:
    """The traceparent of this process's current span, if it has one: for a
    request body. Only where OpenTelemetry is imported already (this
    process traces, or its program uses OpenTelemetry)."""
    if _Process.tracer is None and "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def of(body: bytes) -> str | None:
    """A request body's traceparent, while this process traces (else None, unread)."""
    if _Process.tracer is None:
        return None
    try:
        return _traced.decode(body).traceparent
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() instant as the wall-clock nanoseconds spans take."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def record(name: str, traceparent: str | None, start_ns: int, end_ns: int | None = None, **attributes) -> None:
    """A finished span, a child of the span `traceparent` names, over
    [start_ns, end_ns] (wall-clock ns; end: now). Nothing without a
    traceparent or while this process does not trace."""
    if _Process.tracer is None or not traceparent:
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    span = _Process.tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
    span.end(end_time=end_ns)


def server_span(name: str, headers: dict[str, str]):
    """A span for a request served here, current while its `with` lasts,
    continuing the trace its W3C headers carry (a new one otherwise)."""
    from opentelemetry import propagate, trace

    return _Process.tracer.start_as_current_span(name, context=propagate.extract(headers), kind=trace.SpanKind.SERVER)
