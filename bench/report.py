"""One JSON report per bench run, rewritten atomically (temp file in the same
folder, fsync, rename) at checkpoints, so a run that is interrupted or killed
keeps the evidence gathered up to its last checkpoint and a reader never sees
half a file."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = 1


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it 0600; a report is for everyone to read
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def machine() -> dict:
    """What the numbers depend on: CPU, memory, OS, library versions, and
    whether OpenBLAS is preloaded into this process (the worker's is in the
    worker's own report fields)."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu_model"] = names[0] if names else None
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except OSError:  # not Linux
        pass
    info["versions"] = {}
    for dist in ("kvmux", "mlx", "mlx-lm", "pyzmq", "msgspec", "transformers", "torch"):
        try:
            info["versions"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    info["openblas_num_threads"] = os.environ.get("OPENBLAS_NUM_THREADS")
    # What picks the matmul kernels, and so decides speed and padding
    # (worker/padding.py): the CPU's vector extensions and the BLAS core.
    from kvmux.worker.preload import blas_core, cpu_flags

    info["cpu_flags"] = cpu_flags()
    info["openblas_coretype"] = os.environ.get("OPENBLAS_CORETYPE")
    info["blas"] = blas_core()
    info["cpu_kernel"] = _cpu_kernel()
    return info


def _cpu_kernel() -> str:
    """What multiplies quantized weights on this CPU (worker/cpu_kernel.py), as asked."""
    asked = os.environ.get("KVMUX_CPU_KERNEL", "auto")
    try:
        import kvmux_native
    except ImportError as exc:
        return f"none ({exc})"
    isa = kvmux_native.isas()[0] if asked == "auto" else asked
    return f"kvmux_native {isa} (asked: {asked}; this CPU runs {', '.join(kvmux_native.isas())})"


class ReportWriter:
    """Holds the report document; `checkpoint()` rewrites the file when
    `every_s` has passed since the last write, `write()` always does."""

    def __init__(self, path: Path, bench: str, config: dict, every_s: float = 10.0, prepare=None):
        self.path = Path(path)
        self.every_s = every_s
        self.prepare = prepare  # called before each write (to refresh a summary, say)
        self._started = time.monotonic()
        self._last_write: float | None = None  # the first checkpoint is always due
        self.doc: dict[str, Any] = {
            "bench": bench,
            "schema": SCHEMA,
            "status": "running",
            "created": now_iso(),
            "updated": None,
            "elapsed_s": 0.0,
            "command": sys.argv,
            "machine": machine(),
            "config": config,
        }

    def write(self, status: str | None = None) -> None:
        if status is not None:
            self.doc["status"] = status
        if self.prepare is not None:
            self.prepare()
        self.doc["updated"] = now_iso()
        self.doc["elapsed_s"] = round(self.elapsed(), 3)
        write_json_atomic(self.path, self.doc)
        self._last_write = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def checkpoint(self) -> bool:
        if self._last_write is not None and time.monotonic() - self._last_write < self.every_s:
            return False
        self.write()
        return True


def rss_kb(pid: int) -> int:
    """A process's resident memory (VmRSS) in KiB; 0 once it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), None for no values."""
    import numpy as np

    arr = np.asarray(list(values), dtype=float)
    return float(np.percentile(arr, q)) if arr.size else None


def latency_summary(samples_ms: list[float]) -> dict:
    """Count, p50 and p99 of latencies in milliseconds."""
    return {
        "n": len(samples_ms),
        "p50_ms": round(percentile(samples_ms, 50), 3),
        "p99_ms": round(percentile(samples_ms, 99), 3),
    }


def ratio_summary(pairs: list[tuple[float, float]]) -> dict:
    """Median, min and max of b/a over interleaved (a, b) measurements."""
    ratios = [b / a for a, b in pairs]
    return {
        "median": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
        "a": [round(a, 4) for a, _ in pairs],
        "b": [round(b, 4) for _, b in pairs],
    }
