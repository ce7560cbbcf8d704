"""`kvmux bench soak | perf | engine | ... | report`. Heavy imports (matplotlib, MLX,
transformers) happen inside the commands."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from pathlib import Path

import typer

KERNELS_DEFAULT = "native,haswell"
KERNELS_HELP = "BLAS kernel families, each measured in a run of its own: native (the CPU's), haswell (AVX2 forced)."
SESSION_PHASES = ("hibernating", "resident", "restore_vs_prefill", "migration", "crash_recovery")  # in run order

bench_app = typer.Typer(
    help="Soak and performance benches; each writes a JSON report and a PNG plot.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


def _print_summary(title: str, summary: dict | None, error: str | None) -> None:
    typer.echo(f"{title}:")
    if error:
        typer.echo(f"  ERROR: {error}")
        return
    for key, value in (summary or {}).items():
        typer.echo(f"  {key}: {round(value, 4) if isinstance(value, float) else value}")


@bench_app.command()
def soak(
    turns: int | None = typer.Option(100, help="Turns per session (0: until --duration-s)."),
    duration_s: float | None = typer.Option(None, help="Stop after this many seconds, whatever the turn count."),
    turn_spacing_s: float = typer.Option(0.0, help="Pause between a session's turns."),
    sessions: int = typer.Option(1, help="Concurrent sessions."),
    max_tokens: int = typer.Option(16, help="Reply length per turn."),
    window: int = typer.Option(2048, help="Session window (tokens kept after the sink); 2048 is the serve default."),
    sink: int | None = typer.Option(None, help="Session sink (default: the worker's)."),
    system: str | None = typer.Option(None, help="System prompt (default: the chat template's)."),
    baseline: str | None = typer.Option(None, help="'reprefill': also run each turn as a stateless server would."),
    baseline_every: int = typer.Option(1, help="Run the baseline on every Nth turn only."),
    baseline_context: int | None = typer.Option(
        None, help="Tokens of history the baseline re-sends at most (default: sink + window)."
    ),
    endpoint: str | None = typer.Option(None, help="Broker frontend (default: KVMUX_ENDPOINT or the runtime dir's)."),
    spawn: bool = typer.Option(False, "--spawn", help="Start a private `kvmux serve` for this run."),
    model: str | None = typer.Option(None, help="With --spawn: the model (default: embedded SmolLM2)."),
    output: Path = typer.Option(Path("soak.json"), help="Report path; the plot goes next to it (.png)."),
    checkpoint_s: float = typer.Option(10.0, help="Rewrite the report at least this often."),
    timeout_s: float = typer.Option(120.0, help="Per-call client timeout."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Walk sessions through many turns and check latency, prefill and KV/RSS stay flat."""
    from kvmux import logs, paths

    from . import plot
    from . import spawn as spawn_mod
    from .soak import Soak, SoakConfig
    from .summary import verdicts_pass

    logs.configure()
    if baseline not in (None, "reprefill"):
        raise typer.BadParameter("only 'reprefill' is supported", param_hint="--baseline")
    slabs = sessions + (1 if baseline else 0)
    with (
        spawn_mod.serve(workers=1, slabs=slabs, model=model)
        if spawn
        else contextlib.nullcontext(endpoint or paths.default_frontend()) as ep
    ):
        cfg = SoakConfig(
            endpoint=ep,
            turns=turns or None,
            duration_s=duration_s,
            turn_spacing_s=turn_spacing_s,
            sessions=sessions,
            max_tokens=max_tokens,
            window=window,
            sink=sink,
            system=system,
            baseline=baseline,
            baseline_every=baseline_every,
            baseline_context=baseline_context,
            timeout_s=timeout_s,
        )
        doc = Soak(cfg, output, checkpoint_s=checkpoint_s, progress=progress).run()
    png = plot.plot_soak(doc, output.with_suffix(".png"))
    _print_summary("summary", doc["summary"], doc["summary_error"])
    if doc.get("baseline"):
        _print_summary("baseline summary (reprefill)", doc["baseline"]["summary"], doc["baseline"]["summary_error"])
    typer.echo(f"report: {output}\nplot: {png}")
    if doc["summary_error"] or not verdicts_pass(doc["summary"]):
        raise typer.Exit(1)


