"""CURVE on tcp, key allowlists, admin separation and session ownership, on
real brokers and workers (`Stack(curve=True)`: frontend and backend on tcp
with CURVE, keys in `stack.keys`)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time

import pytest
import zmq
import zmq.auth
from conftest import STARTUP_TIMEOUT_S, Stack, broker_stats, free_tcp_port, kvmux_command

from kvmux.client import Client, Forbidden, SessionNotFound, Timeout


@pytest.fixture(scope="module")
def curve_stack():
    stack = Stack(workers=1, slabs=3, curve=True)
    yield stack
    stack.stop()


def keyed(stack: Stack, name: str, timeout: float = 60.0, where: str = "clients") -> Client:
    return Client(
        stack.frontend,
        timeout=timeout,
        server_key=stack.keys / "server.key",
        secret_key=stack.keys / where / f"{name}.key_secret",
    )


def reply(session, text: str) -> list[int]:
    return [t for chunk in session.chat(text, max_tokens=4) for t in chunk.token_ids]


@pytest.mark.stack
def test_clients_without_an_allowed_key_get_nothing_through(curve_stack):
    sessions = curve_stack.stats().sessions
    with Client(curve_stack.frontend, timeout=1.5) as anonymous, pytest.raises(Timeout, match="CURVE"):
        anonymous.open_session()
    stranger = curve_stack.dir / "stranger"
    stranger.mkdir()
    zmq.auth.create_certificates(stranger, "eve")
    with (
        Client(
            curve_stack.frontend,
            timeout=1.5,
            server_key=curve_stack.keys / "server.key",
            secret_key=stranger / "eve.key_secret",
        ) as eve,
        pytest.raises(Timeout, match="server key"),
    ):
        eve.open_session()
    wrong_server = zmq.curve_keypair()[0].decode()
    with (
        Client(
            curve_stack.frontend,
            timeout=1.5,
            server_key=wrong_server,
            secret_key=curve_stack.keys / "clients" / "alice.key_secret",
        ) as lost,
        pytest.raises(Timeout, match="server key"),
    ):
        lost.ping()
    assert curve_stack.stats().sessions == sessions  # none was created
    assert "curve_denied" in curve_stack.logs()


@pytest.mark.stack
def test_an_allowed_key_chats_and_owns_its_session(curve_stack):
    with keyed(curve_stack, "alice") as alice, keyed(curve_stack, "bob") as bob:
        session = alice.open_session(system="Be brief.")
        first = reply(session, "Name a fruit.")
        assert first
        with pytest.raises(SessionNotFound):
            bob.resume_session(session.id)
        assert session.id not in {s.session_id for s in bob.list_sessions()}
        assert session.id in {s.session_id for s in alice.list_sessions()}
        # A session id alone is not enough: bob's raw calls on it find nothing.
        intruder = bob._session_class(bob, session.opened)
        with pytest.raises(SessionNotFound):
            intruder.info(token_ids=True)
        with pytest.raises(SessionNotFound):
            reply(intruder, "Tell me alice's secrets.")
        with pytest.raises(SessionNotFound):
            intruder.close()
        assert alice.resume_session(session.id).info().history_tokens > 0  # untouched
        # The owner is in the session's record: a restarted broker keeps it.
        session.detach()
    curve_stack.restart_broker()
    curve_stack.wait_workers(1)
    with keyed(curve_stack, "alice") as alice, keyed(curve_stack, "bob") as bob:
        with pytest.raises(SessionNotFound):
            bob.resume_session(session.id)
        again = alice.resume_session(session.id)
        assert reply(again, "Name a colour.")
        again.close()


@pytest.mark.stack
def test_drain_needs_an_admin(curve_stack):
    with keyed(curve_stack, "alice") as alice:
        with pytest.raises(Forbidden):
            alice.drain()
        session = alice.open_session()
        assert reply(session, "Say hi.")  # still serving
        session.close()
    assert not curve_stack.stats().draining


@pytest.mark.stack
def test_a_worker_with_an_unknown_key_never_registers(curve_stack):
    rogue = curve_stack.dir / "rogue"
    rogue.mkdir()
    zmq.auth.create_certificates(rogue, "mallory")
    proc = curve_stack._spawn(
        "rogue-worker",
        kvmux_command(
            "worker",
            "--connect",
            curve_stack.backend,
            "--server-key",
            str(curve_stack.keys / "server.key"),
            "--curve-secret",
            str(rogue / "mallory.key_secret"),
            "--worker-id",
            "rogue",
            "--state-dir",
            str(curve_stack.state),
        ),
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while "worker_registering" not in (curve_stack.dir / "rogue-worker.log").read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(3)  # several handshake attempts
        assert [w.worker_id for w in curve_stack.stats().workers] == [curve_stack.stats().workers[0].worker_id]
        assert "rogue" not in {w.worker_id for w in curve_stack.stats().workers}
        broker_log = (curve_stack.dir / "broker.log").read_text(errors="replace")
        assert "curve_denied" in broker_log and "kvmux-backend" in broker_log
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.stack
def test_a_key_added_or_removed_counts_without_a_restart(curve_stack):
    zmq.auth.create_certificates(curve_stack.dir, "carol")
    with (
        Client(
            curve_stack.frontend,
            timeout=1.5,
            server_key=curve_stack.keys / "server.key",
            secret_key=curve_stack.dir / "carol.key_secret",
        ) as carol,
        pytest.raises(Timeout),
    ):
        carol.ping()
    shutil.copy(curve_stack.dir / "carol.key", curve_stack.keys / "clients" / "carol.key")
    time.sleep(1.5)  # the broker looks at its key dirs at most once a second
    with Client(
        curve_stack.frontend,
        timeout=10,
        server_key=curve_stack.keys / "server.key",
        secret_key=curve_stack.dir / "carol.key_secret",
    ) as carol:
        carol.ping()
    (curve_stack.keys / "clients" / "carol.key").unlink()
    time.sleep(1.5)
    with (
        Client(
            curve_stack.frontend,
            timeout=1.5,
            server_key=curve_stack.keys / "server.key",
            secret_key=curve_stack.dir / "carol.key_secret",
        ) as carol,
        pytest.raises(Timeout),
    ):
        carol.ping()


@pytest.mark.stack
def test_an_admin_key_drains_over_tcp(tmp_path):
    stack = Stack(workers=0, curve=True)
    try:
        with keyed(stack, "root", where="admin", timeout=10) as root:
            root.ping()
            root.drain(0)
        stack.broker.wait(30)
        assert stack.broker.returncode == 0
    finally:
        stack.stop()


def test_keys_new_writes_a_private_pair(tmp_path):
    done = subprocess.run(
        kvmux_command("keys", "new", "laptop", "--dir", str(tmp_path / "k")), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    public, secret = zmq.auth.load_certificate(tmp_path / "k" / "laptop.key_secret")
    assert public.decode() in done.stdout and secret
    assert stat.S_IMODE((tmp_path / "k" / "laptop.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    again = subprocess.run(kvmux_command("keys", "new", "laptop", "--dir", str(tmp_path / "k")), capture_output=True)
    assert again.returncode == 1 and b"exists" in again.stderr


def test_serve_refuses_an_open_tcp_endpoint_beyond_loopback(tmp_path):
    port = free_tcp_port()
    base = ["serve", "--workers", "0", "--state-dir", str(tmp_path / "state")]
    base += ["--admin-endpoint", f"ipc://{tmp_path}/a.ipc", "--backend", f"ipc://{tmp_path}/b.ipc"]
    env = {**os.environ, "KVMUX_RUNTIME_DIR": str(tmp_path)}
    refused = subprocess.run(
        kvmux_command(*base, "--frontend", f"tcp://0.0.0.0:{port}"), env=env, capture_output=True, text=True
    )
    assert refused.returncode == 2
    assert "insecure" in refused.stderr and "curve_secret" in refused.stderr
    serve = subprocess.Popen(
        kvmux_command(*base, "--frontend", f"tcp://0.0.0.0:{port}", "--insecure"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while (stats := broker_stats(f"ipc://{tmp_path}/a.ipc", 1.0)) is None:
            assert serve.poll() is None and time.monotonic() < deadline
        frontend = next(e for e in stats.endpoints if e.name == "frontend")
        assert "OPEN to the network" in frontend.protection
        assert broker_stats(f"tcp://127.0.0.1:{port}") is not None  # it serves there
    finally:
        serve.terminate()
        serve.wait(30)
