"""Run the worker with Debian's OpenBLAS preloaded on Linux.

The `mlx[cpu]` wheel bundles a reference BLAS about 40x slower at matmul;
preloading OpenBLAS makes MLX's BLAS calls resolve to it. LD_PRELOAD only
works from process start, so the worker re-executes itself once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
