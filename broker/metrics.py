"""The daemon's Prometheus metrics (`kvmux serve --metrics-port`), in the
standard text format through prometheus_client, named by its conventions
(`_total` counters, `_seconds` and `_bytes` units; labels worker and
model, never a session id).

Events are counted where the broker sees them pass (a generate's first
token and each next one, its final counts, a queue wait, a hibernate or
restore time). What the broker already keeps (slabs, sessions, the
store's bytes, refusals by reason, workers' heartbeats) is read at scrape
time, never counted twice: the scrape thread asks the broker's loop for
its `BrokerStats` (`snapshot`), which the loop makes between two polls
(`publish`), so no thread reads the loop's state while it changes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvmux.protocol import BrokerStats

SNAPSHOT_WAIT_S = 2.0  # a scrape waits this long for the loop, then answers without the broker's state

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_WORKER = ("worker", "model")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvmux_requests",
            "Client requests a worker answered, by op and outcome (ok, or the error code).",
            ["op", "outcome"],
            registry=r,
        )
        self.errors = Counter(
            "kvmux_broker_errors",
            "Errors the broker answered itself, by code (overloaded ones: kvmux_refusals_total).",
            ["code"],
            registry=r,
        )
        self.prefilled = Counter("kvmux_prefilled_tokens", "Prompt tokens prefilled.", _WORKER, registry=r)
        self.generated = Counter("kvmux_generated_tokens", "Tokens generated.", _WORKER, registry=r)
        self.cached = Counter(
            "kvmux_cached_tokens",
            "Prompt tokens a generate did not prefill, by where they came from: session (its own history,"
            " in its slab or restored from the store) or prefix (a shared prefix).",
            [*_WORKER, "source"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvmux_time_to_first_token_seconds",
            "From a generate's arrival to its first token leaving the broker (queue wait, restore and prefill).",
            ["model"],
            buckets=_SECONDS,
            registry=r,
        )
        self.itl = Histogram(
            "kvmux_inter_token_latency_seconds",
            "Between two tokens of a generate's stream, as the broker forwards them.",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvmux_queue_wait_seconds", "How long a queued request waited for a slab.", buckets=_SECONDS, registry=r
        )
        self.hibernate = Histogram(
            "kvmux_hibernate_seconds", "Writing a session's slab to the store.", ["model"], buckets=_SECONDS, registry=r
        )
        self.restore = Histogram(
            "kvmux_restore_seconds", "Restoring a session from the store.", ["model"], buckets=_SECONDS, registry=r
        )
        self.workers_lost = Counter(
            "kvmux_workers_lost", "Workers lost (silent, unreachable, disconnected).", ["model"], registry=r
        )
        self.expired = Counter(
            "kvmux_sessions_expired",
            "Sessions the broker ended, by reason: idle (idle timeout or TTL) or store_budget (max_store_bytes).",
            ["reason"],
            registry=r,
        )
        ProcessCollector(registry=r)
        r.register(_State(self.snapshot))
        self._lock = threading.Lock()  # one scrape at a time asks the loop
        self._wanted = threading.Event()
        self._ready = threading.Event()
        self._stats: BrokerStats | None = None

    def serve(self, host: str, port: int) -> None:
        """Answer GET /metrics on host:port from a thread of its own; raises OSError when it cannot bind."""
        start_http_server(port, addr=host, registry=self.registry)

    def publish(self, stats: Callable[[], BrokerStats]) -> None:
        """The loop's side: a scrape waits for the broker's stats; make them."""
        if self._wanted.is_set():
            self._wanted.clear()
            self._stats = stats()
            self._ready.set()

    def snapshot(self) -> BrokerStats | None:
        """The scrape's side: the broker's stats made by its loop, None if it did not answer in time."""
        with self._lock:
            self._ready.clear()
            self._wanted.set()
            if not self._ready.wait(SNAPSHOT_WAIT_S):
                self._wanted.clear()
                return None
            return self._stats


class _State:
    """The gauges and counters the broker keeps itself, read from one BrokerStats at scrape time."""

    def __init__(self, snapshot: Callable[[], BrokerStats | None]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # made at scrape time only: describing must not wait on the loop

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        if s is None:
            return
        per_worker = {
            "kvmux_worker_up": (GaugeMetricFamily, "1 for each registered worker.", lambda w: 1),
            "kvmux_slabs": (GaugeMetricFamily, "KV slabs a worker has.", lambda w: w.slabs_total),
            "kvmux_slabs_used": (GaugeMetricFamily, "KV slabs holding a live session.", lambda w: w.slabs_used),
            "kvmux_slabs_free": (
                GaugeMetricFamily,
                "KV slabs free.",
                lambda w: w.slabs_total - w.slabs_used,
            ),
            "kvmux_kv_live_bytes": (
                GaugeMetricFamily,
                "KV cache bytes the live sessions hold (their arrays as they are).",
                lambda w: w.kv_bytes,
            ),
            "kvmux_running_requests": (GaugeMetricFamily, "Appends and generates computing now.", lambda w: w.running),
            "kvmux_speculative_drafted_tokens": (
                CounterMetricFamily,
                "Tokens drafted for the verifier since the worker started.",
                lambda w: w.drafted,
            ),
            "kvmux_speculative_accepted_tokens": (
                CounterMetricFamily,
                "Drafted tokens the verifier accepted since the worker started.",
                lambda w: w.accepted,
            ),
            "kvmux_prefix_hits": (
                CounterMetricFamily,
                "New sessions that took a shared prefix, since the worker started.",
                lambda w: w.prefixes.hits if w.prefixes else 0,
            ),
            "kvmux_prefix_misses": (
                CounterMetricFamily,
                "New sessions' openings of a block or more that found no shared prefix, since the worker started.",
                lambda w: w.prefixes.misses if w.prefixes else 0,
            ),
            "kvmux_prefixes_stored": (
                CounterMetricFamily,
                "Shared prefixes the worker wrote to the store, since it started.",
                lambda w: w.prefixes.stored if w.prefixes else 0,
            ),
            "kvmux_prefix_bytes": (
                GaugeMetricFamily,
                "Shared prefixes held in the worker's memory.",
                lambda w: w.prefixes.bytes if w.prefixes else 0,
            ),
        }
        for name, (family, text, value) in per_worker.items():
            metric = family(name, text, labels=_WORKER)
            for w in s.workers:
                metric.add_metric([w.worker_id, w.model], value(w))
            yield metric
        sessions = GaugeMetricFamily(
            "kvmux_sessions", "Sessions, by state: live (in a slab) or hibernated.", labels=["state"]
        )
        sessions.add_metric(["live"], s.sessions_live)
        sessions.add_metric(["hibernated"], s.sessions_hibernated)
        yield sessions
        yield GaugeMetricFamily(
            "kvmux_store_bytes", "Bytes the session store's records and snapshots take.", s.store_bytes
        )
        yield GaugeMetricFamily("kvmux_queue_depth", "Requests waiting in the admission queue.", s.queue_depth)
        yield GaugeMetricFamily("kvmux_in_flight_requests", "Requests sent to workers and not answered.", s.in_flight)
        yield GaugeMetricFamily("kvmux_draining", "1 while the daemon drains.", int(s.draining))
        yield CounterMetricFamily("kvmux_sessions_admitted", "Sessions opened on a slab.", s.admitted)
        refused = CounterMetricFamily(
            "kvmux_refusals", "`overloaded` answers of the broker, by reason.", labels=["reason"]
        )
        for r in s.refused:
            refused.add_metric([r.reason], r.count)
        yield refused
