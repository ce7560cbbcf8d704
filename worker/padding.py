"""Whether a worker makes its passes row-invariant, decided at start from
what that costs on the kernels it runs.

`forward.calibrate` finds what makes a decode row's logits independent of
what else is in its pass, bit for bit. What it costs depends on the BLAS
kernels alone: on OpenBLAS's AVX-512 kernels, padding each product to a few
rows (its floors); on its AVX2 (Haswell) kernels a row's bits depend on
where it sits in the product, which no padding mends, so decode rows run
their products one row at a time (`rows_alone`: a shared pass of B
sessions then reads the weights B times, and loses what sharing gains).

- Default mode: row-invariant only where that costs at most `BUDGET`,
  measured here at start: a lone session's decode step padded against
  plain (padding), or a pass of `ROWS` decode rows one by one against
  together (rows alone, which is never that cheap). Otherwise passes run
  as they come: a session's tokens in a shared or speculative pass equal
  its tokens alone, or part from them only at a near tie (rounding moves a
  logit by ~1e-4; docs/design.md, "Batch invariance").
- Batch-invariant mode (`--batch-invariant`, vLLM's name): always
  row-invariant; bit-identical whatever the pass, at whatever it costs here.

The floors and their cost are remembered on disk per model, kernels,
threads and CPU (`decide`): measuring takes seconds, and a worker
restarted after a crash should serve again at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import msgspec
from mlx import nn

from kvmux import logs, paths
from kvmux.protocol import Compute
from kvmux.sessions.files import atomic_write

from . import forward
from .cpu_kernel import Kernel
from .preload import blas_core, cpu_flags
from .slab import SlabCache, rewind

log = logs.get("worker.padding")

BUDGET = 0.05  # the most a padded decode step may cost over a plain one in the default mode
HISTORY = 256  # tokens in the slab the measured steps attend over
STEPS = 2  # decode steps per side of a measured pair
PAIRS = 5  # interleaved pairs (plain, padded) at most; their median ratio decides
AGREE = 3  # ...or the first pairs, once this many all fall on one side of the budget
FAR = 2.0  # ...or the first pairs, once all cost more than this
ROWS = 8  # decode rows in the pass measured where rows go alone (8 sessions, or a verify pass)
DECISION_VERSION = 1  # of how floors are calibrated and their cost measured: a change forgets remembered ones


@dataclass
class Padding:
    floors: forward.Floors  # how each projection's products run
    calibrated: forward.Floors  # what makes them row-invariant (the batch-invariant mode's floors)
    exact: bool  # decode rows bit-identical whatever shares their pass
    cost: float  # that invariance's time over plain passes', measured (1.0: nothing to do)
    batch_invariant: bool  # the mode asked for
    seconds: float = 0.0  # what calibrating and measuring took


def decide(
    model: nn.Module,
    most_rows: int,
    batch_invariant: bool,
    make_slab: Callable[[], list[SlabCache]],
    model_key: str = "",
) -> Padding:
    """Calibrate the floors and measure what they cost, then keep them where
    the mode or their cost says so; `make_slab` gives a slab to measure on
    (with spare slots: each measured pass is taken back). Both are
    remembered on disk for `model_key` (the model and how the worker splits
    it) on these kernels, threads and CPU: a worker started again (a
    restart after a crash) decides at once instead of in seconds."""
    started = time.perf_counter()
    path = _remembered_at(model_key, most_rows)
    try:
        known = msgspec.json.decode(path.read_bytes(), type=_Measured)
    except (OSError, msgspec.DecodeError, ValueError):
        known = None
    remembered = known is not None
    if known is None:
        floors = forward.calibrate(model, most_rows)
        cost = 1.0 if floors == forward.Floors() else measure_cost(model, floors, make_slab())
        known = _Measured(dataclasses.asdict(floors), round(cost, 3))
        _remember(path, known)
    floors = forward.Floors(**known.floors)
    exact = batch_invariant or floors == forward.Floors() or (not floors.rows_alone and known.cost <= 1 + BUDGET)
    padding = Padding(floors if exact else forward.Floors(), floors, exact, known.cost, batch_invariant)
    padding.seconds = round(time.perf_counter() - started, 3)
    log.info(
        "padding_decided",
        mode="batch-invariant" if batch_invariant else "default",
        exact=padding.exact,
        cost=padding.cost,
        blas=blas_core(),
        seconds=padding.seconds,
        remembered=remembered,
        **{f"floor_{name}": rows for name, rows in known.floors.items()},
    )
    return padding


class _Measured(msgspec.Struct, array_like=True):
    floors: dict[str, int | bool]  # forward.Floors' fields
    cost: float


def _remembered_at(model_key: str, most_rows: int) -> Path:
    """Where a decision is kept: named for everything it depends on."""
    what = [model_key, most_rows, blas_core(), os.environ.get("OPENBLAS_NUM_THREADS"), os.cpu_count()]
    what += [mx.__version__, str(mx.default_device()), platform.processor(), *cpu_flags(), DECISION_VERSION]
    digest = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]
    return paths.cache_dir() / "padding" / f"{digest}.json"


def _remember(path: Path, known: _Measured) -> None:
    with contextlib.suppress(OSError):  # a read-only home: decided again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, msgspec.json.encode(known))


def measure_cost(model: nn.Module, floors: forward.Floors, slab: list[SlabCache]) -> float:
    """Median time of an invariant pass over a plain one, in interleaved
    pairs over a slab of `HISTORY` tokens (each pass is taken back): a
    lone decode step where floors pad, `ROWS` decode rows where rows go
    alone; ~1 s."""
    forward.forward(model, [forward.Segment(mx.arange(HISTORY) % 1000 + 100, slab)], forward.Floors())
    mx.eval([c.keys for c in slab])
    rows = ROWS if floors.rows_alone else 1

    def steps(pad: forward.Floors) -> float:
        start = time.perf_counter()
        for i in range(STEPS):
            tokens = mx.arange(rows) + 200 + i
            mx.eval(forward.forward(model, [forward.Segment(tokens, slab, True)], pad)[0])
            rewind(slab, rows)
        return time.perf_counter() - start

    steps(forward.Floors()), steps(floors)  # warm both shapes
    ratios: list[float] = []
    for _ in range(PAIRS):
        plain = steps(forward.Floors())
        ratios.append(steps(floors) / plain)
        if min(ratios) > FAR or (len(ratios) >= AGREE and len({r <= 1 + BUDGET for r in ratios}) == 1):
            break
    return statistics.median(ratios)


def compute_info(device: str, padding: Padding | None, layout: str = "", kernel: Kernel | None = None) -> Compute:
    """What decides this worker's speed and exactness, for READY and stats
    (`padding` None: the model runs one session per pass, nothing padded;
    `layout`: a worker group's split of the model; `kernel`: what
    multiplies its quantized weights on a CPU)."""
    floors = dataclasses.asdict(padding.calibrated) if padding else {}
    return Compute(
        device=device,
        blas=blas_core() if "cpu" in device else "",  # a GPU's products are its own kernels
        mode="batch-invariant" if padding and padding.batch_invariant else "default",
        exact=padding.exact if padding else True,
        floors={name: rows for name, rows in floors.items() if name != "rows_alone" and rows > 1},
        rows_alone=padding.calibrated.rows_alone if padding else False,
        pad_cost=padding.cost if padding else 1.0,
        calibrate_s=padding.seconds if padding else 0.0,
        layout=layout,
        kernel=kernel.describe() if kernel and "cpu" in device else "",
    )