@bench_app.command()
def perf(
    model: str | None = typer.Option(None, help="GGUF file or mlx-lm directory (default: embedded SmolLM2)."),
    decode_tokens: int = typer.Option(48, help="Tokens per decode measurement."),
    window: int = typer.Option(
        2048, help="Session window (and the bare cache's size, plus the sink); 2048 is the serve default."
    ),
    sink: int = typer.Option(4, help="Session sink."),
    sessions: str = typer.Option("1,2,4,8,16", help="Concurrent session counts for sessions_throughput."),
    session_tokens: int = typer.Option(24, help="Tokens each concurrent session generates."),
    prefill_tokens: int = typer.Option(256, help="Prompt length for the prefill comparison."),
    repeats: int = typer.Option(3, help="Interleaved pairs per ratio (the best run for the engine timings)."),
    round_trips: int = typer.Option(2000, help="Round trips per broker_overhead path."),
    transformers: bool = typer.Option(True, help="Compare with transformers/PyTorch where torch is installed."),
    stall_tokens: int = typer.Option(2000, help="prefill_stall: tokens another session appends while 2 stream."),
    stall_pairs: int = typer.Option(3, help="prefill_stall: interleaved (alone, during the append) pairs."),
    only: str | None = typer.Option(None, help="Run one part only: speculative or cpu."),
    spec_pairs: int = typer.Option(2, help="speculative: interleaved (off, on) pairs per workload."),
    spec_tokens: int = typer.Option(160, help="speculative: most tokens per reply."),
    draft_model: str | None = typer.Option(
        None, help="speculative: the draft model's file ('' for none) [default: the model itself]."
    ),
    draft_quantized: bool = typer.Option(False, help="speculative: keep the draft model's weights quantized."),
    kernels: str = typer.Option(KERNELS_DEFAULT, help=KERNELS_HELP),
    output: Path = typer.Option(Path("perf.json"), help="Report path; the plots go next to it (.png)."),
) -> None:
    """Measure the runtime against the bare model: decode, broker hops, concurrency, transformers."""
    from kvmux import logs

    from . import kernels as kernel_runs
    from . import plot
    from .perf import PerfConfig, run

    cfg = PerfConfig(
        model=model,
        decode_tokens=decode_tokens,
        window=window,
        sink=sink,
        sessions=tuple(int(n) for n in sessions.split(",")),
        session_tokens=session_tokens,
        prefill_tokens=prefill_tokens,
        repeats=repeats,
        round_trips=round_trips,
        transformers=transformers,
        stall_tokens=stall_tokens,
        stall_pairs=stall_pairs,
        only=only,
        spec_pairs=spec_pairs,
        spec_tokens=spec_tokens,
        draft_model=draft_model,
        draft_quantized=draft_quantized,
    )
    if only not in (None, "speculative", "cpu"):
        raise typer.BadParameter("--only takes: speculative, cpu")
    families = kernel_runs.parse(kernels)
    if kernel_runs.child() is None:
        doc = kernel_runs.run_each("perf", families, output, asdict(cfg))
        typer.echo(kernel_runs.columns({family: d["ratios"] for family, d in doc["families"].items()}))
        for family, d in doc["families"].items():
            if only is None:
                typer.echo(f"plot: {plot.plot_perf(d, output.with_name(f'{output.stem}-{family}.png'))}")
        typer.echo(f"report: {output}")
        return
    from kvmux.worker.preload import ensure_preloaded

    ensure_preloaded()  # the bare model must run with the worker's BLAS (re-execs once)
    logs.configure()
    run(cfg, output)


