"""Run the worker with Debian's OpenBLAS preloaded on Linux.

The `mlx[cpu]` wheel bundles a reference BLAS about 40x slower at matmul;
preloading OpenBLAS makes MLX's BLAS calls resolve to it. LD_PRELOAD only
works from process start, so the worker re-executes itself once.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from functools import cache
from pathlib import Path

# The CPU kernel's threads (worker/cpu_kernel.py): kvmux serve gives each
# local worker process its share of the cores, as it does OpenBLAS's.
CPU_THREADS_ENV = "KVMUX_CPU_THREADS"

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def openblas_path() -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    return next((c for c in CANDIDATES if Path(c).exists()), None)


def preloaded(pid: int | str = "self") -> bool:
    """Whether libopenblas is mapped into the process (Linux)."""
    try:
        return "libopenblas" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def ensure_preloaded() -> None:
    """Re-exec this process with OpenBLAS in LD_PRELOAD, once, where it helps.
    KVMUX_NO_OPENBLAS=1 opts out (to measure the difference, say)."""
    lib = openblas_path()
    if lib is None or os.environ.get("KVMUX_NO_OPENBLAS") or preloaded():
        return
    if lib in os.environ.get("LD_PRELOAD", ""):
        return  # asked for already and still not mapped: don't loop
    env = dict(os.environ, LD_PRELOAD=" ".join(filter(None, [lib, os.environ.get("LD_PRELOAD")])))
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
