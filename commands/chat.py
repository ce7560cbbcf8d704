"""`kvmux chat`: an interactive, streaming chat with one session.

Ctrl-C while a reply streams cancels that reply (the session keeps what was
generated); Ctrl-C or Ctrl-D at the prompt quits. `/info` shows the session's
cache, `/reset` starts a fresh session, `/quit` leaves.
"""

from __future__ import annotations

import typer

from kvmux.paths import default_frontend


def chat(
    endpoint: str = typer.Option(
        None, "--endpoint", "-e", help="Broker frontend. [default: the local daemon's, or $KVMUX_ENDPOINT]"
    ),
    system: str | None = typer.Option(None, help="System prompt."),
    max_tokens: int = typer.Option(512, min=1, help="Longest reply."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    window: int | None = typer.Option(None, min=1, help="Sliding window of the session (tokens)."),
    model: str | None = typer.Option(None, help="The model to chat with (default: the daemon's)."),
) -> None:
    """Chat with the daemon from the terminal."""
    from kvmux.client import Client, KvmuxError

    def open_session(client: Client):
        options = {"window": window} if window else {}
        return client.open_session(system=system, model=model, **options)

    with Client(endpoint or default_frontend()) as client:
        session = open_session(client)
        typer.secho(
            f"session {session.id} on {session.opened.worker_id} ({session.opened.model}); /info /reset /quit", dim=True
        )
        while True:
            try:
                text = input("> ")
            except (EOFError, KeyboardInterrupt):
                typer.echo()
                break
            if text.strip() in ("/quit", "/exit"):
                break
            if text.strip() == "/info":
                info = session.info()
                typer.echo(
                    f"history {info.history_tokens} tokens, cached {info.cached_tokens}, dropped {info.truncated_tokens}, "
                    f"kv {info.kv_live_bytes / 2**20:.1f} / {info.slab_bytes / 2**20:.1f} MiB, idle {info.idle_s:.1f}s"
                )
                continue
            if text.strip() == "/reset":
                session.close()
                session = open_session(client)
                typer.secho(f"new session {session.id}", dim=True)
                continue
            if not text.strip():
                continue
            stream = session.chat(text, max_tokens=max_tokens, temperature=temperature)
            try:
                for chunk in stream:
                    typer.echo(chunk.text, nl=False)
            except KeyboardInterrupt:
                stream.close()  # cancels on the worker and drains to the final frame
                typer.secho(" [cancelled]", dim=True, nl=False)
            except KvmuxError as exc:
                typer.secho(f"\n{type(exc).__name__}: {exc}", fg="red")
                continue
            typer.echo()
            result = stream.result
            if result is not None:
                rate = result.completion_tokens / result.decode_s if result.decode_s else 0.0
                typer.secho(
                    f"[{result.stop_reason}; prefill {result.prompt_tokens} tok {result.prefill_s:.2f}s, "
                    f"decode {result.completion_tokens} tok {rate:.1f} tok/s]",
                    dim=True,
                )
        session.close()


def register(app: typer.Typer) -> None:
    app.command()(chat)
