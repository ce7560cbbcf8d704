"""Which of the models a daemon declares (declared.py) are resident.
Knowing them before any worker registers, the broker refuses a model it
will never have and waits for one whose workers are starting.

A declared model is loaded (its local workers started) when a session
asks for it, and unloaded (its workers stopped with SIGTERM: they snapshot
their sessions, which hibernate and come back on their next call) once
idle for `idle_unload_s`, or when another must load and the machine's
memory budget (`max_resident_bytes`) holds both: the least recently used
first, never a pinned one nor one running requests."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

from kvmux import logs
from kvmux.protocol import ErrorCode, ModelState, ModelStats, ProtocolError

from .config import BrokerConfig
from .declared import Declared, declare

if TYPE_CHECKING:
    from .admission import Admission
    from .local import LocalWorkers
    from .registry import Registry

log = logs.get("broker")

MARGIN = 0.2  # the default budget leaves this share of the machine's memory (at least 1 GiB) to everything else


def machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget() -> int:
    total = machine_bytes()
    return total - max(1 << 30, int(total * MARGIN))


def rss_bytes(pid: int) -> int:
    """A process's resident memory (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except FileNotFoundError:
        if sys.platform == "linux":
            return 0
    except (OSError, ValueError, IndexError):
        return 0
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, check=False)
    return int(out.stdout.strip() or 0) * 1024


