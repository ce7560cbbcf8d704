"""A bench that dies takes the daemon it spawned (`--spawn`) with it: a
SIGTERM (a timeout, a CI cancel) ends the bench as Ctrl-C does, and it
stops its daemon on the way out; a SIGKILL leaves the daemon its
parent-death signal. Real bench processes (`kvmux bench soak --spawn`),
each with its real daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import STARTUP_TIMEOUT_S, children, kvmux_command

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)


def bench(out: Path) -> subprocess.Popen:
    """A soak that would run for ten minutes on a daemon of its own; its
    output beside its report."""
    args = ["--turns", "0", "--duration-s", "600", "--max-tokens", "4", "--window", "64", "--checkpoint-s", "1"]
    cmd = kvmux_command("bench", "soak", "--spawn", *args, "--no-progress", "--output", str(out))
    with open(out.with_suffix(".log"), "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def turns(report: Path) -> int:
    """The turns a soak's report holds so far."""
    try:
        return len(json.loads(report.read_text())["turns"])
    except (OSError, ValueError):  # not written yet, or being written
        return 0


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_bench_that_dies_takes_its_daemon_with_it(tmp_path):
    benches = {sig: bench(tmp_path / f"{sig.name}.json") for sig in (signal.SIGTERM, signal.SIGKILL)}
    daemons: dict[signal.Signals, list[int]] = {}
    try:
        deadline = time.monotonic() + 2 * STARTUP_TIMEOUT_S
        while not all(turns(tmp_path / f"{sig.name}.json") for sig in benches):
            assert time.monotonic() < deadline and all(b.poll() is None for b in benches.values())
            time.sleep(0.5)
        for sig, proc in benches.items():
            serve = children(proc.pid)
            daemons[sig] = serve + [worker for pid in serve for worker in children(pid)]
            assert len(daemons[sig]) == 2, daemons  # kvmux serve and its worker
            proc.send_signal(sig)
        assert benches[signal.SIGTERM].wait(60) >= 0  # ended as on Ctrl-C, its daemon stopped on the way out
        assert benches[signal.SIGKILL].wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 60
        while any(alive(pid) for pids in daemons.values() for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pids in daemons.values() for pid in pids if alive(pid)], daemons
    finally:  # whatever failed, leave no process behind
        for pid in [*(b.pid for b in benches.values()), *(pid for pids in daemons.values() for pid in pids)]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for proc in benches.values():
            proc.wait()
