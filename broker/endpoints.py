"""Binding ipc endpoints safely: the default runtime dir is private (0700),
a socket file left by a dead broker is removed, one that a live process still
listens on is not taken over."""

from __future__ import annotations

import socket
from pathlib import Path

from kvmux import keys, paths


class EndpointInUse(RuntimeError):
    pass


def prepare(endpoint: str) -> None:
    """Make `endpoint` bindable (ipc only; tcp needs nothing)."""
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint.removeprefix("ipc://"))
    if path.parent == paths.runtime_dir():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.chmod(0o700)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        if _listening(path):
            raise EndpointInUse(f"{endpoint} is in use by a running process (another broker?)")
        path.unlink()


def restrict(endpoint: str) -> None:
    """Only the broker's own user may connect to this ipc socket."""
    if endpoint.startswith("ipc://"):
        Path(endpoint.removeprefix("ipc://")).chmod(0o600)


def protection(endpoint: str, curve: bool) -> str:
    """Who can reach an endpoint, in a few words."""
    if curve:
        return "CURVE: encrypted, keys checked"
    if endpoint.startswith("ipc://"):
        path = Path(endpoint.removeprefix("ipc://"))
        try:
            mode = path.stat().st_mode & 0o777
            parent = path.parent.stat().st_mode & 0o777
        except OSError:
            return "ipc"
        private = not (mode & 0o077) or not (parent & 0o077)
        return "ipc, this user only" if private else f"ipc, OPEN to other local users (mode {mode:o}, dir {parent:o})"
    if keys.is_loopback(endpoint):
        return "tcp on loopback without CURVE: every local user can connect"
    return "OPEN to the network: tcp without CURVE (--insecure)"


def remove(endpoint: str) -> None:
    """Remove a bound ipc socket's file once its socket is closed."""
    if endpoint.startswith("ipc://"):
        Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:  # refused: nobody listens, the file is stale
            return False
        return True
