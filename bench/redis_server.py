"""A private redis-server for the benches and tests of the Redis session
store: a free loopback port, its AOF in a directory of its own, every write
fsynced before it is acknowledged (`appendfsync always`, what
docs/operations.md advises for production)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvmux.sessions import StoreUnavailable
from kvmux.sessions.redis_store import RedisStore

START_TIMEOUT_S = 10.0


class RedisServer:
    def __init__(self, dir: Path):
        self.dir = dir
        dir.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start it (again, on the same port and AOF) and wait for its PING."""
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        cmd += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                RedisStore(self.url)
                return
            except StoreUnavailable:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: only what its AOF holds survives."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def redis_server(dir: Path | None = None) -> Iterator[RedisServer]:
    with contextlib.ExitStack() as stack:
        where = dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmux-redis-")))
        server = RedisServer(where)
        stack.callback(server.kill)
        server.start()
        yield server
