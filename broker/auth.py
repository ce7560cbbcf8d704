"""Who may talk to the broker: CURVE on its tcp endpoints, ZAP allowlists
read from key directories, and which identities are admin.

pyzmq's ZAP handler (`zmq.auth.thread.ThreadAuthenticator`) asks an
`Allowlist` about every CURVE handshake. It re-reads its key directories
when a key file changed (looking at most once a second), so adding or
removing a key takes effect on the next connection, without a restart. Every CURVE socket sets
ZAP_ENFORCE_DOMAIN: with no handler answering, libzmq refuses the handshake
instead of letting in any key that knows the server's public key; the loop
also checks that the handler is alive (`Auth.alive`).
"""

from __future__ import annotations

import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvmux import keys, logs

log = logs.get("broker.auth")

FRONTEND = "kvmux-frontend"  # ZAP domains: clients and admins; workers
BACKEND = "kvmux-backend"
RESCAN_S = 1.0  # a key file added or removed counts from the next connection after this


class KeyDir:
    """The public keys of the certificates in one directory."""

    def __init__(self, path: str) -> None:
        self.path = Path(path).expanduser()
        self._seen: object = None
        self._keys: frozenset[bytes] = frozenset()
        self._checked = -RESCAN_S

    def __contains__(self, key: bytes) -> bool:
        return key in self.current()

    def current(self) -> frozenset[bytes]:
        now = time.monotonic()
        if now - self._checked < RESCAN_S:
            return self._keys
        self._checked = now
        try:
            files = sorted(self.path.glob("*.key"))
            signature = [(f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files]
        except OSError as exc:
            if self._seen != "missing":
                log.warning("key_dir_unreadable", path=str(self.path), error=str(exc))
            self._seen, self._keys = "missing", frozenset()
            return self._keys
        if signature != self._seen:
            found = set()
            for f in files:
                try:
                    found.add(keys.public_key(f))
                except keys.BadKey as exc:
                    log.warning("key_file_ignored", path=str(f), why=str(exc))
            self._seen, self._keys = signature, frozenset(found)
            log.info("keys_loaded", path=str(self.path), keys=len(found))
        return self._keys


class Allowlist:
    """A ZAP credentials provider: the keys of its directories, and extra
    keys held in memory (the local workers' own)."""

    def __init__(self, domain: str, dirs: list[KeyDir], extra: frozenset[bytes] = frozenset()) -> None:
        self.domain, self.dirs, self.extra = domain, dirs, extra

    def allows(self, key: bytes) -> bool:
        return key in self.extra or any(key in d for d in self.dirs)

    def callback(self, domain: str, key: bytes) -> bool:  # pyzmq's name for it
        allowed = domain == self.domain and self.allows(key)
        if not allowed:
            log.warning("curve_denied", domain=domain, key=key.decode("ascii", "replace"))
        return allowed


class Auth:
    """The broker's CURVE identity, its allowlists and their ZAP handler."""

    def __init__(self, secret_file: str, client_keys: str, worker_keys: str, admin_keys: str) -> None:
        self.public, self.secret = keys.key_pair(secret_file)
        # Local workers get a key pair of their own for this run only.
        self.local_public, self.local_secret = zmq.curve_keypair()
        self.allowlists = {
            FRONTEND: Allowlist(FRONTEND, []),
            BACKEND: Allowlist(BACKEND, [], frozenset({self.local_public})),
        }
        self.admins: KeyDir | None = None
        self.use_keys(client_keys, worker_keys, admin_keys)
        self.authenticator: ThreadAuthenticator | None = None

    def use_keys(self, client_keys: str, worker_keys: str, admin_keys: str) -> None:
        """Allow the keys of these directories from the next connection on
        (at start, and when SIGHUP reloads the config)."""
        self.admins = KeyDir(admin_keys) if admin_keys else None
        self.allowlists[FRONTEND].dirs = [KeyDir(d) for d in (client_keys, admin_keys) if d]
        self.allowlists[BACKEND].dirs = [KeyDir(worker_keys)] if worker_keys else []

    def start(self, ctx: zmq.Context) -> None:
        self.authenticator = ThreadAuthenticator(ctx, log=_ZapLog())
        self.authenticator.start()
        for domain, allowlist in self.allowlists.items():
            self.authenticator.configure_curve_callback(domain, allowlist)

    def alive(self) -> bool:
        return self.authenticator is not None and self.authenticator.is_alive()

    def stop(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()

    def secure(self, sock: zmq.Socket, domain: str) -> None:
        """Make a ROUTER a CURVE server for `domain` (before it binds)."""
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
        sock.zap_domain = domain.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def is_admin(self, key: str) -> bool:
        return self.admins is not None and key.encode() in self.admins

    def worker_env(self) -> dict[str, str]:
        """What a local worker needs to connect: the secret in its
        environment, which other users cannot read (a command line they can)."""
        return {"KVMUX_CURVE_SECRET": self.local_secret.decode(), "KVMUX_SERVER_KEY": self.public.decode()}


class _ZapLog:
    """pyzmq's authenticator logs every handshake at debug and malformed ZAP
    requests at error through stdlib logging; ours go through structlog."""

    def debug(self, *args) -> None:
        pass

    def info(self, *args) -> None:
        pass

    def warning(self, msg, *args) -> None:
        log.warning("zap", message=msg % args if args else msg)

    def error(self, msg, *args) -> None:
        log.warning("zap", message=msg % args if args else msg)

    def exception(self, msg, *args) -> None:
        log.error("zap_failed", message=msg % args if args else msg, exc_info=True)
