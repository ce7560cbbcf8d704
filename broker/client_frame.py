"""One request from a client, as every op handler receives it."""

from __future__ import annotations

from dataclasses import dataclass

from kvmux.protocol import Envelope

from .registry import SessionEntry


@dataclass(frozen=True)
class ClientFrame:
    route: bytes  # the client's routing id (outbox.ADMIN marks the admin socket's)
    env: Envelope
    env_raw: bytes  # forwarded untouched to the worker
    body: bytes
    now: float
    key: str = ""  # the client's CURVE public key (z85); "" without CURVE
    admin: bool = False  # on the admin endpoint, or an admin key

    def owns(self, session: SessionEntry) -> bool:
        """With CURVE a session answers only the key that opened it (and
        admins); without, the endpoint's own access rules are the boundary."""
        return not self.key or self.admin or session.owner == self.key
