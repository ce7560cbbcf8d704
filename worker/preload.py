"""Run the worker with Debian's OpenBLAS and jemalloc preloaded on Linux.

The `mlx[cpu]` wheel bundles a reference BLAS about 40x slower at matmul;
preloading OpenBLAS makes MLX's BLAS calls resolve to it. MLX's CPU
allocator is plain malloc: a decode step's ~300 arrays are allocated on
MLX's stream thread and freed on the worker's, which glibc's allocator
serves a little slower than jemalloc: decode 1.04x on jemalloc (median
of 48 interleaved pairs of daemons, 37 in its favour, 2026-11-27; the
bench: `kvmux bench perf --only cpu`'s vs_glibc_malloc).
LD_PRELOAD only works from process start, so a worker not started by
`kvmux serve` (which preloads both) re-executes itself once.
KVMUX_NO_OPENBLAS=1 and KVMUX_NO_JEMALLOC=1 leave either out (to measure
the difference, say).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path

# The CPU kernel's threads (worker/cpu_kernel.py): kvmux serve gives each
# local worker process its share of the cores, as it does OpenBLAS's.
CPU_THREADS_ENV = "KVMUX_CPU_THREADS"

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
JEMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
)


def _installed(candidates: tuple[str, ...]) -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    return next((c for c in candidates if Path(c).exists()), None)


def openblas_path() -> str | None:
    return _installed(OPENBLAS_CANDIDATES)


def jemalloc_path() -> str | None:
    return _installed(JEMALLOC_CANDIDATES)


def worker_preloads(env: Mapping[str, str] = os.environ) -> list[str]:
    """The libraries a worker runs with preloaded (those installed and not opted out)."""
    libs = [] if env.get("KVMUX_NO_OPENBLAS") else [openblas_path()]
    libs += [] if env.get("KVMUX_NO_JEMALLOC") else [jemalloc_path()]
    return [lib for lib in libs if lib]


def with_preloads(env: dict[str, str]) -> dict[str, str]:
    """`env` with the worker's preloads first in its LD_PRELOAD."""
    asked = env.get("LD_PRELOAD", "")
    missing = [lib for lib in worker_preloads(env) if lib not in asked]
    return dict(env, LD_PRELOAD=" ".join(filter(None, [*missing, asked]))) if missing else env


def mapped(lib: str, pid: int | str = "self") -> bool:
    """Whether library `lib` (a path, or a name: libjemalloc) is mapped into
    the process (Linux), known by its name before `.so`: Debian's
    libopenblas.so.0 maps as its real file, libopenblasp-r0.3.21.so."""
    try:
        return Path(lib).name.split(".so")[0] in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def preloaded(pid: int | str = "self") -> bool:
    """Whether libopenblas is mapped into the process (Linux)."""
    return mapped("libopenblas", pid)


def ensure_preloaded() -> None:
    """Re-exec this process with the worker's preloads in LD_PRELOAD, once,
    where one is not mapped yet."""
    if all(mapped(lib) for lib in worker_preloads()):
        return
    env = with_preloads(dict(os.environ))
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return  # asked for already and still not mapped: don't loop
    os.execve(sys.executable, sys.orig_argv, env)


@cache
def blas_core() -> str:
    """The BLAS kernels matmuls run on: OpenBLAS's core name where it is
    preloaded (its kernels follow the CPU, or OPENBLAS_CORETYPE), else
    what MLX links: Accelerate on macOS, its bundled reference BLAS on
    Linux."""
    if sys.platform == "darwin":
        return "Accelerate"
    lib = openblas_path()
    if lib is None or not preloaded():
        return "reference (mlx bundled)"
    openblas = ctypes.CDLL(lib)  # already mapped: this only looks the symbol up
    openblas.openblas_get_corename.restype = ctypes.c_char_p
    return f"OpenBLAS {openblas.openblas_get_corename().decode()}"


def cpu_flags() -> list[str]:
    """The CPU's vector extensions that pick BLAS kernels (x86: avx2,
    avx512*; arm: neon, sve...), from /proc/cpuinfo where there is one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return [platform.machine()]
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith(("flags", "Features"))), []
    )
    wanted = ("avx", "fma", "neon", "asimd", "sve", "amx")
    return sorted({f for f in flags if f.startswith(wanted)})
