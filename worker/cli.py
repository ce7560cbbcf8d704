"""`kvmux worker`: one MLX worker process serving a broker's backend."""

from __future__ import annotations

import os
import sys

import typer

from kvmux import paths
from kvmux import protocol as p
from kvmux.paths import default_backend


def worker(
    connect: str = typer.Option(
        None, "--connect", help="Broker backend endpoint (ipc:// or tcp://). [default: the local daemon's]"
    ),
    slabs: int = typer.Option(4, min=1, help="Sessions this worker holds at once (one KV slab each)."),
    model: str | None = typer.Option(
        None, help="GGUF file or local mlx-lm model directory. [default: embedded SmolLM2-135M-Instruct]"
    ),
    sink: int = typer.Option(4, min=0, help="Largest attention-sink size a session may ask for (and the default)."),
    window: int = typer.Option(2048, min=1, help="Largest sliding window a session may ask for (and the default)."),
    worker_id: str | None = typer.Option(None, help="Routing id shown in stats. [default: HOST-PID]"),
    heartbeat_s: float = typer.Option(p.HEARTBEAT_INTERVAL_S, min=0.05, help="Heartbeat interval."),
    grace_s: float = typer.Option(
        30.0, min=0, help="On SIGTERM, how long running generations may finish before they are cancelled."
    ),
    state_dir: str | None = typer.Option(
        None, help="Session store's dir, shared with the broker. [default: $XDG_STATE_HOME/kvmux]"
    ),
    max_tokens_limit: int = typer.Option(
        p.DEFAULT_MAX_TOKENS_LIMIT, min=1, help="Refuse max_tokens above this (invalid_argument)."
    ),
    max_append_tokens: int = typer.Option(
        p.DEFAULT_MAX_APPEND_TOKENS, min=1, help="Refuse one append (or a chat's messages) longer than this."
    ),
    chat_template: str | None = typer.Option(
        None, help="Jinja chat template file to use instead of the model's own (a base model's GGUF often has none)."
    ),
    draft_model: str | None = typer.Option(
        None, help="Draft model for speculative decoding (GGUF or mlx-lm dir; its tokenizer must be the model's)."
    ),
    draft_quantized: bool = typer.Option(
        False, help="Keep the draft model's weights quantized (on a CPU they are otherwise dequantized)."
    ),
    batch_invariant: bool = typer.Option(
        False,
        "--batch-invariant",
        help="Pad every pass so a session's tokens are bit-identical whatever shares its pass, at whatever it"
        " costs on these kernels (default: pad only where a decode step pays at most 5 % for it).",
    ),
    server_key: str | None = typer.Option(
        None,
        envvar="KVMUX_SERVER_KEY",
        help="The broker's CURVE public key (z85, or its .key file): connect with CURVE.",
    ),
    curve_secret: str | None = typer.Option(
        None,
        envvar="KVMUX_CURVE_SECRET",
        show_envvar=False,
        help="This worker's CURVE secret key file (NAME.key_secret; the broker's --worker-keys holds NAME.key).",
    ),
) -> None:
    """Run one worker: load the model, register with the broker, serve sessions."""
    from kvmux.worker.preload import ensure_preloaded

    ensure_preloaded()
    from kvmux import logs
    from kvmux.worker.server import Worker, WorkerConfig

    logs.configure()
    config = WorkerConfig(
        connect=connect or default_backend(),
        slabs=slabs,
        model=model,
        sink=sink,
        window=window,
        worker_id=worker_id,
        heartbeat_s=heartbeat_s,
        grace_s=grace_s,
        state_dir=state_dir or str(paths.state_dir()),
        max_tokens_limit=max_tokens_limit,
        max_append_tokens=max_append_tokens,
        server_key=server_key or "",
        curve_secret=curve_secret or "",
        chat_template=chat_template,
        draft_model=draft_model,
        draft_quantized=draft_quantized,
        batch_invariant=batch_invariant,
    )
    code = Worker(config).run()
    if code:
        # Refused (2) or failed (1) at load, with torch and MLX just loaded:
        # their C++ teardown at exit then aborts now and then (SIGABRT, not
        # the exit code the supervisor reads: kvmux serve restarts a 1 and
        # gives up on a 2). Nothing is left to flush but the logs.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command()(worker)
