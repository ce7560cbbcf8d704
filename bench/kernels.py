"""Benches across BLAS kernel families. OpenBLAS picks its kernels when it
loads, from the CPU or OPENBLAS_CORETYPE, so each family is measured by a
run of the same bench command in a child process of its own (its daemons
inherit the family), and one report holds a column per family.

- native: the CPU's own kernels (AVX-512 ones where the CPU has them),
  and the peer llama.cpp's built for AVX-512 without AMX where `make
  .venv/.peers-setup` built it (llama.cpp's AMX path, which
  llama-cpp-python's own -march=native build takes, crashed here);
- haswell: AVX2 kernels, forced: OpenBLAS's (OPENBLAS_CORETYPE) and
  kvmux's CPU kernel's (KVMUX_CPU_KERNEL, `--cpu-kernel`): what a CPU
  without AVX-512 runs (docs/design.md, "Batch invariance"); and the peer
  llama.cpp's, built for AVX2 alone.
Both builds are scripts/llama-cpp-build's; each report says which
instruction sets its llama.cpp ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer

from .report import ReportWriter, load

FAMILIES = {"native": {}, "haswell": {"OPENBLAS_CORETYPE": "Haswell", "KVMUX_CPU_KERNEL": "avx2"}}
# Each family's llama.cpp, where `make .venv/.peers-setup` built it
# (scripts/llama-cpp-build): AVX2 alone; AVX-512 without AMX.
LLAMA_CPP_BUILDS = {"native": Path(sys.prefix) / "llama-cpp-avx512", "haswell": Path(sys.prefix) / "llama-cpp-avx2"}


def llama_cpp_lib(family: str) -> str | None:
    """The directory of the family's own llama.cpp build (None: llama-cpp-python's own)."""
    built = LLAMA_CPP_BUILDS[family]
    return str(built) if built.is_dir() else None


CHILD = "KVMUX_BENCH_KERNELS"  # set in a child run: the family it measures


def parse(text: str) -> list[str]:
    families = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise typer.BadParameter(f"kernel families are {', '.join(FAMILIES)}; got {text!r}", param_hint="--kernels")
    return families


def child() -> str | None:
    """The family this process measures, when it is a child run."""
    return os.environ.get(CHILD)


def run_each(bench: str, families: list[str], output: Path, config: dict) -> dict:
    """This bench command again, once per family in a child process; their
    reports gathered into `output` under `families`, one after the other
    (two at once would share the cores)."""
    writer = ReportWriter(output, bench, config, every_s=0.0)
    writer.doc["families"] = {}
    for family in families:
        env = {**os.environ, CHILD: family}
        for name in ("OPENBLAS_CORETYPE", "KVMUX_CPU_KERNEL", "LLAMA_CPP_LIB_PATH"):
            env.pop(name, None)
        env.update(FAMILIES[family])
        if lib := llama_cpp_lib(family):
            env["LLAMA_CPP_LIB_PATH"] = lib
        part = output.with_name(f"{output.stem}-{family}{output.suffix}")
        typer.echo(f"{bench}: kernels {family}", err=True)
        done = subprocess.run(
            [sys.executable, "-m", "kvmux.commands.cli", *sys.argv[1:], "--output", str(part)], env=env
        )
        if done.returncode:
            writer.doc["families"][family] = {"error": f"exit {done.returncode}"}
            writer.write("failed")
            raise typer.Exit(done.returncode)
        writer.doc["families"][family] = load(part)
        part.unlink()
        writer.write()
    writer.write("complete")
    return writer.doc


def columns(rows: dict[str, dict]) -> str:
    """{family: {name: value}} as a table, a column per family."""
    names = list(dict.fromkeys(name for values in rows.values() for name in values))
    width = max(map(len, names), default=4)
    lines = [" " * width + "".join(f"  {family:>20}" for family in rows)]
    for name in names:
        cells = []
        for values in rows.values():
            value = values.get(name, "-")
            cells.append(f"  {round(value, 3) if isinstance(value, float) else value!s:>20}")
        lines.append(f"{name:<{width}}" + "".join(cells))
    return "\n".join(lines)
