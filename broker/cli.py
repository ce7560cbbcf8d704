"""`kvmux serve`, and the operator's `kvmux stats`, `kvmux drain`,
`kvmux sessions`, `kvmux keys`: those talk to the admin endpoint unless
given another (drain needs admin; sessions there lists every session)."""

from __future__ import annotations

import signal
from pathlib import Path

import msgspec
import typer

from kvmux import logs, paths

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


def serve(
    config: Path | None = typer.Option(
        None, "--config", help="TOML file with any of the settings below (options given here win)."
    ),
    frontend: str | None = typer.Option(None, help="Client endpoint to bind (default: ipc under the runtime dir)."),
    backend: str | None = typer.Option(
        None, help="Worker endpoint to bind, e.g. tcp://0.0.0.0:5556 for remote workers."
    ),
    workers: int | None = typer.Option(None, help="Local worker processes to start (0: broker only) (default: 1)."),
    slabs: int | None = typer.Option(None, help="Slabs (live sessions) per local worker (default: 4)."),
    model: str | None = typer.Option(
        None, help="Model for local workers: GGUF file or mlx-lm directory (default: embedded SmolLM2)."
    ),
    chat_template: str | None = typer.Option(
        None, help="Jinja chat template file for local workers, instead of the model's own (default: the model's)."
    ),
    draft_model: str | None = typer.Option(
        None, help="Draft model for speculative decoding; its tokenizer must be the model's (default: none)."
    ),
    draft_quantized: bool = typer.Option(
        False, "--draft-quantized", help="Keep the draft model's weights quantized (smaller; slower on a CPU)."
    ),
    batch_invariant: bool = typer.Option(
        False,
        "--batch-invariant",
        help="Local workers pad every pass: bit-identical tokens whatever shares a pass, at whatever it costs"
        " (default: pad only where it costs a decode step at most 5 %).",
    ),
    admission: str | None = typer.Option(
        None, help="When every slab is busy running a request: reject | queue (default: reject)."
    ),
    queue_depth: int | None = typer.Option(None, help="Most opens waiting in the queue (default: 64)."),
    queue_wait_s: float | None = typer.Option(None, help="Longest an open waits in the queue (default: 30)."),
    client_quota: int | None = typer.Option(
        None, help="Sessions (live and hibernated) per client identity, 0 = unlimited (default: 1000)."
    ),
    idle_timeout_s: float | None = typer.Option(None, help="Close sessions idle this long, 0 = never (default: 0)."),
    state_dir: str | None = typer.Option(
        None, help="Session store's dir (default: $XDG_STATE_HOME/kvmux or ~/.local/state/kvmux)."
    ),
    hibernate_after_s: float | None = typer.Option(
        None, help="Hibernate sessions idle this long to the store, 0 = only when a slab is needed (default: 300)."
    ),
    max_sessions: int | None = typer.Option(None, help="Sessions kept, live and hibernated (default: 10000)."),
    session_ttl_s: float | None = typer.Option(
        None, help="Delete sessions idle this long, 0 = never (default: 604800, 7 days)."
    ),
    worker_wait_s: float | None = typer.Option(
        None, help="While local workers start, how long opens wait for one (default: 60)."
    ),
    drain_grace_s: float | None = typer.Option(
        None, help="On SIGTERM/drain, how long running generations may finish (default: 10)."
    ),
    heartbeat_s: float | None = typer.Option(None, help="Heartbeat interval with workers (default: 1)."),
    max_frame_bytes: int | None = typer.Option(None, help="Largest client frame accepted (default: 8 MiB)."),
    max_tokens_limit: int | None = typer.Option(
        None, help="Local workers refuse max_tokens above this (invalid_argument) (default: 4096)."
    ),
    max_append_tokens: int | None = typer.Option(
        None, help="Local workers refuse one append longer than this many tokens (default: 32768)."
    ),
    admin_endpoint: str | None = typer.Option(
        None, help="Admin endpoint, ipc only: drain and every session (default: admin.ipc in the runtime dir)."
    ),
    curve_secret: str | None = typer.Option(
        None, help="The broker's CURVE secret key file (`kvmux keys new`): CURVE on every tcp endpoint."
    ),
    client_keys: str | None = typer.Option(None, help="Directory of the public keys of clients allowed in."),
    worker_keys: str | None = typer.Option(None, help="Directory of the public keys of remote workers allowed in."),
    admin_keys: str | None = typer.Option(
        None, help="Directory of the public keys allowed admin ops (drain) over tcp; they may also chat."
    ),
    insecure: bool = typer.Option(
        False, "--insecure", help="Allow tcp beyond loopback without CURVE (anyone who reaches it may use it)."
    ),
) -> None:
    """Run the broker, with --workers local worker processes."""
    from .broker import Broker
    from .config import ConfigError, load
    from .endpoints import EndpointInUse
    from .local import LocalWorkers

    logs.configure()
    log = logs.get("broker")
    try:
        cfg = load(
            config,
            frontend=frontend,
            backend=backend,
            workers=workers,
            slabs=slabs,
            model=model,
            chat_template=chat_template,
            draft_model=draft_model,
            draft_quantized=draft_quantized or None,
            batch_invariant=batch_invariant or None,
            admission=admission,
            queue_depth=queue_depth,
            queue_wait_s=queue_wait_s,
            client_quota=client_quota,
            idle_timeout_s=idle_timeout_s,
            state_dir=state_dir,
            hibernate_after_s=hibernate_after_s,
            max_sessions=max_sessions,
            session_ttl_s=session_ttl_s,
            worker_wait_s=worker_wait_s,
            drain_grace_s=drain_grace_s,
            heartbeat_s=heartbeat_s,
            max_frame_bytes=max_frame_bytes,
            max_tokens_limit=max_tokens_limit,
            max_append_tokens=max_append_tokens,
            admin_endpoint=admin_endpoint,
            curve_secret=curve_secret,
            client_keys=client_keys,
            worker_keys=worker_keys,
            admin_keys=admin_keys,
            insecure=insecure or None,
        )
    except ConfigError as exc:
        typer.echo(f"kvmux serve: {exc}", err=True)
        raise typer.Exit(2) from None
    broker = Broker(cfg)
    local = LocalWorkers(cfg, broker.auth)
    broker.on_tick = local.check
    try:
        broker.bind()
    except (EndpointInUse, OSError) as exc:
        typer.echo(f"kvmux serve: cannot bind: {exc}", err=True)
        broker.close()
        raise typer.Exit(1) from None
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: broker.request_drain())
    try:
        local.start(broker.backend_endpoint)
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
    """A worker's kernels and padding in one cell, e.g. "OpenBLAS Haswell,
    default: near-tie (exact: decode rows one at a time, 3.90x)"."""
    if c is None:
        return "-"
    how = "decode rows one at a time" if c.rows_alone else f"padded to {max(c.floors.values(), default=1)} rows"
    if c.exact and (c.rows_alone or c.floors):
        padding = f"exact, {how} ({c.pad_cost:.2f}x)"
    elif c.exact:
        padding = "exact, nothing to pad"
    else:
        padding = f"near-tie (exact: {how}, {c.pad_cost:.2f}x)"
    return f"{c.blas or c.device}, {c.mode}: {padding}"


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
        f"  {_size(s.store_bytes)} on disk",
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
        "PASSES",
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
            format_compute(w.compute),
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
