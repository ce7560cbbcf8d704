"""The daemon's settings: one msgspec Struct, filled from a TOML file
(`kvmux serve --config kvmux.toml`, flat keys named like the fields) and then
from command-line options, which win. msgspec checks every type and bound;
`load` turns its complaint into a `ConfigError` that names the key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec

from kvmux import keys, paths
from kvmux.protocol import (
    DECODE_ERRORS,
    DEFAULT_MAX_APPEND_TOKENS,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_TOKENS_LIMIT,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
)

Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class BrokerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # sockets ("" = the default ipc endpoints under kvmux.paths.runtime_dir())
    frontend: str = ""
    backend: str = ""
    admin_endpoint: str = ""  # ipc only: every frame arriving there is admin
    # security (docs/operations.md, "Security"): CURVE on every tcp endpoint
    curve_secret: str = ""  # the broker's NAME.key_secret; "" = no CURVE
    client_keys: str = ""  # dirs of allowed public keys (NAME.key files)
    worker_keys: str = ""
    admin_keys: str = ""  # also allowed as clients; may DRAIN over tcp
    insecure: bool = False  # allow tcp beyond loopback without CURVE
    # local workers started by `kvmux serve`
    workers: Count = 1
    slabs: Annotated[int, msgspec.Meta(ge=1)] = 4
    model: str | None = None
    chat_template: str | None = None  # a Jinja file replacing the model's chat template (worker --chat-template)
    draft_model: str | None = None  # speculative decoding's draft model (worker --draft-model)
    draft_quantized: bool = False  # keep its weights quantized
    batch_invariant: bool = False  # local workers pad every pass (worker --batch-invariant)
    worker_args: list[str] = []  # extra `kvmux worker` options, e.g. ["--window", "512"]
    # admission
    admission: Literal["reject", "queue"] = "reject"
    queue_depth: Count = 64  # most opens waiting at once
    queue_wait_s: Positive = 30.0  # longest an open waits for a slab
    client_quota: Count = 1000  # sessions (live and hibernated) per client identity; 0 = no quota
    idle_timeout_s: NonNegative = 0.0  # close sessions idle this long; 0 = never
    # durable sessions (docs/operations.md, "Session store")
    state_dir: str = ""  # "" = kvmux.paths.state_dir()
    hibernate_after_s: NonNegative = 300.0  # write idle sessions to the store, freeing their slab; 0 = only when needed
    max_sessions: Annotated[int, msgspec.Meta(ge=1)] = 10_000  # live + hibernated
    session_ttl_s: NonNegative = 7 * 24 * 3600.0  # delete sessions idle this long; 0 = never
    worker_wait_s: Positive = 60.0  # while local workers start, how long opens wait for one
    allow_session_override: bool = True  # OpenSession.admission / queue_wait_s honoured
    retry_after_s: Positive = 1.0  # the hint sent with `overloaded`
    # liveness and limits
    heartbeat_s: Positive = HEARTBEAT_INTERVAL_S
    heartbeat_liveness: Annotated[float, msgspec.Meta(ge=1)] = HEARTBEAT_LIVENESS
    max_frame_bytes: Annotated[int, msgspec.Meta(ge=1024)] = DEFAULT_MAX_FRAME_BYTES
    max_tokens_limit: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_TOKENS_LIMIT  # local workers' cap on one reply
    max_append_tokens: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_APPEND_TOKENS  # and on one append
    drain_grace_s: NonNegative = 10.0  # running generations may finish within this
    # ZeroMQ high-water marks (messages per peer) and the per-client backlog the
    # broker holds once a client's pipe is full (see docs/operations.md). The
    # marks bound what one peer can queue: at 10000 a hostile flood from
    # peers that then vanish grew the broker ~1 KB a frame (bench fuzz).
    frontend_hwm: Annotated[int, msgspec.Meta(ge=1)] = 1000
    backend_hwm: Annotated[int, msgspec.Meta(ge=1)] = 1000
    client_backlog: Annotated[int, msgspec.Meta(ge=1)] = 256

    def __post_init__(self) -> None:
        if self.admission == "queue" and self.queue_depth == 0:
            raise ValueError("admission = 'queue' needs queue_depth >= 1")
        self.state_dir = self.state_dir or str(paths.state_dir())
        self.frontend = self.frontend or paths.default_frontend()
        self.backend = self.backend or paths.default_backend()
        self.admin_endpoint = self.admin_endpoint or paths.default_admin()
        if not self.admin_endpoint.startswith("ipc://"):
            raise ValueError(f"admin_endpoint: {self.admin_endpoint} is not ipc:// (admin is local only)")
        self._check_security()

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


class ConfigError(ValueError):
    """A config file or option the daemon cannot run with; the message says which."""


def load(path: Path | None = None, **overrides: Any) -> BrokerConfig:
    """Read `path` (TOML) if given, apply the non-None `overrides`, validate."""
    raw: dict[str, Any] = {}
    where = "command line"
    if path is not None:
        where = str(path)
        try:
            raw = msgspec.toml.decode(Path(path).read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except DECODE_ERRORS as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    raw.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return msgspec.convert(raw, BrokerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {_explain(exc)}") from None


def _explain(exc: msgspec.ValidationError) -> str:
    # msgspec says "Expected `int` >= 1, got `0` - at `$.slabs`"; name the key plainly.
    text = str(exc)
    if " - at `$." not in text:
        return text
    message, _, key = text.rpartition(" - at `$.")
    key = key.rstrip("`")
    choices = get_args(_FIELD_TYPES.get(key)) if get_origin(_FIELD_TYPES.get(key)) is Literal else ()
    if choices:
        message += f" (choose one of: {', '.join(choices)})"
    return f"{key}: {message}"


_FIELD_TYPES = {field.name: field.type for field in msgspec.structs.fields(BrokerConfig)}
