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

The worker's heap goes in transparent huge pages, asked for by its
allocator's own switch (JEMALLOC_HUGE_PAGES, or GLIBC_HUGE_PAGES where
glibc's malloc serves it: madvise either way): a decode step streams
~100 MB of weights and, at a full window, ~50 MB of keys and values, and
on 4 KB pages the TLB misses every 4 KB of it (bench perf --only cpu's
vs_small_pages). Where the kernel's THP mode is "never" the switch does
nothing; a MALLOC_CONF or GLIBC_TUNABLES already set is left as it is.

KVMUX_NO_OPENBLAS=1, KVMUX_NO_JEMALLOC=1 and KVMUX_NO_HUGE_PAGES=1 leave
each out (to measure the difference, say).
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


# Read at process start, like LD_PRELOAD: jemalloc's switch, and glibc's
# where its malloc serves the worker, for madvise(MADV_HUGEPAGE) on the
# memory they map.
JEMALLOC_HUGE_PAGES = ("MALLOC_CONF", "thp:always")
GLIBC_HUGE_PAGES = ("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")


def worker_preloads(env: Mapping[str, str] = os.environ) -> list[str]:
    """The libraries a worker runs with preloaded (those installed and not opted out)."""
    libs = [] if env.get("KVMUX_NO_OPENBLAS") else [openblas_path()]
    libs += [] if env.get("KVMUX_NO_JEMALLOC") else [jemalloc_path()]
    return [lib for lib in libs if lib]


def with_preloads(env: dict[str, str]) -> dict[str, str]:
    """`env` with the worker's preloads first in its LD_PRELOAD, and on
    Linux its allocator's switch for huge pages (left out, also where a
    parent process's was inherited, with KVMUX_NO_HUGE_PAGES=1)."""
    asked = env.get("LD_PRELOAD", "")
    libs = worker_preloads(env)
    missing = [lib for lib in libs if lib not in asked]
    out = dict(env, LD_PRELOAD=" ".join(filter(None, [*missing, asked]))) if missing else dict(env)
    if sys.platform.startswith("linux") and env.get("KVMUX_NO_HUGE_PAGES"):
        for key, value in (JEMALLOC_HUGE_PAGES, GLIBC_HUGE_PAGES):
            if out.get(key) == value:
                del out[key]
    elif sys.platform.startswith("linux"):
        key, value = JEMALLOC_HUGE_PAGES if jemalloc_path() in libs else GLIBC_HUGE_PAGES
        out.setdefault(key, value)
    return out


def mapped(lib: str, pid: int | str = "self") -> bool:
    """Whether library `lib` (a path, or a name: libjemalloc) is mapped into
    the process (Linux), known by its name before `.so`: Debian's
    libopenblas.so.0 maps as its real file, libopenblasp-r0.3.21.so."""
    try:
        return Path(lib).name.split(".so")[0] in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never;
    None off Linux)."""
    return _thp_setting("enabled")


def thp_defrag() -> str | None:
    """When the kernel compacts memory to give a huge page (never: only
    khugepaged, later)."""
    return _thp_setting("defrag")


def _thp_setting(name: str) -> str | None:
    try:
        text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
    except OSError:
        return None
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), None)


def huge_pages_mb(pid: int | str = "self") -> int | None:
    """MB of the process's memory in transparent huge pages (Linux)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("AnonHugePages:")), None)
    return None if kb is None else kb // 1024


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
