"""What every route reads: the broker's client (opened at startup, app.py),
the API keys, the gateway's metrics, and the header that names a request's
session."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmux.client import AsyncClient

from .metrics import GatewayMetrics

# A request's pinned session (its client keeps it), and on every answer the session it used.
SESSION_HEADER = "X-Kvmux-Session"
# What the session a request opens does with shared prefixes (OpenSession.prefix): pin, off, auto.
PREFIX_HEADER = "X-Kvmux-Prefix"


@dataclass
class Gateway:
    endpoint: str | None
    api_keys: list[str] = field(default_factory=list)  # none: loopback only (the CLI checks the host)
    priorities: dict[str, int] = field(default_factory=dict)  # a key's default priority (its key file line)
    timeout_s: float = 600.0
    client: AsyncClient | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