@bench_app.command()
def engine(
    model: str | None = typer.Option(None, help="GGUF file or mlx-lm directory (default: embedded SmolLM2)."),
    windows: str = typer.Option("2048,256", help="Windows to measure at (2048: the serve default)."),
    sink: int = typer.Option(4, help="Session sink."),
    repeats: int = typer.Option(5, help="Interleaved A/B pairs per ratio."),
    decode_tokens: int = typer.Option(16, help="Tokens per decode measurement."),
    sessions: str = typer.Option("8,16", help="Session counts for the shared-pass ratios (against 1)."),
    batch_invariant: bool = typer.Option(
        False, "--batch-invariant", help="Pad passes as a worker with --batch-invariant does (default: as by default)."
    ),
    kernels: str = typer.Option(KERNELS_DEFAULT, help=KERNELS_HELP),
    output: Path = typer.Option(Path("engine.json"), help="Report path."),
) -> None:
    """The engine where sessions live: full window vs empty, shared passes vs one, worker vs stock mlx-lm."""
    from kvmux import logs

    from . import kernels as kernel_runs
    from .engine import EngineConfig, run, summary

    cfg = EngineConfig(
        windows=tuple(int(w) for w in windows.split(",")),
        sink=sink,
        repeats=repeats,
        decode_tokens=decode_tokens,
        sessions=tuple(int(n) for n in sessions.split(",")),
        model=model,
        batch_invariant=batch_invariant,
    )
    families = kernel_runs.parse(kernels)
    if kernel_runs.child() is None:
        doc = kernel_runs.run_each("engine", families, output, asdict(cfg))
        typer.echo("engine (median ratio, min-max):")
        typer.echo(kernel_runs.columns({family: summary(d) for family, d in doc["families"].items()}))
        typer.echo(f"report: {output}")
        return
    from kvmux.worker.preload import ensure_preloaded

    ensure_preloaded()  # measure with the worker's BLAS (re-execs once)
    logs.configure()
    run(cfg, output)


@bench_app.command()
def peers(
    turns: int = typer.Option(400, help="Turns of the long conversation."),
    max_tokens: int = typer.Option(8, help="Reply length per turn (greedy)."),
    concurrent: int = typer.Option(4, help="Conversations at once for the aggregate tokens/s."),
    concurrent_turns: int = typer.Option(20, help="Turns per concurrent conversation."),
    regenerate_every: int = typer.Option(10, help="A regenerate every this many turns (chat completions); 0: none."),
    model_dir: Path | None = typer.Option(
        None, help="The mlx-lm directory for mlx_lm.server (default: exported from the embedded GGUF once)."
    ),
    output: Path = typer.Option(Path("peers.json"), help="Report path; the plot goes next to it (.png)."),
) -> None:
    """kvmux against mlx_lm.server: one long conversation and concurrent ones, side by side in one run."""
    from kvmux import logs

    logs.configure()
    from .peers import PeersConfig, default_model_dir, plot, run

    cfg = PeersConfig(
        turns=turns,
        max_tokens=max_tokens,
        concurrent=concurrent,
        concurrent_turns=concurrent_turns,
        regenerate_every=regenerate_every,
    )
    doc = run(cfg, output, model_dir or default_model_dir())
    png = plot(doc, output.with_suffix(".png"))
    typer.echo(json.dumps(doc["summary"], indent=1))
    typer.echo(f"report: {output}\nplot: {png}")


@bench_app.command()
def prefix(
    conversations: int = typer.Option(
        10, help="New conversations sharing the opening, on the worker that computed it."
    ),
    colds: int = typer.Option(3, help="Cold conversations (X-Kvmux-Prefix: off) interleaved, for the ratio."),
    others: int = typer.Option(3, help="Conversations after a daemon restart, and on another worker on Redis."),
    max_tokens: int = typer.Option(8, help="Reply length (greedy)."),
    model_dir: Path | None = typer.Option(
        None, help="The mlx-lm directory for mlx_lm.server (default: exported from the embedded GGUF once)."
    ),
    output: Path = typer.Option(
        Path("bench/results/prefix.json"), help="Report path; the plot goes next to it (.png)."
    ),
) -> None:
    """New conversations sharing a long opening: time to first token, kvmux's shared prefixes against the peers'."""
    from kvmux import logs

    from .peers import default_model_dir
    from .prefix import PrefixConfig, plot, run

    logs.configure()
    cfg = PrefixConfig(conversations=conversations, colds=colds, others=others, max_tokens=max_tokens)
    doc = run(cfg, output, model_dir or default_model_dir())
    png = plot(doc, output.with_suffix(".png"))
    typer.echo(json.dumps(doc["summary"], indent=1))
    typer.echo(f"report: {output}\nplot: {png}")


