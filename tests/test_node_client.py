"""Runs the Node client's `node --test` suite (clients/typescript) against a
real stack, with a Python client chatting on the same daemon at the same
time; then its destructive worker-lost test on its own; its CURVE suite
against a stack whose tcp frontend checks client keys; and its tools,
structured output and logprobs suite."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import zmq.auth
from conftest import stacks_at_once

from kvmux.client import Client

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)

PACKAGE = Path(__file__).resolve().parent.parent / "clients" / "typescript"
NODE_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def node_package() -> Path:
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node/npm not installed")
    if not (PACKAGE / "node_modules").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=PACKAGE, check=True)
    subprocess.run(["npm", "run", "--silent", "build"], cwd=PACKAGE, check=True)
    return PACKAGE


@pytest.fixture(scope="module")
def stacks():
    """Each test's stack of its own, all started at once."""
    with stacks_at_once(suite={"slabs": 3}, tools={"slabs": 2}, curve={"slabs": 2, "curve": True}) as stacks:
        yield stacks


def node_test(package: Path, files: list[str], endpoint: str, **env: str) -> subprocess.Popen:
    # Without pytest's LD_PRELOAD (the Makefile's OpenBLAS, for the model in
    # pytest's own process): no business of node's, whose run under it once
    # printed "pthread_create: Invalid argument".
    inherited = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    return subprocess.Popen(
        ["node", "--test", "--test-concurrency=1", "--test-reporter=spec", *files],
        cwd=package,
        env={**inherited, "KVMUX_ENDPOINT": endpoint, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def passed(node: subprocess.Popen, stack) -> str:
    """The Node run's output once it ends (killed if it outlives its time),
    after checking that it passed."""
    try:
        output, _ = node.communicate(timeout=NODE_TIMEOUT_S)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert node.returncode == 0, f"{output}\n{stack.logs()}"
    assert "# fail 0" in output or "ℹ fail 0" in output, output
    return output


def test_node_suite_beside_a_python_client(stacks, node_package):
    stack = stacks["suite"]
    with Client(stack.frontend, timeout=60) as client, client.open_session() as session:
        node = node_test(node_package, ["dist/test/vectors.test.js", "dist/test/client.test.js"], stack.frontend)
        overlapping_turns = 0
        try:
            while node.poll() is None and overlapping_turns < 3:
                stream = session.chat("Say something short.", max_tokens=4)
                assert len(list(stream)) >= 1 and stream.result.completion_tokens >= 1
                overlapping_turns += node.poll() is None
        except BaseException:
            node.kill()
            node.wait()
            raise
        output = passed(node, stack)
        assert "skipped 0" in output, output  # the stack tests really ran
        assert overlapping_turns >= 1, "the Python client finished no turn while Node ran"

    lost = node_test(node_package, ["dist/test/worker-lost.test.js"], stack.frontend, KVMUX_KILL_WORKER="1")
    output, _ = lost.communicate(timeout=NODE_TIMEOUT_S)
    assert lost.returncode == 0 and "skipped 0" in output, f"{output}\n{stack.logs()}"


def test_node_tools_structured_output_logprobs(stacks, node_package):
    stack = stacks["tools"]
    output = passed(node_test(node_package, ["dist/test/tools.test.js"], stack.frontend), stack)
    assert "KVMUX_ENDPOINT not set" not in output, output  # the stack tests really ran


def test_node_chats_over_curve(stacks, node_package):
    stack = stacks["curve"]

    def keys(name: str) -> tuple[str, str]:
        public, secret = zmq.auth.load_certificate(stack.keys / f"{name}.key_secret")
        return public.decode(), secret.decode()

    server_key, _ = keys("server")
    alice, bob = keys("clients/alice"), keys("clients/bob")
    node = node_test(
        node_package,
        ["dist/test/curve.test.js"],
        stack.frontend,
        KVMUX_SERVER_KEY=server_key,
        KVMUX_PUBLIC_KEY=alice[0],
        KVMUX_SECRET_KEY=alice[1],
        KVMUX_OTHER_PUBLIC_KEY=bob[0],
        KVMUX_OTHER_SECRET_KEY=bob[1],
    )
    output = passed(node, stack)
    assert "skipped 0" in output, output  # the CURVE tests really ran
