"""Each setting is declared once: a worker's in kvmux/settings.py's
WorkerSettings, the broker's own in broker/config.py, `kvmux worker`'s own in
worker/server.py. `kvmux serve`'s and `kvmux worker`'s options, their help,
docs/operations.md's tables and a local worker's command line all come from
them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from conftest import kvmux_command

from kvmux import settings
from kvmux.broker.config import SETTINGS, TABLE, load
from kvmux.broker.declared import declare
from kvmux.broker.local import LocalWorkers
from kvmux.commands.cli import app
from kvmux.worker import cli as worker_cli
from kvmux.worker.server import WorkerConfig

DOCS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"

# `kvmux serve`'s options before they were derived: scripts and plists use them.
OPTIONS_BEFORE = (
    "--config",
    "--frontend",
    "--backend",
    "--workers",
    "--slabs",
    "--model",
    "--chat-template",
    "--draft-model",
    "--draft-quantized",
    "--batch-invariant",
    "--admission",
    "--queue-depth",
    "--queue-wait-s",
    "--client-quota",
    "--idle-timeout-s",
    "--state-dir",
    "--hibernate-after-s",
    "--max-sessions",
    "--session-ttl-s",
    "--worker-wait-s",
    "--drain-grace-s",
    "--heartbeat-s",
    "--max-frame-bytes",
    "--max-tokens-limit",
    "--max-append-tokens",
    "--admin-endpoint",
    "--curve-secret",
    "--client-keys",
    "--worker-keys",
    "--admin-keys",
    "--insecure",
)
# `kvmux worker`'s, likewise
WORKER_OPTIONS_BEFORE = (
    "--connect",
    "--slabs",
    "--model",
    "--sink",
    "--window",
    "--worker-id",
    "--heartbeat-s",
    "--grace-s",
    "--state-dir",
    "--max-tokens-limit",
    "--max-append-tokens",
    "--chat-template",
    "--draft-model",
    "--draft-quantized",
    "--batch-invariant",
    "--server-key",
    "--curve-secret",
)
TABLES = pytest.mark.parametrize("table", [TABLE, worker_cli.TABLE], ids=["serve", "worker"])


def command(name: str):
    return typer.main.get_command(app).commands[name]


def options_of(name: str) -> set[str]:
    return {opt for param in command(name).params for opt in (*param.opts, *param.secondary_opts)}


@TABLES
def test_docs_table_is_the_declarations(table):
    text = DOCS.read_text()
    assert table.rewrite(text) == text, (
        f"docs/operations.md's settings table is stale: run `python -m {table.module} docs/operations.md`"
    )


@TABLES
def test_the_fix_command_rewrites_only_the_table(tmp_path, table):
    docs = tmp_path / "operations.md"
    docs.write_text(f"# Settings\n\n{table.start}\n| stale |\n{table.end}\n\nmore\n")
    subprocess.run([sys.executable, "-m", table.module, str(docs)], check=True, timeout=60)
    assert docs.read_text() == f"# Settings\n\n{table.start}\n{table.markdown()}\n{table.end}\n\nmore\n"


def test_every_setting_is_an_option_and_none_went_missing():
    options = options_of("serve")
    assert set(OPTIONS_BEFORE) <= options
    for setting in SETTINGS:
        assert (setting.type is None) == (setting.name in ("worker_args", "models"))  # a list is TOML only
        assert set(setting.option.split("/")) - {""} <= options
    options = options_of("worker")
    assert set(WORKER_OPTIONS_BEFORE) <= options
    for setting in worker_cli.SETTINGS:
        assert set(setting.option.split("/")) <= options


def test_command_line_wins_over_toml_and_what_is_not_given_stands(tmp_path):
    path = tmp_path / "kvmux.toml"
    path.write_text("batch_invariant = true\nqueue_depth = 5\nallow_session_override = false\nslabs = 2\n")
    args = ["--config", str(path), "--no-batch-invariant", "--queue-depth", "9", "--admission", "queue"]
    params = command("serve").make_context("serve", [*args, "--heartbeat-liveness", "3"]).params
    cfg = load(params.pop("config"), **params)
    assert (cfg.batch_invariant, cfg.queue_depth, cfg.admission, cfg.heartbeat_liveness) == (False, 9, "queue", 3.0)
    assert (cfg.allow_session_override, cfg.slabs, cfg.workers) == (False, 2, 1)  # the file's, then the defaults
    path.write_text('admission = "queue"\n')
    done = subprocess.run(
        kvmux_command("serve", "--workers", "0", "--config", str(path), "--queue-depth", "0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "admission = 'queue' needs queue_depth >= 1" in done.stderr


@pytest.mark.parametrize(("name", "declared"), [("serve", SETTINGS), ("worker", worker_cli.SETTINGS)])
def test_help_shows_each_default(name, declared):
    env = {**os.environ, "TERMINAL_WIDTH": "400"}  # one line per option: nothing wraps
    done = subprocess.run(kvmux_command(name, "--help"), capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    lines = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("│ --")}
    for setting in declared:
        if setting.type is not None:
            line = lines[setting.flag]
            assert f"[default: ({setting.default})]" in line, setting.name
            assert not setting.envvar or f"[env var: {setting.envvar}]" in line, setting.name


def test_worker_refuses_a_bad_value_naming_it(tmp_path):
    """Before it loads anything: the bound is msgspec's, as for serve."""
    for args, expected in (
        (["--slabs", "0"], "kvmux worker: command line: slabs: Expected `int` >= 1"),
        (["--grace-s", "-1"], "kvmux worker: command line: grace_s: Expected `float` >= 0"),
    ):
        done = subprocess.run(
            kvmux_command("worker", "--connect", f"ipc://{tmp_path}/none.ipc", *args),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2
        assert expected in done.stderr


def test_a_local_worker_gets_the_daemons_worker_settings(tmp_path, monkeypatch):
    """`kvmux serve`'s command line for a local worker, parsed by `kvmux
    worker`: each WorkerSettings value is the daemon's, worker_args win."""
    cfg = load(
        slabs=3,
        model=str(tmp_path / "m.gguf"),
        draft_model=str(tmp_path / "d.gguf"),
        batch_invariant=True,
        state_dir=str(tmp_path / "state"),
        heartbeat_s=0.5,
        max_append_tokens=100,
        worker_args=["--window", "256", "--no-batch-invariant"],
    )
    local = LocalWorkers(cfg, declare(cfg))
    local.backend = f"ipc://{tmp_path}/b.ipc"
    argv = local.command(local.slots[0])
    assert argv[:4] == [sys.executable, "-m", "kvmux.commands.cli", "worker"]
    monkeypatch.setenv("KVMUX_SERVER_KEY", "the-broker's")  # where a CURVE backend's local workers find it
    worker = settings.load(WorkerConfig, **command("worker").make_context("worker", argv[4:]).params)
    for setting in settings.declared(settings.WorkerSettings):
        if setting.name != "batch_invariant":
            assert getattr(worker, setting.name) == getattr(cfg, setting.name), setting.name
    assert (worker.batch_invariant, worker.window, worker.worker_id) == (False, 256, "local-0")
    assert (worker.connect, worker.server_key) == (local.backend, "the-broker's")
