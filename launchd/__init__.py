"""`kvmux launchd`: run the daemon under launchd on macOS, as a per-user
LaunchAgent (default) or a system LaunchDaemon (`--system`, installed by
root, run as a dedicated user, `_kvmux` by default, never as root).

The plist comes from the template beside this file; `kvmux launchd print`
shows it without installing, on any OS.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

import typer

LABEL = "com.kvmux.daemon"
TEMPLATE = Path(__file__).with_name("kvmux.plist")
SERVICE_USER = "_kvmux"
SYSTEM_HOME = Path("/var/lib/kvmux")
SYSTEM_LOG = Path("/var/log/kvmux.log")

launchd_app = typer.Typer(help="Install or remove the kvmux daemon as a macOS launchd job.", no_args_is_help=True)


def plist_path(system: bool) -> Path:
    return Path("/Library/LaunchDaemons" if system else Path.home() / "Library/LaunchAgents") / f"{LABEL}.plist"


def render(serve_args: list[str], *, system: bool, user: str = SERVICE_USER, grace_s: float = 10.0) -> str:
    """The job's plist: `kvmux serve SERVE_ARGS` from this environment's
    Python; a system job runs as `user` with its state under /var/lib/kvmux."""
    home = SYSTEM_HOME if system else Path.home() / "Library/Application Support/kvmux"
    log_path = SYSTEM_LOG if system else Path.home() / "Library/Logs/kvmux.log"
    argv = [sys.executable, "-m", "kvmux.commands.cli", "serve", *serve_args]
    run_as = "\n".join(f"  <key>{key}</key>\n  <string>{escape(user)}</string>" for key in ("UserName", "GroupName"))
    text = Template(TEMPLATE.read_text()).substitute(
        label=LABEL,
        arguments="\n".join(f"    <string>{escape(a)}</string>" for a in argv),
        runtime_dir=escape(str(home / "run")),
        state_dir=escape(str(home / "state" if system else home)),
        log_path=escape(str(log_path)),
        exit_timeout=int(grace_s) + 10,
        user=run_as if system else "",
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
    user: str = typer.Option(SERVICE_USER, help="With --system: the user the daemon runs as."),
    serve_args: list[str] = typer.Argument(None, help="Arguments for `kvmux serve` (after --)."),
) -> None:
    """Print the plist that `install` would write."""
    typer.echo(render(serve_args or [], system=system, user=user), nl=False)


@launchd_app.command()
def install(
    system: bool = typer.Option(False, help="A system LaunchDaemon (needs root) instead of a per-user LaunchAgent."),
    user: str = typer.Option(SERVICE_USER, help="With --system: the user the daemon runs as (created if missing)."),
    serve_args: list[str] = typer.Argument(None, help="Arguments for `kvmux serve` (after --), e.g. -- --workers 2."),
) -> None:
    """Write the plist and (re)load the job: the daemon starts now and at every login/boot."""
    if sys.platform != "darwin":
        typer.echo("launchd is macOS only; on Linux run `kvmux serve` under systemd or your supervisor.", err=True)
        raise typer.Exit(2)
    if system and os.geteuid() != 0:
        typer.echo(f"kvmux launchd install --system: run it as root (sudo); the daemon itself runs as {user}", err=True)
        raise typer.Exit(2)
    if system:
        _prepare_service_user(user)
    path = plist_path(system)
    path.parent.mkdir(parents=True, exist_ok=True)
    _launchctl("bootout", f"{_domain(system)}/{LABEL}", check=False)
    path.write_text(render(serve_args or [], system=system, user=user))
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


def _prepare_service_user(user: str) -> None:
    """The dedicated user (a hidden role account with no shell, like macOS's
    own `_` users) and what it owns: the state dir, a 0700 runtime dir, the log."""
    if subprocess.run(["dscl", ".", "-read", f"/Users/{user}"], capture_output=True).returncode != 0:
        listed = subprocess.run(["dscl", ".", "-list", "/Users", "UniqueID"], capture_output=True, text=True).stdout
        taken = {int(line.split()[-1]) for line in listed.splitlines() if line.split()[-1].lstrip("-").isdigit()}
        uid = next(n for n in range(400, 500) if n not in taken)  # role accounts live below 500
        for args in (
            ["-create", f"/Groups/{user}", "PrimaryGroupID", str(uid)],
            ["-create", f"/Users/{user}", "UniqueID", str(uid)],
            ["-create", f"/Users/{user}", "PrimaryGroupID", str(uid)],
            ["-create", f"/Users/{user}", "UserShell", "/usr/bin/false"],
            ["-create", f"/Users/{user}", "NFSHomeDirectory", str(SYSTEM_HOME)],
            ["-create", f"/Users/{user}", "IsHidden", "1"],
        ):
            subprocess.run(["dscl", ".", *args], check=True)
        typer.echo(f"created the role account {user} (uid {uid})")
    for path, mode in ((SYSTEM_HOME, 0o755), (SYSTEM_HOME / "state", 0o700), (SYSTEM_HOME / "run", 0o700)):
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(mode)
        shutil.chown(path, user, user)
    SYSTEM_LOG.touch(mode=0o640, exist_ok=True)
    shutil.chown(SYSTEM_LOG, user, user)


def register(app: typer.Typer) -> None:
    app.add_typer(launchd_app, name="launchd")