@bench_app.command()
def agent(
    steps: int = typer.Option(30, help="Requests of the scripted tool loop, per server."),
    max_tokens: int = typer.Option(48, help="Reply length per step (greedy)."),
    servers: str = typer.Option(
        "kvmux,mlx_lm", help="Servers to run the loop on: kvmux (through `kvmux http`), mlx_lm (mlx_lm.server)."
    ),
    constraint_reps: int = typer.Option(
        5, help="Interleaved (plain, JSON schema) pairs for the constrained-decoding cost (with kvmux; 0: skip)."
    ),
    constraint_tokens: int = typer.Option(96, help="Most tokens per constrained-decoding reply."),
    model_dir: Path | None = typer.Option(
        None, help="The mlx-lm directory for mlx_lm.server (default: exported from the embedded GGUF once)."
    ),
    output: Path = typer.Option(Path("bench/results/agent.json"), help="Report path; the plot goes next to it (.png)."),
) -> None:
    """An agent's tool loop through `kvmux http` against mlx_lm.server, and what a JSON schema costs decode."""
    from kvmux import logs

    from .agent import SERVERS, AgentConfig, plot, run
    from .peers import default_model_dir

    chosen = tuple(s.strip() for s in servers.split(",") if s.strip())
    if not chosen or set(chosen) - set(SERVERS):
        raise typer.BadParameter(f"one or more of {', '.join(SERVERS)}", param_hint="--servers")
    logs.configure()
    cfg = AgentConfig(
        steps=steps,
        max_tokens=max_tokens,
        servers=chosen,
        constraint_reps=constraint_reps,
        constraint_tokens=constraint_tokens,
    )
    doc = run(cfg, output, model_dir or default_model_dir())
    png = plot(doc, output.with_suffix(".png"))
    typer.echo(json.dumps(doc["summary"], indent=1))
    typer.echo(f"report: {output}\nplot: {png}")


@bench_app.command()
def models(
    model: list[str] = typer.Option(
        None, "--model", help="A GGUF file or mlx-lm dir; repeat for each (default: the embedded model)."
    ),
    rounds: int = typer.Option(5, help="Rounds; each runs every model once, in turn."),
    prompt_words: int = typer.Option(200, help="Words of plain text appended before each decode."),
    decode_tokens: int = typer.Option(128, help="Greedy tokens decoded per run (speculative off)."),
    switch_rounds: int = typer.Option(
        3, help="Rounds of the switch cost (two models or more): first token resident, loaded, after an unload."
    ),
    output: Path = typer.Option(Path("models.json"), help="Report path."),
) -> None:
    """Decode and prefill tok/s of models side by side through the daemon, interleaved; the cost of a switch."""
    import json

    from kvmux import logs

    from .models import ModelsConfig, run

    logs.configure()
    doc = run(
        ModelsConfig(
            models=model or [],
            rounds=rounds,
            prompt_words=prompt_words,
            decode_tokens=decode_tokens,
            switch_rounds=switch_rounds,
        ),
        output,
    )
    print(json.dumps(doc["summary"], indent=1))


@bench_app.command()
def admission(
    workers: int = typer.Option(2, help="Local workers."),
    slabs: int = typer.Option(2, help="Slabs per worker."),
    rounds: int = typer.Option(30, help="Opens timed per case."),
    clients: int = typer.Option(20, help="Clients opening at once in the load test."),
    max_tokens: int = typer.Option(8, help="Tokens each load-test client generates."),
    output: Path = typer.Option(Path("admission.json"), help="Report path."),
) -> None:
    """Open latency with free slabs vs queued, and broker stats after a load test."""
    from kvmux import logs

    from .admission import run

    logs.configure()
    doc = run(output, workers=workers, slabs=slabs, rounds=rounds, clients=clients, max_tokens=max_tokens)
    typer.echo(json.dumps({k: doc[k] for k in ("open_free", "open_queued_after_release", "load")}, indent=1))
    typer.echo(f"report: {output}")


