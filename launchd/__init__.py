"""`kvmux launchd`: run the daemon under launchd on macOS, as a per-user
LaunchAgent (default) or a system LaunchDaemon (`--system`, as root).

The plist comes from the template beside this file; `kvmux launchd print`
shows it without installing, on any OS.
"""

from __future__ import annotations

import os
import plistlib
import subprocess
import sys
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

import typer

LABEL = "com.kvmux.daemon"
TEMPLATE = Path(__file__).with_name("kvmux.plist")

launchd_app = typer.Typer(help="Install or remove the kvmux daemon as a macOS launchd job.", no_args_is_help=True)


def plist_path(system: bool) -> Path:
    return Path("/Library/LaunchDaemons" if system else Path.home() / "Library/LaunchAgents") / f"{LABEL}.plist"


def render(serve_args: list[str], *, system: bool, grace_s: float = 10.0) -> str:
    """The job's plist: `kvmux serve SERVE_ARGS` from this environment's Python."""
    home = Path("/var/lib/kvmux") if system else Path.home() / "Library/Application Support/kvmux"
    logs = Path("/var/log") if system else Path.home() / "Library/Logs"
    argv = [sys.executable, "-m", "kvmux.cli", "serve", *serve_args]
    text = Template(TEMPLATE.read_text()).substitute(
        label=LABEL,
        arguments="\n".join(f"    <string>{escape(a)}</string>" for a in argv),
        runtime_dir=escape(str(home / "run")),
        log_path=escape(str(logs / "kvmux.log")),
        exit_timeout=int(grace_s) + 10,
    )
    plistlib.loads(text.encode())  # refuse to write a plist launchd would reject
    return text


def _launchctl(*args: str, check: bool = True) -> None:
    subprocess.run(["launchctl", *args], check=check)


def _domain(system: bool) -> str:
    return "system" if system else f"gui/{os.getuid()}"


@launchd_app.command("print")
def print_plist(
    system: bool = typer.Option(False, help="A system LaunchDaemon instead of a per-user LaunchAgent."),
    serve_args: list[str] = typer.Argument(None, help="Arguments for `kvmux serve` (after --)."),
) -> None:
    """Print the plist that `install` would write."""
    typer.echo(render(serve_args or [], system=system), nl=False)


@launchd_app.command()
def install(
    system: bool = typer.Option(False, help="A system LaunchDaemon (needs root) instead of a per-user LaunchAgent."),
    serve_args: list[str] = typer.Argument(None, help="Arguments for `kvmux serve` (after --), e.g. -- --workers 2."),
) -> None:
    """Write the plist and (re)load the job: the daemon starts now and at every login/boot."""
    if sys.platform != "darwin":
        typer.echo("launchd is macOS only; on Linux run `kvmux serve` under systemd or your supervisor.", err=True)
        raise typer.Exit(2)
    path = plist_path(system)
    path.parent.mkdir(parents=True, exist_ok=True)
    _launchctl("bootout", f"{_domain(system)}/{LABEL}", check=False)
    path.write_text(render(serve_args or [], system=system))
    _launchctl("bootstrap", _domain(system), str(path))
    typer.echo(f"installed {path}; `kvmux doctor` checks that it answers")


@launchd_app.command()
def uninstall(
    system: bool = typer.Option(False, help="The system LaunchDaemon instead of the per-user LaunchAgent."),
) -> None:
    """Stop the job (it drains) and remove its plist."""
    if sys.platform != "darwin":
        typer.echo("launchd is macOS only.", err=True)
        raise typer.Exit(2)
    path = plist_path(system)
    _launchctl("bootout", f"{_domain(system)}/{LABEL}", check=False)
    if path.exists():
        path.unlink()
    typer.echo(f"removed {path}")


def register(app: typer.Typer) -> None:
    app.add_typer(launchd_app, name="launchd")
