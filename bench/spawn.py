"""`--spawn`: a bench starts its own daemon (`kvmux serve`, broker plus local
workers) on private endpoints, waits until its workers have registered, and
stops it (SIGTERM, the daemon's own drain) when the bench ends, however it
ends: a SIGTERM to the bench (a timeout, a CI cancel) ends it as Ctrl-C
does, and a bench killed outright takes the daemon with it (its
parent-death signal, where the platform has one)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvmux.children import die_with_parent
from kvmux.client import Client, KvmuxError

READY_TIMEOUT_S = 180.0  # model load on 2 busy cores


def tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@dataclass(frozen=True)
class Daemon:
    frontend: str
    backend: str
    admin: str
    pid: int  # the broker's
    log: Path  # the daemon's log (broker and local workers)


@contextlib.contextmanager
def serve(
    *,
    workers: int = 1,
    slabs: int = 4,
    model: str | None = None,
    transport: str = "ipc",
    serve_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Yield the frontend endpoint of a fresh `kvmux serve` (more options in `serve_args`, environment in `env`)."""
    with daemon(workers=workers, slabs=slabs, model=model, transport=transport, serve_args=serve_args, env=env) as d:
        yield d.frontend


@contextlib.contextmanager
def daemon(
    *,
    workers: int = 1,
    slabs: int = 4,
    model: str | None = None,
    transport: str = "ipc",
    serve_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    state_dir: Path | None = None,
) -> Iterator[Daemon]:
    """A fresh `kvmux serve` (`env`: more environment for it and its
    workers): its endpoints and the broker's pid. Its state dir is its own
    and goes with it, unless `state_dir` names one to keep (a restart's)."""
    tmp = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))  # short: ipc paths are limited
    if transport == "ipc":
        frontend, backend = f"ipc://{tmp}/f.ipc", f"ipc://{tmp}/b.ipc"
    else:
        frontend, backend = tcp_endpoint(), tcp_endpoint()
    admin = f"ipc://{tmp}/a.ipc"  # its own: the default one belongs to the user's daemon
    cmd = [sys.executable, "-m", "kvmux.commands.cli", "serve", "--frontend", frontend, "--backend", backend]
    cmd += ["--admin-endpoint", admin]
    cmd += ["--workers", str(workers), "--slabs", str(slabs), "--state-dir", str(state_dir or tmp / "state")]
    cmd += (["--model", model] if model else []) + list(serve_args)
    log_path = tmp / "serve.log"  # its tail goes into the error if the daemon fails to start
    with _terminated_as_interrupted():
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 (it only calls prctl)
                env={**os.environ, **(env or {})},
            )
        try:
            _wait_ready(proc, admin, workers, log_path)
            yield Daemon(frontend, backend, admin, proc.pid, log_path)
        finally:
            stop(proc, timeout_s=30)
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _terminated_as_interrupted() -> Iterator[None]:
    """While a daemon runs, a SIGTERM to the bench is a KeyboardInterrupt
    (Python's default is to die at once): the bench ends as it does on
    Ctrl-C (a soak stops its sessions and writes its report) and stops its
    daemons on the way out. The main thread's alone: only it receives
    signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (a daemon drains on it), then SIGKILL after `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_ready(proc: subprocess.Popen, admin: str, workers: int, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with Client(admin, timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvmux serve exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                if len(client.stats().workers) >= workers:
                    return
            except KvmuxError:
                pass
            time.sleep(0.3)
    raise TimeoutError(
        f"kvmux serve: {workers} workers not ready in {READY_TIMEOUT_S}s: {log_path.read_text()[-2000:]}"
    )
