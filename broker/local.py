"""The worker processes `kvmux serve --workers N` starts and supervises;
with `--pipeline N` each worker is a group of N processes (ranks,
worker/group.py) on this host, started with the environment mlx.launch
gives the ring backend, and supervised as one: when any rank exits, the
others are killed and the group counts one exit.

A worker that exits abnormally is restarted with backoff: 1 s, doubling to
60 s for each further crash within CRASH_WINDOW_S; its sessions wait in the
session store and come back on their next call. After CRASH_LIMIT crashes
within CRASH_WINDOW_S the daemon gives up and exits non-zero, so launchd's
KeepAlive (or systemd) restarts it and the operator sees it. On Linux each
worker gets SIGTERM if the broker process dies, so none is left orphaned."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvmux import logs, settings
from kvmux.children import die_with_parent
from kvmux.worker.preload import CPU_THREADS_ENV, with_preloads

from .auth import Auth
from .config import BrokerConfig
from .declared import Declared

log = logs.get("broker")

BACKOFF_S = (1.0, 60.0)  # the first restart's delay, and the most it doubles to
CRASH_LIMIT = 5
CRASH_WINDOW_S = 300.0


@dataclass
class _Slot:
    """One local worker: its processes (rank 0 first), and when it may be
    started again."""

    index: int
    model: Declared
    procs: list[subprocess.Popen] = field(default_factory=list)
    hostfile: str | None = None  # a group's ring hostfile
    restart_at: float | None = None
    crashes: deque[float] = field(default_factory=deque)
    unloading: bool = False  # stopped for its model's unload: its exit is no crash, and it is not restarted

    def exited(self) -> int | None:
        """The worker's exit code once any of its processes has exited
        (rank 0's where it has, else 1: a rank lost takes the group down);
        the others are killed then. None while all run."""
        codes = [proc.poll() for proc in self.procs]
        if all(code is None for code in codes):
            return None
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if self.hostfile:
            Path(self.hostfile).unlink(missing_ok=True)
        return codes[0] if codes[0] is not None else 1


def _ring_hosts(ranks: int) -> str:
    """A hostfile for a ring of `ranks` on this host (as mlx.launch writes
    one): free loopback ports, one per rank."""
    ports = []
    for _ in range(ranks):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    fd, path = tempfile.mkstemp(prefix="kvmux-ring-", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump([[f"127.0.0.1:{port}"] for port in ports], out)
    return path


class LocalWorkers:
    def __init__(self, cfg: BrokerConfig, models: list[Declared], auth: Auth | None = None) -> None:
        self.cfg = cfg
        self.auth = auth  # with CURVE on a tcp backend, the workers' key pair
        self.backend = ""
        # `workers` of each declared model
        self.slots = [_Slot(i, models[i // cfg.workers]) for i in range(cfg.workers * len(models))]
        self.stopping = False

    def command(self, slot: _Slot) -> list[str]:
        """`kvmux worker` with the daemon's WorkerSettings, its model's settings
        over them, then its worker_args (which win)."""
        cfg = self.cfg
        cmd = [sys.executable, "-m", "kvmux.commands.cli", "worker", "--connect", self.backend]
        cmd += ["--worker-id", f"local-{slot.index}"]
        for setting in settings.declared(settings.WorkerSettings):
            cmd += setting.argv(getattr(cfg, setting.name))
        return cmd + slot.model.worker_argv() + list(cfg.worker_args)

    def env(self) -> dict[str, str]:
        """Each worker's BLAS and CPU kernel get its share of the cores: N pools of one
        thread per core would oversubscribe the machine N times. OpenBLAS and
        jemalloc are preloaded here, with the heap's huge pages asked for
        (worker/preload.py), so the worker need not re-execute itself to
        get them."""
        env = dict(os.environ)
        processes = max(1, sum(s.model.spec.pipeline or self.cfg.pipeline for s in self.slots))
        share = str(max(1, (os.cpu_count() or 1) // processes))
        env.setdefault("OPENBLAS_NUM_THREADS", share)
        env.setdefault(CPU_THREADS_ENV, share)
        env = with_preloads(env)
        if self.auth is not None and self.backend.startswith("tcp://"):
            env.update(self.auth.worker_env())
        return env

    def start(self, backend: str) -> None:
        """Where its workers will connect; broker/models.py loads their models."""
        self.backend = backend

    def _of(self, model_id: str) -> list[_Slot]:
        return [slot for slot in self.slots if slot.model.model_id == model_id]

    def load(self, model_id: str) -> None:
        """Start its model's workers that do not run."""
        for slot in self._of(model_id):
            if not slot.procs and not self.stopping:
                slot.unloading = False
                self._spawn(slot)

    def unload(self, model_id: str) -> None:
        """SIGTERM its model's workers: they snapshot their sessions (which
        hibernate) and exit, not restarted until it is loaded again."""
        for slot in self._of(model_id):
            slot.unloading, slot.restart_at = True, None
            if slot.procs and slot.procs[0].poll() is None:
                slot.procs[0].terminate()

    def running(self, model_id: str) -> bool:
        """Its model's workers run, or will again after a crash's backoff."""
        return any(slot.procs or slot.restart_at is not None for slot in self._of(model_id))

    def unloading(self, model_id: str) -> bool:
        return any(slot.unloading and slot.procs for slot in self._of(model_id))

    def pids(self, model_id: str) -> list[int]:
        return [proc.pid for slot in self._of(model_id) for proc in slot.procs if proc.poll() is None]

    def _spawn(self, slot: _Slot) -> None:
        # Own process group: Ctrl-C in the terminal reaches the broker only,
        # which then drains and stops the workers in order. preexec_fn only
        # calls prctl: no locks a thread could hold.
        cmd, env = self.command(slot), self.env()
        ranks = slot.model.spec.pipeline or self.cfg.pipeline
        if ranks > 1:
            env["MLX_HOSTFILE"] = slot.hostfile = _ring_hosts(ranks)
        slot.procs = []
        for rank in range(ranks):
            if ranks > 1:
                env["MLX_RANK"] = str(rank)
            slot.procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent))  # noqa: PLW1509
        slot.restart_at = None
        log.info("local_worker_started", index=slot.index, model=slot.model.model_id, pids=[p.pid for p in slot.procs])

    def check(self) -> bool:
        """Restart workers that exited, when their backoff allows; False once
        one has crashed too often (the daemon should exit)."""
        now = time.monotonic()
        for slot in self.slots:
            code = slot.exited() if slot.procs and not self.stopping else None
            if code is not None:
                slot.procs = []
                if slot.unloading:
                    log.info("local_worker_unloaded", index=slot.index, model=slot.model.model_id, returncode=code)
                    continue
                if code == 0:  # it drained on its own (SIGTERM to it alone): not a crash
                    log.warning("local_worker_stopped", index=slot.index)
                    continue
                if code == 2:  # its model or draft model was refused: restarting cannot help
                    log.error("local_worker_refused_model", index=slot.index)
                    return False
                slot.crashes.append(now)
                while slot.crashes and now - slot.crashes[0] > CRASH_WINDOW_S:
                    slot.crashes.popleft()
                if len(slot.crashes) >= CRASH_LIMIT:
                    crashes = len(slot.crashes)
                    log.error("local_worker_crash_loop", index=slot.index, returncode=code, crashes=crashes)
                    return False
                # Counted within the window: a worker that crashed long ago
                # starts again at the first delay.
                delay = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (len(slot.crashes) - 1))
                slot.restart_at = now + delay
                log.error("local_worker_exited", index=slot.index, returncode=code, restart_in_s=delay)
            if not slot.procs and slot.restart_at is not None and now >= slot.restart_at:
                log.warning("local_worker_restart", index=slot.index, crashes=len(slot.crashes))
                self._spawn(slot)
        return True

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (workers drain and snapshot their sessions; a group's rank
        0 then stops its other ranks), then SIGKILL whatever is left at the
        deadline."""
        self.stopping = True
        alive = [proc for s in self.slots for proc in s.procs if proc.poll() is None]
        for slot in self.slots:
            if slot.procs and slot.procs[0].poll() is None:
                slot.procs[0].terminate()
        deadline = time.monotonic() + timeout_s
        for proc in alive:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("local_worker_killed", pid=proc.pid)
                proc.kill()
                proc.wait()
        for slot in self.slots:
            if slot.hostfile:
                Path(slot.hostfile).unlink(missing_ok=True)
