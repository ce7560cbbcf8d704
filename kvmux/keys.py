"""CURVE keys as kvmux takes them: pyzmq certificate files (`kvmux keys new`
writes NAME.key, the public key, and NAME.key_secret, both keys) or z85
strings of 40 characters, wherever a key is asked for. Shared by the broker,
the worker and the Python client; the base install (pyzmq) is enough."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth

Z85_KEY_CHARS = 40


class BadKey(ValueError):
    """A key or certificate file that cannot be used; the message says why."""


def _z85(value: str | bytes) -> bytes | None:
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) != Z85_KEY_CHARS:
        return None
    try:
        zmq.utils.z85.decode(raw)
    except (ValueError, KeyError):
        return None
    return raw


def _certificate(value: str | os.PathLike) -> tuple[bytes, bytes | None]:
    path = Path(value).expanduser()
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise BadKey(f"cannot read the CURVE certificate {path}: {exc}") from None
    if public is None or _z85(public) is None:
        raise BadKey(f"{path} holds no valid public-key: is it a `kvmux keys new` certificate?")
    return public, secret


def public_key(value: str | os.PathLike) -> bytes:
    """A public key (z85 bytes) from a z85 string or a certificate file."""
    if isinstance(value, str) and (key := _z85(value)) is not None:
        return key
    return _certificate(value)[0]


def key_pair(value: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) z85 bytes from a secret key's z85 string or a
    NAME.key_secret file."""
    if isinstance(value, str) and (secret := _z85(value)) is not None:
        return zmq.curve_public(secret), secret
    public, secret = _certificate(value)
    if secret is None or _z85(secret) is None:
        raise BadKey(f"{value} holds no secret-key: give the NAME.key_secret file, not NAME.key")
    return public, secret


def new(name: str, directory: str | os.PathLike) -> tuple[Path, Path]:
    """Write DIR/NAME.key and DIR/NAME.key_secret (0600 in a 0700 dir)."""
    if not name or "/" in name or name.startswith("."):
        raise BadKey(f"bad key name {name!r}: a plain file name, like 'laptop'")
    directory = Path(directory).expanduser()
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise BadKey(f"{public} or {secret} exists already: choose another name or remove them")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        written = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    return Path(written[0]), Path(written[1])


def secure_client(sock: zmq.Socket, server_key: str | os.PathLike, secret_key: str | os.PathLike | None) -> None:
    """Make a connecting socket a CURVE client of `server_key`; without a
    `secret_key`, a throwaway key pair (a server that checks keys refuses it)."""
    sock.curve_serverkey = public_key(server_key)
    sock.curve_publickey, sock.curve_secretkey = key_pair(secret_key) if secret_key else zmq.curve_keypair()


def is_loopback(endpoint: str) -> bool:
    """Whether a tcp endpoint binds only the loopback interface."""
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name: reachable from elsewhere
        return False