@bench_app.command()
def sessions(
    sessions: int = typer.Option(64, help="Sessions taking turns, round robin."),
    slabs: int = typer.Option(4, help="Slabs of the one worker (sessions beyond hibernate)."),
    turns: int = typer.Option(3, help="Turns per session."),
    max_tokens: int = typer.Option(8, help="Tokens per reply."),
    repeats: int = typer.Option(3, help="Restore vs re-prefill pairs of a full default window, and worker kills."),
    phases: str = typer.Option(",".join(SESSION_PHASES), help="Phases to run, comma-separated."),
    stores: str = typer.Option("local,redis", help="Session stores to run each phase on: local, redis."),
    output: Path = typer.Option(Path("sessions.json"), help="Report path."),
) -> None:
    """Many sessions over few slabs, per session store: turn latency split into restore and turn, restore vs re-prefill, migration between workers, bytes per session."""
    from kvmux import logs

    from .sessions import STORES, run

    chosen = tuple(p.strip() for p in phases.split(",") if p.strip())
    if unknown := sorted(set(chosen) - set(SESSION_PHASES)):
        raise typer.BadParameter(f"unknown phase {', '.join(unknown)} (phases: {', '.join(SESSION_PHASES)})")
    kinds = tuple(s.strip() for s in stores.split(",") if s.strip())
    if unknown := sorted(set(kinds) - set(STORES)):
        raise typer.BadParameter(f"unknown store {', '.join(unknown)} (stores: {', '.join(STORES)})")
    logs.configure()
    doc = run(
        output,
        sessions=sessions,
        slabs=slabs,
        turns=turns,
        max_tokens=max_tokens,
        repeats=repeats,
        phases=chosen,
        stores=kinds,
    )
    typer.echo(json.dumps({k: doc[k] for k in ("stores", "crash_recovery") if k in doc}, indent=1))
    typer.echo(f"report: {output}")


@bench_app.command()
def fuzz(
    frames: int = typer.Option(100_000, help="Hostile frames, half at each socket."),
    seed: int = typer.Option(1, help="The generator's seed (a campaign repeats exactly)."),
    endpoint: str | None = typer.Option(None, help="A running daemon's frontend (default: start one)."),
    backend: str | None = typer.Option(None, help="Its backend (with --endpoint)."),
    broker_pid: int | None = typer.Option(None, help="Its broker's pid, to report its RSS (with --endpoint)."),
    output: Path = typer.Option(Path("fuzz.json"), help="Report path."),
) -> None:
    """Hostile frames at both sockets: frames/s, errors by code, the broker's RSS before and after."""
    from kvmux import logs

    from . import spawn
    from .fuzz import run

    logs.configure()
    if endpoint is None:
        with spawn.daemon(slabs=2) as d:
            doc = run(output, frames=frames, seed=seed, frontend=d.frontend, backend=d.backend, broker_pid=d.pid)
    else:
        if backend is None:
            raise typer.BadParameter("--endpoint needs --backend too")
        doc = run(output, frames=frames, seed=seed, frontend=endpoint, backend=backend, broker_pid=broker_pid)
    typer.echo(json.dumps(doc["results"], indent=1))
    typer.echo(f"report: {output}")


@bench_app.command()
def curve(
    n: int = typer.Option(1000, help="Round trips per block, per path and transport."),
    blocks: int = typer.Option(5, help="Blocks, alternating plain and CURVE."),
    output: Path = typer.Option(Path("curve.json"), help="Report path."),
) -> None:
    """What CURVE costs: ping and info round trips, plain tcp vs CURVE, side by side."""
    from kvmux import logs

    from .curve import run

    logs.configure()
    doc = run(output, n=n, blocks=blocks)
    typer.echo(json.dumps({k: doc[k] for k in ("results", "ratio_curve_to_plain")}, indent=1))
    typer.echo(f"report: {output}")


