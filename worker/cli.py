"""`kvmux worker`: one MLX worker process serving a broker's backend. Its
options, their help and docs/operations.md's table of them come from
WorkerConfig (`python -m kvmux.worker.cli docs/operations.md` rewrites the
table)."""

from __future__ import annotations

import os
import sys
from typing import Any

import typer
import zmq

from kvmux import logs, settings, tracing
from kvmux.worker import gguf_tokenizer
from kvmux.worker.preload import ensure_preloaded
from kvmux.worker.server import Worker, WorkerConfig

SETTINGS = settings.declared(WorkerConfig)
TABLE = settings.Table("kvmux.worker.cli", SETTINGS, keys=False)


@settings.with_options(SETTINGS)
def worker(**options: Any) -> None:
    """Run one worker: load the model, register with the broker, serve sessions."""
    try:
        config = settings.load(WorkerConfig, **options)
    except settings.ConfigError as exc:
        typer.echo(f"kvmux worker: {exc}", err=True)
        raise typer.Exit(2) from None
    ensure_preloaded()
    gguf_tokenizer.hide_torch()  # before anything imports transformers
    logs.configure()
    tracing.setup("kvmux-worker")
    group = None
    if config.pipeline > 1:  # a worker group (worker/group.py): rank 0 is the worker, the others follow it
        from kvmux.worker import group as worker_group

        try:
            group = worker_group.join(config.pipeline)
        except ValueError as exc:
            typer.echo(f"kvmux worker: {exc}", err=True)
            raise typer.Exit(2) from None
    if group is not None and group.rank() > 0:
        code = worker_group.follower(config, group)
    else:
        code = Worker(config, group).run()
    # Out by os._exit, past the interpreter's teardown, whatever the code:
    # MLX's thread-locals of the compute thread are destroyed after its
    # join() returns, and one that takes the GIL while the interpreter
    # finalizes aborts the process ("terminate called without an active
    # exception", SIGABRT where a drain exited 0 and a supervisor reads a
    # crash). What teardown would flush is flushed here: the spans, the
    # DISCONNECT still queued for the broker (its socket lingers 1 s), the logs.
    tracing.shutdown()
    zmq.Context.instance().destroy(linger=1000)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def register(app: typer.Typer) -> None:
    app.command()(worker)


if __name__ == "__main__":
    TABLE.main(sys.argv)
