"""The `kvmux` commands a person runs: doctor, chat, launchd print."""

from __future__ import annotations

import plistlib
import subprocess
import sys

import pytest
from conftest import kvmux_command

from kvmux.worker.preload import jemalloc_path


def run(*args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(kvmux_command(*args), input=input, capture_output=True, text=True, timeout=timeout)


def test_doctor_sees_the_daemon_and_the_worker_preloads(shared_stack):
    out = run("doctor", "--endpoint", shared_stack.frontend)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "embedded model" in out.stdout and "1 workers" in out.stdout
    if sys.platform.startswith("linux"):  # the worker re-executed itself with them
        assert "OpenBLAS preloaded" + (", jemalloc" if jemalloc_path() else "") in out.stdout, out.stdout
        assert "MB in huge pages" in out.stdout and "huge pages             transparent huge pages:" in out.stdout


def test_doctor_fails_without_a_daemon(tmp_path):
    out = run("doctor", "--endpoint", f"ipc://{tmp_path}/nothing.ipc", "--timeout", "0.5")
    assert out.returncode == 1
    assert "BAD broker" in out.stdout


def test_chat_streams_replies_and_answers_commands(shared_stack):
    out = run(
        "chat",
        "--endpoint",
        shared_stack.frontend,
        "--max-tokens",
        "6",
        input="What is 2+2?\n/info\n/reset\nHi\n/quit\n",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("[max_tokens") + out.stdout.count("[eos") == 2  # two replies with their stats line
    assert "history" in out.stdout and "kv" in out.stdout  # /info
    assert "new session" in out.stdout  # /reset


@pytest.mark.parametrize("system", [False, True])
def test_launchd_plist_is_valid_and_runs_serve(system):
    out = run("launchd", "print", *(["--system"] if system else []), "--", "--workers", "2")
    assert out.returncode == 0, out.stderr
    job = plistlib.loads(out.stdout.encode())
    assert job["Label"] == "com.kvmux.daemon"
    assert job["ProgramArguments"][1:] == ["-m", "kvmux.commands.cli", "serve", "--workers", "2"]
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["ThrottleInterval"] == 10  # a failing daemon is not restarted in a tight loop
    if system:  # never root: a dedicated role account, its state under /var/lib/kvmux
        assert job["UserName"] == job["GroupName"] == "_kvmux"
        assert job["EnvironmentVariables"]["KVMUX_STATE_DIR"] == "/var/lib/kvmux/state"
        assert job["EnvironmentVariables"]["KVMUX_RUNTIME_DIR"] == "/var/lib/kvmux/run"
    else:
        assert "UserName" not in job
