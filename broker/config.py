"""The daemon's settings: one msgspec Struct, filled from a TOML file
(`kvmux serve --config kvmux.toml`, flat keys named like the fields) and then
from command-line options, which win. msgspec checks every type and bound;
`load` turns its complaint into a `ConfigError` that names the key.

Each setting is declared once: those a worker takes in kvmux/settings.py's
`WorkerSettings` (local workers get the broker's), the broker's own below.
`kvmux serve`'s options and their help, and the table of settings in
docs/operations.md (`python -m kvmux.broker.config docs/operations.md`
rewrites it), are derived from them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from kvmux import keys, paths, settings
from kvmux.protocol import DEFAULT_MAX_FRAME_BYTES, HEARTBEAT_LIVENESS
from kvmux.settings import AtLeastOne, Count, ModelSpec, NonNegative, Positive, WorkerSettings, doc


class BrokerConfig(WorkerSettings, kw_only=True, forbid_unknown_fields=True):
    """WorkerSettings, which `kvmux serve` passes on to its local workers,
    then the daemon's own."""

    # local workers started by `kvmux serve`
    workers: Annotated[Count, doc("Local worker processes to start (0: broker only).")] = 1
    worker_args: Annotated[
        list[str], doc('Extra `kvmux worker` options for local workers, e.g. `["--window", "512"]`.')
    ] = msgspec.field(default_factory=list)
    models: Annotated[
        list[ModelSpec],
        doc(
            "The models its local workers serve, the first the default: `[[models]]` tables (path, aliases, slabs,"
            ' window, pipeline, chat_template, draft_model: docs/operations.md, "Several models"), or `--model`'
            " given more than once.",
            "one: `model`",
        ),
    ] = msgspec.field(default_factory=list)
    idle_unload_s: Annotated[
        NonNegative,
        doc(
            "Unload a model (stop its workers; its sessions hibernate first) idle this long; 0: never. It loads"
            " again when a session asks for it."
        ),
    ] = 0.0
    max_resident_bytes: Annotated[
        Count,
        doc(
            "Memory the models' workers may hold together: loading one past it first unloads the least recently"
            " used (never a pinned one, nor one running requests).",
            "the machine's memory less 20 % (at least 1 GiB)",
        ),
    ] = 0
    # sockets
    frontend: Annotated[
        str, doc("Client endpoint to bind.", "$KVMUX_ENDPOINT, else frontend.ipc in the runtime dir")
    ] = ""
    backend: Annotated[
        str,
        doc(
            "Worker endpoint to bind, e.g. tcp://0.0.0.0:5556 for remote workers.",
            "$KVMUX_BACKEND, else backend.ipc in the runtime dir",
        ),
    ] = ""
    admin_endpoint: Annotated[
        str,
        doc(
            "Admin endpoint, ipc only: every frame arriving there is admin (drain, every session).",
            "$KVMUX_ADMIN_ENDPOINT, else admin.ipc in the runtime dir",
        ),
    ] = ""
    # security (docs/operations.md, "Security"): CURVE on every tcp endpoint
    curve_secret: Annotated[
        str,
        doc("The broker's CURVE secret key file (`kvmux keys new`'s NAME.key_secret): CURVE on every tcp endpoint."),
    ] = ""
    client_keys: Annotated[
        str, doc("Directory of the public keys (NAME.key files) of clients allowed in; re-read when it changes.")
    ] = ""
    worker_keys: Annotated[str, doc("Directory of the public keys of remote workers allowed in.")] = ""
    admin_keys: Annotated[
        str, doc("Directory of the public keys allowed admin ops (drain) over tcp; they may also chat.")
    ] = ""
    insecure: Annotated[bool, doc("Allow tcp beyond loopback without CURVE (anyone who reaches it may use it).")] = (
        False
    )
    # admission
    admission: Annotated[
        Literal["reject", "queue"], doc("What an open gets when every slab is busy running a request.")
    ] = "reject"
    queue_depth: Annotated[Count, doc("Most opens waiting in the queue at once, per model.")] = 64
    queue_wait_s: Annotated[Positive, doc("Longest an open waits in the queue for a slab.")] = 30.0
    priority_aging_s: Annotated[
        Positive, doc("In the queue, each this many seconds waited count as one level of priority.")
    ] = 5.0
    client_quota: Annotated[
        Count,
        doc(
            "Sessions (live and hibernated) per client identity and model: its CURVE key, else its"
            " client_name, else its connection; 0: no quota."
        ),
    ] = 1000
    idle_timeout_s: Annotated[NonNegative, doc("Close sessions idle this long; 0: never.")] = 0.0
    # durable sessions (docs/operations.md, "Session store")
    hibernate_after_s: Annotated[
        NonNegative,
        doc("Write sessions idle this long to the store, freeing their slab; 0: only when a slab is needed."),
    ] = 300.0
    max_sessions: Annotated[
        AtLeastOne, doc("Sessions kept, live and hibernated; an open beyond gets `overloaded` (quota).")
    ] = 10_000
    max_store_bytes: Annotated[
        Count,
        doc(
            "The session store's byte budget: past it, the least recently used idle hibernated sessions expire"
            " (never a live one); 0: none."
        ),
    ] = 0
    session_ttl_s: Annotated[NonNegative, doc("Delete sessions idle this long (then `session_expired`); 0: never.")] = (
        7 * 24 * 3600.0
    )
    worker_wait_s: Annotated[
        Positive, doc("While the daemon's own workers start or restart, how long opens wait for one.")
    ] = 60.0
    allow_session_override: Annotated[bool, doc("Honour the admission and queue_wait_s an OpenSession asks for.")] = (
        True
    )
    retry_after_s: Annotated[Positive, doc("The retry hint sent with `overloaded`.")] = 1.0
    # liveness and limits
    heartbeat_liveness: Annotated[
        float, msgspec.Meta(ge=1), doc("Heartbeat intervals of silence after which a worker is dead.")
    ] = HEARTBEAT_LIVENESS
    client_liveness_s: Annotated[
        NonNegative,
        doc(
            "A client that answers heartbeats (kvmux's clients do) and leaves the broker's (sent each heartbeat_s"
            " while its requests are quiet) unanswered this long is gone: its streams are cancelled (a client whose"
            " host, network or process died with its connection open); 0: never."
        ),
    ] = 30.0
    max_frame_bytes: Annotated[
        int, msgspec.Meta(ge=1024), doc("Largest client frame accepted (envelope + body), in bytes.")
    ] = DEFAULT_MAX_FRAME_BYTES
    drain_grace_s: Annotated[NonNegative, doc("On SIGTERM or drain, how long running generations may finish.")] = 10.0
    # ZeroMQ high-water marks (messages per peer) and the per-client backlog the
    # broker holds once a client's pipe is full (see docs/operations.md). The
    # marks bound what one peer can queue: at 10000 a hostile flood from
    # peers that then vanish grew the broker ~1 KB a frame (bench fuzz).
    frontend_hwm: Annotated[
        AtLeastOne,
        doc(
            "ZeroMQ high-water mark of the client socket, messages per peer: what one peer may queue (libzmq keeps"
            " the queue of a peer that vanished, so a larger mark lets a flood grow the broker)."
        ),
    ] = 1000
    backend_hwm: Annotated[AtLeastOne, doc("The same for the worker socket.")] = 1000
    client_backlog: Annotated[
        AtLeastOne, doc('Frames held for a client whose pipe is full (docs/operations.md, "Flow control").')
    ] = 256
    # operations (docs/operations.md, "Metrics")
    metrics_port: Annotated[
        int, msgspec.Meta(ge=0, le=65535), doc("Serve Prometheus metrics at http://METRICS_HOST:PORT/metrics; 0: off.")
    ] = 0
    metrics_host: Annotated[
        str, doc("The address the metrics listen on (another than loopback: anyone who reaches it reads them).")
    ] = "127.0.0.1"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.admission == "queue" and self.queue_depth == 0:
            raise ValueError("admission = 'queue' needs queue_depth >= 1")
        if 0 < self.client_liveness_s < 2 * self.heartbeat_s:
            raise ValueError(
                "client_liveness_s must be 0 (never) or at least two heartbeat intervals (2 x heartbeat_s)"
            )
        self.frontend = self.frontend or paths.default_frontend()
        self.backend = self.backend or paths.default_backend()
        self.admin_endpoint = self.admin_endpoint or paths.default_admin()
        if not self.admin_endpoint.startswith("ipc://"):
            raise ValueError(f"admin_endpoint: {self.admin_endpoint} is not ipc:// (admin is local only)")
        self._check_security()
        self._check_models()

    def _check_models(self) -> None:
        if not self.models:
            return
        if self.model is not None:
            raise ValueError("models: give `model` (one) or [[models]], not both")
        if self.workers == 0:
            raise ValueError("models: [[models]] are served by local workers: workers must be at least 1")
        names = [name for spec in self.models for name in (spec.path, *spec.aliases)]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"models: {', '.join(twice)} named more than once")

    def _check_security(self) -> None:
        for name in ("client_keys", "worker_keys", "admin_keys"):
            path = getattr(self, name)
            if path and not Path(path).expanduser().is_dir():
                raise ValueError(f"{name}: {path} is not a directory of `kvmux keys new` .key files")
        if self.curve_secret:
            try:
                keys.key_pair(self.curve_secret)
            except keys.BadKey as exc:
                raise ValueError(f"curve_secret: {exc}") from None
            if self.frontend.startswith("tcp://") and not (self.client_keys or self.admin_keys):
                raise ValueError("curve_secret: with CURVE on a tcp frontend, give client_keys (or admin_keys)")
            return
        for name in ("frontend", "backend"):
            endpoint = getattr(self, name)
            if endpoint.startswith("tcp://") and not keys.is_loopback(endpoint) and not self.insecure:
                raise ValueError(
                    f"{name}: {endpoint} is reachable from other machines without authentication or encryption: "
                    "give curve_secret (with client_keys/worker_keys), or insecure = true to accept that"
                )

    @property
    def curve(self) -> bool:
        return bool(self.curve_secret)


def load(path: Path | None = None, **overrides: Any) -> BrokerConfig:
    """The daemon's settings: `path`'s (TOML) if given, then the non-None
    `overrides`. `kvmux serve`'s --model may repeat (a list): once it is
    `model`, more often `models`."""
    given = overrides.pop("model", None)
    if isinstance(given, list | tuple):
        if len(given) > 1:
            overrides["models"] = [{"path": model} for model in given]
        given = given[0] if len(given) == 1 else None
    return settings.load(BrokerConfig, path, model=given, **overrides)


SETTINGS = settings.declared(BrokerConfig)
TABLE = settings.Table("kvmux.broker.config", SETTINGS)

if __name__ == "__main__":
    TABLE.main(sys.argv)
