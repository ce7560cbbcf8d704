"""`kvmux http`: serve the OpenAI-compatible gateway."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import typer

from kvmux.paths import default_frontend


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
        None, help="File of accepted API keys, one per line (Bearer). Without it only loopback is served."
    ),
) -> None:
    """Serve OpenAI's chat completions and Responses APIs, Anthropic's Messages and a page; each conversation is a live kvmux session."""
    import uvicorn

    from kvmux import logs

    from .app import make_app
    from .gateway import Gateway

    keys = []
    if api_key_file is not None:
        keys = [line.strip() for line in api_key_file.read_text().splitlines() if line.strip()]
        if not keys:
            raise typer.BadParameter(f"{api_key_file} holds no keys", param_hint="--api-key-file")
    if not keys and not _loopback(host):
        raise typer.BadParameter(f"{host} is not loopback: give --api-key-file", param_hint="--host")
    logs.configure()
    app = make_app(Gateway(endpoint or default_frontend(), api_keys=keys))
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.command()(http)