class Models:
    """The declared models and which are resident; `local` (the daemon's
    LocalWorkers, set by `kvmux serve`) loads and unloads them."""

    def __init__(self, cfg: BrokerConfig) -> None:
        self.cfg = cfg
        self.declared = declare(cfg)
        self.ids = {name: d.model_id for d in self.declared for name in d.names}
        self.local: LocalWorkers | None = None
        self.last_used: dict[str, float] = {}
        self.rss: dict[str, int] = {}  # its workers' resident bytes now (at the last sweep)
        self.measured: dict[str, int] = {}  # the most they held: what loading it again will take
        self.loading_at: dict[str, float] = {}
        self.leaving: dict[str, tuple[float, int]] = {}  # unloading: since when, and the bytes it held
        self.loads = self.unloads = 0

    def start(self, local: LocalWorkers, now: float) -> None:
        """The daemon's start: its models in order while the budget holds them (the default always)."""
        self.local = local
        held = 0
        for d in self.declared:
            if d is self.declared[0] or held + d.estimate() <= self.budget:
                held += d.estimate()
                self._load(d, now)

    def _load(self, d: Declared, now: float) -> None:
        self.local.load(d.model_id)
        self.loads += 1
        self.last_used[d.model_id] = self.loading_at[d.model_id] = now
        log.info("model_loading", model=d.model_id, estimate_bytes=self._bytes(d), budget_bytes=self.budget)

    def registered(self, model_id: str, now: float) -> None:
        """A worker of `model_id` registered: loaded, if it was loading. Its
        idle time counts from here, not from the load's start (a load
        longer than idle_unload_s unloaded the model as it became ready)."""
        since = self.loading_at.pop(model_id, None)
        if since is not None:
            self.last_used[model_id] = now
            log.info("model_ready", model=model_id, seconds=round(now - since, 3))

    @property
    def budget(self) -> int:
        return self.cfg.max_resident_bytes or default_budget()

    def of(self, model_id: str | None) -> Declared | None:
        return next((d for d in self.declared if d.model_id == model_id), None)

    def known(self, registry: Registry) -> list[str]:
        """Its declared models' ids (the default first), then those only its
        registered workers run."""
        return list(dict.fromkeys([*(d.model_id for d in self.declared), *registry.models()]))

    def resolve(self, named: str | None, registry: Registry) -> str | None:
        """The model an OPEN runs on: the one it names (by id or alias),
        else the daemon's default (its first declared model, else its first
        worker's); None while it knows none (the first worker to register
        runs it). One it neither declares nor has a worker of is refused."""
        known = self.known(registry)
        if named is None:
            return next(iter(known), None)
        model_id = self.ids.get(named, named)
        if model_id in known:
            return model_id
        have = ", ".join(known) or "none: no worker is registered"
        raise ProtocolError(ErrorCode.MODEL_NOT_FOUND, f"this daemon has no model {named!r} (it has {have})")

    def starting(self, model_id: str | None) -> bool:
        """Whether an open of `model_id` should wait for a worker that is not
        registered yet: one of the daemon's own (declared) models."""
        return bool(self.declared) and (model_id is None or self.of(model_id) is not None)

    def state(self, model_id: str, registry: Registry) -> ModelState:
        if any(w.runs(model_id) for w in registry.workers.values()):
            return ModelState.RESIDENT
        if self.local is not None and self.local.running(model_id):
            return ModelState.LOADING
        return ModelState.UNLOADED

    def stats(self, registry: Registry, now: float) -> list[ModelStats]:
        out = []
        for i, model_id in enumerate(self.known(registry)):
            declared = self.of(model_id)
            used = self.last_used.get(model_id)
            out.append(
                ModelStats(
                    model=model_id,
                    aliases=sorted(declared.names - {model_id}) if declared else [],
                    state=self.state(model_id, registry).value,
                    workers=sum(1 for w in registry.workers.values() if w.runs(model_id)),
                    default=i == 0,
                    pinned=bool(declared and declared.spec.pinned),
                    resident_bytes=self.rss.get(model_id, 0),
                    idle_s=round(now - used, 3) if used is not None else 0.0,
                )
            )
        return out

    def touch(self, model_id: str | None, now: float) -> None:
        if model_id is not None:
            self.last_used[model_id] = now

    # ------------------------------------------------- loading and unloading

    def _busy(self, model_id: str, registry: Registry, admission: Admission) -> bool:
        """Running or waiting work of it: never unloaded under that."""
        in_flight = any(r.worker.runs(model_id) for r in registry.requests.values())
        return in_flight or any(p.model == model_id for p in admission.queue)

    def _resident(self) -> list[Declared]:
        """Those whose local workers run (registered or loading)."""
        return [d for d in self.declared if self.local is not None and self.local.running(d.model_id)]

    def _bytes(self, d: Declared) -> int:
        return self.rss.get(d.model_id) or self.measured.get(d.model_id) or d.estimate()

    def want(self, model_id: str | None, now: float, registry: Registry, admission: Admission) -> None:
        """An open or a restore waits for `model_id`: load it if it is not,
        first unloading the least recently used models the budget needs
        gone (it waits for them to exit; the next tick tries again)."""
        declared = self.of(model_id)
        if declared is None or self.local is None:
            return
        self._settle(now)
        if self.local.running(model_id):
            return
        resident = self._resident()
        need = sum(self._bytes(d) for d in resident) + self._bytes(declared) - self.budget
        if need > 0 and resident:  # alone, a model loads whatever the budget: it is the least the daemon serves
            going = [d for d in resident if self.local.unloading(d.model_id)]
            need -= sum(self._bytes(d) for d in going)
            victims = sorted(
                (
                    d
                    for d in resident
                    if d not in going and not d.spec.pinned and not self._busy(d.model_id, registry, admission)
                ),
                key=lambda d: self.last_used.get(d.model_id, 0.0),
            )
            for victim in victims:
                if need <= 0:
                    break
                self.unload(victim, "budget", now, registry)
                need -= self._bytes(victim)
            return  # loaded once those leaving have exited (or never, if they cannot leave: the queue times out)
        self._load(declared, now)

    def unload(self, declared: Declared, why: str, now: float, registry: Registry) -> None:
        """SIGTERM its workers, marked draining at once: no call reaches
        them from now on (one would be refused as the worker drains)."""
        pids = set(self.local.pids(declared.model_id))
        for w in registry.workers.values():
            if w.runs(declared.model_id) and w.ready.pid in pids:
                w.draining = True
        self.local.unload(declared.model_id)
        self.unloads += 1
        idle = round(now - self.last_used.get(declared.model_id, now), 1)
        rss = self.rss.get(declared.model_id, 0)
        self.leaving[declared.model_id] = (now, rss)
        log.info("model_unloading", model=declared.model_id, why=why, idle_s=idle, rss_bytes=rss)

    def _settle(self, now: float) -> None:
        """Unloads whose workers have exited: their memory is free."""
        for model_id, (since, rss) in list(self.leaving.items()):
            if not self.local.running(model_id):
                del self.leaving[model_id]
                log.info("model_unloaded", model=model_id, freed_bytes=rss, seconds=round(now - since, 3))

    def sweep(self, now: float, registry: Registry, admission: Admission) -> None:
        """Once a second: measure the resident models, unload the idle ones,
        and load what the queue waits for."""
        if self.local is None:
            return
        self._settle(now)
        for d in self.declared:
            rss = sum(rss_bytes(pid) for pid in self.local.pids(d.model_id))
            self.rss[d.model_id] = rss
            if d.model_id not in self.loading_at:  # loaded: what it holds is what it takes
                self.measured[d.model_id] = max(rss, self.measured.get(d.model_id, 0))
        limit = self.cfg.idle_unload_s
        for d in self._resident() if limit else ():
            idle = now - self.last_used.get(d.model_id, now)
            if (
                idle > limit
                and not d.spec.pinned
                and not self.local.unloading(d.model_id)
                and not self._busy(d.model_id, registry, admission)
                and any(w.runs(d.model_id) for w in registry.workers.values())
            ):
                self.unload(d, "idle", now, registry)
        for model_id in dict.fromkeys(p.model for p in admission.queue):
            if not any(w.runs(model_id) for w in registry.workers.values()):
                self.want(model_id, now, registry, admission)