@bench_app.command()
def telemetry(
    pairs: int = typer.Option(100, help="Turn pairs, one turn on each daemon, the order swapped every pair."),
    max_tokens: int = typer.Option(16, help="Reply length per turn."),
    output: Path = typer.Option(Path("telemetry.json"), help="Report path."),
) -> None:
    """What metrics (scraped every second) and OpenTelemetry traces cost a turn: on vs off, side by side."""
    from kvmux import logs

    from .telemetry import run

    logs.configure()
    doc = run(output, pairs=pairs, max_tokens=max_tokens)
    typer.echo(json.dumps({k: doc[k] for k in ("results", "ratio_on_to_off")}, indent=1))
    typer.echo(f"report: {output}")


@bench_app.command()
def clients(
    info_calls: int = typer.Option(500, help="Session-info round trips per client and transport."),
    chats: int = typer.Option(5, help="Short chats timed to their first token."),
    output: Path = typer.Option(Path("clients.json"), help="Report path."),
) -> None:
    """Python vs Node client, ipc vs tcp: info round trip and time to first token."""
    from kvmux import logs

    from .clients import run

    logs.configure()
    doc = run(output, info_calls=info_calls, chats=chats)
    typer.echo(json.dumps(doc["results"], indent=1))
    typer.echo(f"report: {output}")


@bench_app.command()
def group(
    ranks: int = typer.Option(2, help="Processes the group's worker is made of (--pipeline)."),
    sessions: str = typer.Option("1,8", help="Sessions decoding at once, per phase, comma-separated."),
    tokens: int = typer.Option(32, help="Tokens each session generates per block."),
    blocks: int = typer.Option(3, help="Blocks per phase, alternating group and one process."),
    output: Path = typer.Option(Path("group.json"), help="Report path."),
) -> None:
    """A worker group against one process, side by side: tokens/s, per-token latency, bytes between ranks per token."""
    from kvmux import logs

    from .group import GroupConfig, run

    counts = tuple(int(n) for n in sessions.split(",") if n.strip())
    logs.configure()
    cfg = GroupConfig(ranks=ranks, sessions=counts, tokens=tokens, blocks=blocks, slabs=max(counts))
    doc = run(cfg, output)
    typer.echo(json.dumps({"layout": doc["layout"], **doc["summary"]}, indent=1))
    typer.echo(f"report: {output}")


@bench_app.command()
def report(
    paths_: list[Path] = typer.Argument(..., metavar="REPORT...", help="Soak or perf report JSON files."),
    write: bool = typer.Option(False, "--write", help="Store the recomputed summary back into the report."),
    plot_: bool = typer.Option(False, "--plot", help="(Re)draw the PNG next to each report."),
) -> None:
    """Recompute and print the summary of reports (an interrupted run's too);
    exit 1 if any soak fails a verdict or its KV series is unusable."""
    from . import plot
    from .report import load, write_json_atomic
    from .summary import SeriesError, summarize, verdicts_pass

    failed = False
    for path in paths_:
        doc = load(path)
        if doc.get("bench") == "perf":
            families = doc.get("families") or {"": doc}  # a report per kernel family, or one run's
            for family, d in families.items():
                typer.echo(f"{path}: perf ratios {family}\n{json.dumps(d.get('ratios'), indent=1)}")
                if plot_:
                    plot.plot_perf(d, path.with_name(f"{path.stem}{'-' if family else ''}{family}.png"))
            continue
        for block in filter(None, (doc, doc.get("baseline"))):
            try:
                block["summary"], block["summary_error"] = summarize(block["turns"]), None
            except SeriesError as exc:
                block["summary"], block["summary_error"] = None, str(exc)
        _print_summary(f"{path} (status {doc.get('status')})", doc["summary"], doc["summary_error"])
        failed |= bool(doc["summary_error"]) or not verdicts_pass(doc["summary"])
        if write:
            write_json_atomic(path, doc)
        if plot_:
            plot.plot_soak(doc, path.with_suffix(".png"))
    if failed:
        raise typer.Exit(1)
