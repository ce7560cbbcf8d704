"""Graceful drain: on SIGTERM running generations finish or are cancelled
within the grace period, new opens get `draining`, the broker exits 0; the
DRAIN op (`kvmux drain`) does the same for `kvmux serve` and its local
workers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import STARTUP_TIMEOUT_S, broker_stats, kvmux_command

from kvmux.client import Client, Forbidden, Overloaded
from kvmux.worker.preload import huge_pages_mb, mapped, thp_defrag, thp_mode, worker_preloads

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)

GRACE_S = 2.0


def test_sigterm_during_three_generations(stack_factory):
    stack = stack_factory(workers=1, slabs=4, broker_args=["--drain-grace-s", str(GRACE_S)])
    results: dict[int, object] = {}
    started = threading.Barrier(4)

    def chat(i: int, max_tokens: int) -> None:
        with Client(stack.frontend, timeout=30) as client:
            session = client.open_session(system="Be brief.")
            stream = session.chat("Tell me a long story about the sea.", max_tokens=max_tokens)
            first = next(stream)
            started.wait(60)
            chunks = [first, *stream]
            results[i] = (sum(len(c.token_ids) for c in chunks), stream.result, time.monotonic())

    threads = [
        threading.Thread(target=chat, args=(i, n)) for i, n in enumerate((2, 1024, 1024))
    ]  # the long ones outlast the grace, however fast the worker decodes
    for thread in threads:
        thread.start()
    started.wait(60)
    stack.broker.send_signal(signal.SIGTERM)
    term = time.monotonic()
    with Client(stack.frontend, timeout=10) as client:
        with pytest.raises(Overloaded) as refused:
            client.open_session()
        assert refused.value.reason == "draining"
        assert client.stats().draining
    for thread in threads:
        thread.join(60)
    assert stack.broker.wait(30) == 0
    assert len(results) == 3
    for tokens, result, ended in results.values():
        assert result.stop_reason in ("max_tokens", "eos", "cancelled")
        assert tokens == result.completion_tokens
        # within the grace period, plus the cancel reaching a token boundary
        # (three sessions share two busy cores here)
        assert ended - term < GRACE_S + 5, (ended - term, result)
    assert [r.stop_reason for _, r, _ in results.values()].count("cancelled") >= 1


def test_serve_with_local_workers_drains_on_the_drain_op():
    runtime = Path(tempfile.mkdtemp(prefix="kvmux-s-", dir="/tmp"))  # short: ipc paths are limited
    rt = runtime / "rt"
    rt.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(rt / "frontend.ipc"))  # left behind by a dead broker
    stale.close()
    env = {**os.environ, "KVMUX_RUNTIME_DIR": str(rt)}
    env.pop("KVMUX_ENDPOINT", None)
    env.pop("KVMUX_BACKEND", None)
    endpoint = f"ipc://{rt}/frontend.ipc"
    with open(runtime / "serve.log", "wb") as log:
        serve = subprocess.Popen(
            kvmux_command("serve", "--workers", "1", "--slabs", "1"), env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (stats := broker_stats(endpoint, 1.0)) is None or not stats.workers:
            assert serve.poll() is None and time.monotonic() < deadline, (runtime / "serve.log").read_text()
            time.sleep(0.2)
        worker_pid = stats.workers[0].pid
        assert stats.workers[0].worker_id == "local-0"
        preloads = worker_preloads()  # serve's own: the worker does not re-execute
        assert all(mapped(lib, worker_pid) for lib in preloads), preloads
        if not os.environ.get("KVMUX_NO_HUGE_PAGES"):  # its allocator's switch for huge pages, and the pages
            environ = Path(f"/proc/{worker_pid}/environ").read_bytes().split(b"\0")
            assert any(e.startswith((b"MALLOC_CONF=", b"GLIBC_TUNABLES=")) for e in environ)
            if thp_mode() in ("always", "madvise") and thp_defrag() != "never":  # given at the fault
                assert huge_pages_mb(worker_pid), (runtime / "serve.log").read_text()
        assert stat.S_IMODE(rt.stat().st_mode) == 0o700

        with Client(endpoint, timeout=10) as client:
            session = client.open_session()
            with pytest.raises(Forbidden):
                client.drain()  # a client is not admin, even on the same user's ipc
            assert list(session.chat("Say hi.", max_tokens=2))  # and the daemon keeps serving
            done = subprocess.run(  # the admin endpoint in the runtime dir
                kvmux_command("drain", "--grace-s", "1"), env=env, capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 0 and "draining" in done.stdout, done.stderr
            assert serve.wait(30) == 0
            session.closed = True  # its broker is gone: nothing to close
        with pytest.raises(ProcessLookupError):
            os.kill(worker_pid, 0)  # the local worker was stopped (and reaped)
        assert not any((rt / name).exists() for name in ("frontend.ipc", "backend.ipc", "admin.ipc"))
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        shutil.rmtree(runtime, ignore_errors=True)
