"""The worker processes `kvmux serve --workers N` starts next to the broker.

A worker that exits is reported, never restarted behind the operator's back
(its sessions are gone; a crash loop would hide that). On Linux each worker
gets SIGTERM if the broker process dies, so none is left orphaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvmux import logs

from .config import BrokerConfig

log = logs.get("broker")


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalWorkers:
    def __init__(self, cfg: BrokerConfig) -> None:
        self.cfg = cfg
        self.backend = ""
        self.procs: list[subprocess.Popen] = []
        self._reported: set[int] = set()

    def command(self, index: int) -> list[str]:
        cfg = self.cfg
        cmd = [sys.executable, "-m", "kvmux.cli", "worker", "--connect", self.backend, "--slabs", str(cfg.slabs)]
        cmd += ["--heartbeat-s", str(cfg.heartbeat_s), "--worker-id", f"local-{index}"]
        if cfg.model:
            cmd += ["--model", cfg.model]
        return cmd + list(cfg.worker_args)

    def env(self) -> dict[str, str]:
        """Each worker's BLAS gets its share of the cores: N pools of one
        thread per core would oversubscribe the machine N times."""
        env = dict(os.environ)
        env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, self.cfg.workers))))
        return env

    def start(self, backend: str) -> None:
        self.backend = backend
        for index in range(self.cfg.workers):
            # Own process group: Ctrl-C in the terminal reaches the broker
            # only, which then drains and stops the workers in order.
            # preexec_fn only calls prctl: no locks a thread could hold.
            cmd, env = self.command(index), self.env()
            proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509
            self.procs.append(proc)
            log.info("local_worker_started", index=index, pid=proc.pid)

    def check(self) -> None:
        """Report (once) each worker that has exited."""
        for index, proc in enumerate(self.procs):
            if proc.pid not in self._reported and proc.poll() is not None:
                self._reported.add(proc.pid)
                log.error("local_worker_exited", index=index, pid=proc.pid, returncode=proc.returncode)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (workers drain), then SIGKILL whatever is left at the deadline."""
        alive = [p for p in self.procs if p.poll() is None]
        for proc in alive:
            proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in alive:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("local_worker_killed", pid=proc.pid)
                proc.kill()
                proc.wait()
        self._reported.update(p.pid for p in self.procs)
