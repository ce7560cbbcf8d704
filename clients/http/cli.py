"""`kvmux http`: serve the OpenAI-compatible gateway."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import typer

from kvmux.paths import default_frontend
from kvmux.protocol import PRIORITIES


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    endpoint: str | None = typer.Option(None, help="The broker's client endpoint. [default: the local daemon's]"),
    api_key_file: Path | None = typer.Option(
        None,
        help="File of accepted API keys, one per line (Bearer), each optionally followed by priority=N, its"
        " requests' default priority. Without it only loopback is served.",
    ),
) -> None:
    """Serve OpenAI's chat completions and Responses APIs, Anthropic's Messages and a page; each conversation is a live kvmux session."""
    import uvicorn

    from kvmux import logs, tracing

    from .app import make_app
    from .gateway import Gateway

    keys, priorities = [], {}
    if api_key_file is not None:
        try:
            keys, priorities = read_keys(api_key_file.read_text())
        except ValueError as exc:
            raise typer.BadParameter(f"{api_key_file}: {exc}", param_hint="--api-key-file") from None
        if not keys:
            raise typer.BadParameter(f"{api_key_file} holds no keys", param_hint="--api-key-file")
    if not keys and not _loopback(host):
        raise typer.BadParameter(f"{host} is not loopback: give --api-key-file", param_hint="--host")
    logs.configure()
    tracing.setup("kvmux-http")
    app = make_app(Gateway(endpoint or default_frontend(), api_keys=keys, priorities=priorities))
    uvicorn.run(app, host=host, port=port, log_level="warning")


def read_keys(text: str) -> tuple[list[str], dict[str, int]]:
    """A key file's keys, and the default priority of those that name one
    (`KEY priority=N`); raises ValueError for a line it cannot read."""
    keys, priorities = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        key, *rest = line.split() or [""]
        if not key:
            continue
        keys.append(key)
        for setting in rest:
            name, _, value = setting.partition("=")
            if name != "priority" or not value.lstrip("-").isdigit() or int(value) not in PRIORITIES:
                raise ValueError(
                    f"line {number}: {setting!r} is not priority=N (N within {PRIORITIES[0]}..{PRIORITIES[-1]})"
                )
            priorities[key] = int(value)
    return keys, priorities


def register(app: typer.Typer) -> None:
    app.command()(http)
