"""`kvmux prefix`: the shared prefixes in the session store
(worker/prefixes.py): pin an opening so that the first session that starts
with it already takes it, list them, drop them."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import typer

from kvmux.paths import default_frontend

prefix = typer.Typer(
    help="Shared prefixes: an opening's KV, computed once for every session that starts with it.",
    no_args_is_help=True,
)

_STORE = typer.Option(
    "", "--store", envvar="KVMUX_STORE", help="The session store: a Redis URL. [default: the state dir's]"
)
_STATE_DIR = typer.Option("", "--state-dir", help="The daemon's state dir. [default: as kvmux serve's]")


def _prefixes(store: str, state_dir: str):
    from kvmux import paths
    from kvmux.sessions import StoreError, open_store

    try:
        prefixes = open_store(store, state_dir or str(paths.state_dir())).prefixes(0)  # no writes: no budget
    except (ValueError, StoreError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--store") from None
    if prefixes is None:
        raise typer.BadParameter("this store keeps no shared prefixes", param_hint="--store")
    return prefixes


@prefix.command("pin")
def pin(
    system: str = typer.Option(..., help="The system prompt, or @FILE to read it from a file."),
    tools: Path | None = typer.Option(
        None, exists=True, dir_okay=False, help="A JSON file: the tools, [{name, description, parameters}, ...]."
    ),
    message: str = typer.Option(
        "Hello.",
        help="The first user message the opening is rendered with (chat templates render a system prompt"
        " beside one); sessions share the blocks before it whatever theirs is.",
    ),
    endpoint: str = typer.Option(
        None, "--endpoint", "-e", help="Broker frontend. [default: the local daemon's, or $KVMUX_ENDPOINT]"
    ),
) -> None:
    """Compute an opening (system prompt, tools) on a worker and store its
    prefix pinned: kept past the budget's evictions until dropped."""
    from kvmux.client import Client, KvmuxError

    text = Path(system[1:]).read_text() if system.startswith("@") else system
    listed = json.loads(tools.read_text()) if tools else []
    try:
        with Client(endpoint or default_frontend()) as client:
            session = client.open_session(text, tools=listed, prefix="pin")
            appended = session.append([{"role": "user", "content": message}])
            session.close()
    except KvmuxError as exc:
        typer.secho(f"{type(exc).__name__}: {exc}", fg="red", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"pinned: an opening of {appended.new_tokens} tokens, {appended.cached_tokens} of them taken from a"
        " prefix stored already (kvmux prefix list shows what is stored)"
    )


@prefix.command("list")
def list_prefixes(store: str = _STORE, state_dir: str = _STATE_DIR) -> None:
    """The stored prefixes, least recently used first."""
    entries = sorted(_prefixes(store, state_dir).entries(), key=lambda e: e.used)
    if not entries:
        typer.echo("no shared prefixes stored")
        return
    typer.echo(f"{'KEY':32}  {'TOKENS':>6}  {'MB':>7}  PINNED  LAST USED")
    for e in entries:
        used = datetime.datetime.fromtimestamp(e.used).isoformat(timespec="seconds")
        typer.echo(f"{e.key}  {e.tokens:>6}  {e.bytes / 2**20:>7.1f}  {'yes' if e.pinned else 'no':6}  {used}")
    typer.echo(f"{len(entries)} prefixes, {sum(e.bytes for e in entries) / 2**20:.1f} MB")


@prefix.command("drop")
def drop(
    keys: list[str] = typer.Argument(None, help="Keys (kvmux prefix list), or none with --all."),
    every: bool = typer.Option(False, "--all", help="Drop every stored prefix."),
    store: str = _STORE,
    state_dir: str = _STATE_DIR,
) -> None:
    """Delete stored prefixes (pinned ones too). Workers' copies in memory
    go as their budget evicts them."""
    prefixes = _prefixes(store, state_dir)
    if bool(keys) == every:
        raise typer.BadParameter("give keys or --all, not both")
    if every:
        keys = [e.key for e in prefixes.entries()]
    missing = []
    for key in keys:
        try:
            found = prefixes.drop(key)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        if not found:
            missing.append(key)
    typer.echo(f"dropped {len(keys) - len(missing)} prefixes")
    if missing:
        typer.secho(f"not stored: {', '.join(missing)}", fg="red", err=True)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(prefix, name="prefix")
