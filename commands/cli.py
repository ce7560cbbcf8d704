"""The `kvmux` console command. Each subcommand lives in the module named for
what it does and registers itself here; those modules import their heavy
dependencies (MLX, the model) inside the command, so `kvmux --help`,
`kvmux stats` and the client stay light."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="kvmux",
    help="Session-bound LLM runtime: a ZeroMQ broker, MLX workers, bounded per-session KV slabs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """Session-bound LLM runtime: a ZeroMQ broker, MLX workers, bounded per-session KV slabs."""


_COMMAND_MODULES = (
    "kvmux.broker.cli",  # serve, stats, drain
    "kvmux.worker.cli",  # worker
    "kvmux.commands.chat",  # chat
    "kvmux.commands.prefix",  # prefix pin/list/drop
    "kvmux.http.cli",  # http
    "kvmux.commands.doctor",  # doctor
    "kvmux.bench.cli",  # bench ...
    "kvmux.launchd",  # launchd install/uninstall
)

for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)


if __name__ == "__main__":
    app()
