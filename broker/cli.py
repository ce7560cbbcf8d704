"""`kvmux serve`, and the operator's `kvmux stats`, `kvmux drain`,
`kvmux sessions`, `kvmux keys`: those talk to the admin endpoint unless
given another (drain needs admin; sessions there lists every session)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import typer

from kvmux import logs, paths, tracing
from kvmux.settings import ConfigError, with_options

from .config import SETTINGS, load

keys_app = typer.Typer(help="CURVE key pairs for tcp endpoints.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(stats)
    app.command()(drain)
    app.command()(sessions)
    app.add_typer(keys_app, name="keys")


@keys_app.command("new")
def keys_new(
    name: str = typer.Argument(..., help="The key's name: writes NAME.key (public) and NAME.key_secret."),
    dir_: Path = typer.Option(Path(), "--dir", help="Where to write them (created 0700 if missing)."),
) -> None:
    """Write a CURVE key pair in pyzmq's certificate format. Give NAME.key to
    the other side (the broker's --client-keys/--worker-keys/--admin-keys
    dir, or a client's server_key); keep NAME.key_secret private."""
    from kvmux import keys

    try:
        public, secret = keys.new(name, dir_)
    except (keys.BadKey, OSError) as exc:
        typer.echo(f"kvmux keys new: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"public key  {keys.public_key(public).decode()}\nwrote       {public}\nsecret      {secret} (0600)")


@with_options(tuple(s for s in SETTINGS if s.name != "model"))  # --model is serve's own: it may repeat
def serve(
    config: Path | None = typer.Option(
        None, "--config", help="TOML file with any of the settings below (options given here win)."
    ),
    model: list[str] | None = typer.Option(
        None,
        "--model",
        help="A model its workers serve (GGUF file, mlx-lm directory or packaged model name); repeat it for"
        " several, the first the default.",
        show_default="embedded SmolLM2-135M-Instruct",
    ),
    **settings: Any,
) -> None:
    """Run the broker, with --workers local worker processes."""
    from kvmux.sessions import StoreError

    from .broker import Broker
    from .endpoints import EndpointInUse
    from .local import LocalWorkers

    logs.configure()
    tracing.setup("kvmux-broker")
    log = logs.get("broker")
    settings["model"] = model
    try:
        cfg = load(config, **settings)
    except ConfigError as exc:
        typer.echo(f"kvmux serve: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        broker = Broker(cfg)
    except (StoreError, ValueError) as exc:  # the store unreachable, misnamed, or another broker's
        typer.echo(f"kvmux serve: {exc}", err=True)
        raise typer.Exit(2) from None
    local = LocalWorkers(cfg, broker.models.declared, broker.auth)
    broker.on_tick = local.check
    broker.reload_from = lambda: load(config, **settings)
    try:
        broker.bind()
    except (EndpointInUse, OSError) as exc:
        typer.echo(f"kvmux serve: cannot bind: {exc}", err=True)
        broker.close()
        raise typer.Exit(1) from None
    if cfg.metrics_port:
        try:
            broker.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        except OSError as exc:
            typer.echo(f"kvmux serve: cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {exc}", err=True)
            broker.close()
            raise typer.Exit(1) from None
        log.info("metrics", url=f"http://{cfg.metrics_host}:{cfg.metrics_port}/metrics")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: broker.request_drain())
    signal.signal(signal.SIGHUP, lambda *_: broker.request_reload())
    try:
        local.start(broker.backend_endpoint)
        broker.models.start(local, time.monotonic())
        code = broker.run()
    finally:
        local.stop()
        broker.disconnect_workers()
        broker.close()
    log.info("stopped", code=code)
    raise typer.Exit(code)


def stats(
    endpoint: str | None = typer.Option(
        None, help="Broker endpoint (default: the admin endpoint, KVMUX_ADMIN_ENDPOINT or the runtime dir's)."
    ),
    server_key: str | None = typer.Option(None, help="With a tcp endpoint with CURVE: the broker's public key."),
    secret_key: str | None = typer.Option(None, help="With a tcp endpoint with CURVE: our NAME.key_secret file."),
    json: bool = typer.Option(False, "--json", help="Print the raw stats as JSON."),
    timeout_s: float = typer.Option(3.0, help="Give up after this long."),
) -> None:
    """Show the broker's workers, slabs, queue and counters."""
    from kvmux.client import Client, KvmuxError

    try:
        with Client(
            endpoint or paths.default_admin(), timeout=timeout_s, server_key=server_key, secret_key=secret_key
        ) as client:
            result = client.stats()
    except KvmuxError as exc:
        typer.echo(f"kvmux stats: {exc}", err=True)
        raise typer.Exit(1) from None
    if json:
        typer.echo(msgspec.json.format(msgspec.json.encode(result).decode()))
    else:
        typer.echo(format_stats(result))


def drain(
    endpoint: str | None = typer.Option(
        None, help="Broker endpoint (default: the admin endpoint, KVMUX_ADMIN_ENDPOINT or the runtime dir's)."
    ),
    server_key: str | None = typer.Option(None, help="With a tcp endpoint with CURVE: the broker's public key."),
    secret_key: str | None = typer.Option(None, help="With a tcp endpoint with CURVE: our NAME.key_secret file."),
    grace_s: float | None = typer.Option(None, help="How long running generations may finish (default: the daemon's)."),
    timeout_s: float = typer.Option(3.0, help="Give up after this long."),
) -> None:
    """Drain the broker: admit nothing new, finish or cancel what runs, exit."""
    from kvmux.client import Client, KvmuxError

    try:
        with Client(
            endpoint or paths.default_admin(), timeout=timeout_s, server_key=server_key, secret_key=secret_key
        ) as client:
            client.drain(grace_s)
    except KvmuxError as exc:
        typer.echo(f"kvmux drain: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo("draining")


def sessions(
    action: str = typer.Argument("ls", help="ls: list sessions; rm: delete the sessions named."),
    session_ids: list[str] = typer.Argument(None, help="With rm: the session ids."),
    endpoint: str | None = typer.Option(
        None, help="Broker endpoint (default: the admin endpoint, KVMUX_ADMIN_ENDPOINT or the runtime dir's)."
    ),
    server_key: str | None = typer.Option(None, help="With a tcp endpoint with CURVE: the broker's public key."),
    secret_key: str | None = typer.Option(None, help="With a tcp endpoint with CURVE: our NAME.key_secret file."),
    json: bool = typer.Option(False, "--json", help="Print the listing as JSON."),
    timeout_s: float = typer.Option(10.0, help="Give up after this long."),
) -> None:
    """List the daemon's sessions (live and hibernated), or delete some (`kvmux sessions rm ID ...`)."""
    from kvmux.client import Client, KvmuxError

    if action not in ("ls", "rm") or (action == "rm" and not session_ids):
        typer.echo("kvmux sessions: use `kvmux sessions [ls]` or `kvmux sessions rm ID [ID ...]`", err=True)
        raise typer.Exit(2)
    try:
        with Client(
            endpoint or paths.default_admin(), timeout=timeout_s, server_key=server_key, secret_key=secret_key
        ) as client:
            if action == "ls":
                rows = client.list_sessions()
            else:
                for session_id in session_ids:
                    client.resume_session(session_id).close()
                    typer.echo(f"removed {session_id}")
                return
    except KvmuxError as exc:
        typer.echo(f"kvmux sessions: {exc}", err=True)
        raise typer.Exit(1) from None
    if json:
        typer.echo(msgspec.json.format(msgspec.json.encode(rows).decode()))
        return
    typer.echo(f"{'SESSION':32}  {'STATE':10}  {'OWNER':16}  {'TOKENS':>7}  {'IDLE':>8}  {'DISK':>9}")
    for s in sorted(rows, key=lambda s: s.idle_s):
        typer.echo(
            f"{s.session_id:32}  {s.state:10}  {s.owner[:16]:16}  {s.history_tokens:>7}  {s.idle_s:>7.0f}s"
            f"  {_size(s.bytes_on_disk):>9}"
        )


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _by_reason(refused) -> str:
    return " (" + ", ".join(f"{r.reason} {r.count}" for r in refused) + ")" if refused else ""


def format_compute(c) -> str:
    """A worker's kernels and padding in one cell, e.g. "kvmux_native avx2,
    2 threads; OpenBLAS Haswell, default: exact, nothing to pad"."""
    if c is None:
        return "-"
    how = "decode rows one at a time" if c.rows_alone else f"padded to {max(c.floors.values(), default=1)} rows"
    if c.exact and (c.rows_alone or c.floors):
        padding = f"exact, {how} ({c.pad_cost:.2f}x)"
    elif c.exact:
        padding = "exact, nothing to pad"
    else:
        padding = f"near-tie (exact: {how}, {c.pad_cost:.2f}x)"
    kernel = f"{c.kernel}; " if c.kernel else ""
    return f"{kernel}{c.blas or c.device}, {c.mode}: {padding}"


def format_prefixes(c) -> str:
    """A worker's shared prefixes: "3 hits 1 miss, 4464 tokens, 135.0 MiB held"."""
    if c is None or not (c.hits or c.misses or c.bytes):
        return "-"
    return f"{c.hits} hits {c.misses} misses, {c.tokens} tokens, {_size(c.bytes)} held"


def format_models(s) -> list[str]:
    """Each model the daemon serves: its state, memory and aliases; the budget and its loads and unloads."""
    if not s.models:
        return []
    budget = f"budget {_size(s.max_resident_bytes)}  " if s.max_resident_bytes else ""
    lines = [f"models: {budget}loads {s.model_loads}  unloads {s.model_unloads}"]
    for m in s.models:
        marks = [mark for mark, on in (("default", m.default), ("pinned", m.pinned)) if on]
        aliases = f"  aka {', '.join(m.aliases)}" if m.aliases else ""
        memory = f"  {_size(m.resident_bytes)}" if m.resident_bytes else ""
        idle = f"  idle {m.idle_s:.0f}s" if m.idle_s else ""
        flags = f" ({', '.join(marks)})" if marks else ""
        lines.append(f"  {m.model}{flags}: {m.state}, {m.workers} workers{memory}{idle}{aliases}")
    return lines


def format_stats(s) -> str:
    """BrokerStats as a short summary and one row per worker."""
    lines = [
        f"uptime {s.uptime_s:.0f}s  protocol v{s.version}  {'DRAINING' if s.draining else 'serving'}",
        f"slabs {s.slabs_used}/{s.slabs_total} used  sessions {s.sessions}  in flight {s.in_flight}  frames forwarded {s.frames_forwarded}",
        f"queue {s.queue_depth}  admitted {s.admitted}  rejected {s.rejected}{_by_reason(s.refused)}"
        f"  expired {s.expired}"
        f"  queue wait p50 {s.queue_wait_p50_s * 1000:.1f} ms  p99 {s.queue_wait_p99_s * 1000:.1f} ms",
        f"store: live {s.sessions_live}  hibernated {s.sessions_hibernated}  hibernations {s.hibernations}"
        f"  restores {s.restores} (p50 {s.restore_p50_s * 1000:.1f} ms  p99 {s.restore_p99_s * 1000:.1f} ms)"
        f"  {_size(s.store_bytes)} on disk" + (f"  UNREACHABLE: {s.store_error}" if s.store_error else ""),
        *format_models(s),
        "",
    ]
    header = (
        "WORKER",
        "HOST",
        "PID",
        "SLABS USED",
        "FREE",
        "SESSIONS",
        "RUNNING",
        "IN FLIGHT",
        "FRAMES",
        "ACCEPTED",
        "PREFIXES",
        "PASSES",
        "GROUP",
        "SEEN",
    )
    rows = [
        (
            w.worker_id,
            w.host,
            str(w.pid),
            f"{w.slabs_used}/{w.slabs_total}",
            str(w.slabs_total - w.slabs_used),
            str(w.sessions),
            str(w.running),
            str(w.in_flight),
            str(w.frames_forwarded),
            f"{w.accepted}/{w.drafted} ({w.accepted / w.drafted:.0%})" if w.drafted else "-",
            format_prefixes(w.prefixes),
            format_compute(w.compute),
            f"{w.compute.layout}, {_size(w.link_bytes)} between ranks" if w.compute and w.compute.layout else "-",
            f"{w.last_seen_s:.1f}s ago",
        )
        for w in s.workers
    ]
    if not rows:
        return "\n".join([*lines, "no workers registered"])
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in (header, *rows)
    ]
    return "\n".join(lines)
