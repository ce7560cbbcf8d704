"""`kvmux bench peers`: kvmux against `mlx_lm.server` (the same engine and
model: an mlx-lm directory exported from the embedded GGUF, with the same
OpenBLAS preload) and llama.cpp's server (llama-cpp-python's, on the same
GGUF file, where it is installed: `make bench-peers`), one after the other
in one run.

- conversation: one long chat (default 400 turns, 8-token greedy replies).
  kvmux gets each turn's new message on its session (serve defaults: window
  2048 + sink 4); mlx_lm.server gets the whole history each turn, as an
  OpenAI-style client sends it, and reuses its prompt cache. Per turn:
  latency, the serving process's RSS, the reply.
- concurrent: 4 such conversations at once for `concurrent_turns` turns;
  aggregate generated tokens/s.
- gateway: the same long chat through `kvmux http` three ways: chat
  completions with the `openai` client (the whole history every turn, as an
  OpenAI client sends it), the Responses API (`previous_response_id`: only
  the new message), and Anthropic's Messages API with the `anthropic`
  client (the whole history), where those packages are installed.
- regenerate: every `regenerate_every` turns the chat completions client
  (kvmux http and mlx_lm.server alike) sends the conversation again without
  its last reply, as a chat UI's regenerate button does; timed apart.

The report compares per-turn latency (kvmux below the peer at every turn is
the goal), memory, aggregate tokens/s, and how many replies were equal (the
two see the same context until kvmux's window drops old turns).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from . import spawn
from .kernels import llama_cpp_lib
from .report import ReportWriter, percentile, rss_kb
from .soak import message

READY_TIMEOUT_S = 180.0
# kvmux decodes a token per pass here, as the peer does: the comparison is
# of what a turn costs to prefill and keep, and the gateway's run after the
# client's would otherwise draft the client's identical replies.
SPECULATIVE = "off"
# llama.cpp's context holds the whole conversation (400 turns: ~12k tokens),
# as mlx_lm.server's unbounded prompt cache does.
LLAMA_CPP_CONTEXT = 16384


@dataclass
class PeersConfig:
    turns: int = 400
    max_tokens: int = 8
    concurrent: int = 4
    concurrent_turns: int = 20
    regenerate_every: int = 10
    system: str = "Be brief."


def export_mlx_dir(path: Path) -> Path:
    """The embedded model as an mlx-lm directory (float32 weights, config,
    tokenizer), written once."""
    if (path / "config.json").exists():
        return path
    from mlx_lm.utils import save_config, save_model

    from kvmux.worker.model import load

    loaded = load(kernel="off")  # float32 weights, as the directory says
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + "."))
    save_model(tmp, loaded.model, donate_model=False)
    save_config(asdict(loaded.model.args), tmp / "config.json")
    loaded.tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def openai_server(name: str, cmd: list[str], port: int, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """A peer's OpenAI-compatible server process, until it answers
    /v1/models: its base URL and pid."""
    log_path = Path(tempfile.mkdtemp(prefix="peer-server-")) / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/v1/models", timeout=2).read()
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        spawn.stop(proc, timeout_s=20)
        log_path.unlink(missing_ok=True)
        log_path.parent.rmdir()


def mlx_lm_server(model_dir: Path, max_tokens: int):
    """`mlx_lm.server` (prompt cache on, its default), with the worker's
    OpenBLAS preload."""
    from kvmux.worker.preload import openblas_path

    port = _free_port()
    env = dict(os.environ)
    if lib := openblas_path():
        env["LD_PRELOAD"] = lib
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--temp", "0", "--max-tokens", str(max_tokens), "--log-level", "WARNING"]
    return openai_server("mlx_lm.server", cmd, port, env)


def llama_cpp_available() -> bool:
    """llama-cpp-python's server, built from its source distribution for the
    bench only (`make bench-peers` installs it; never a dependency of serve)."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return False
    return True


def llama_cpp_server(gguf: Path, n_ctx: int):
    """llama.cpp's server (llama-cpp-python's) on the same GGUF file, as
    stored (Q4_1), a thread per core; it keeps the previous request's
    tokens and prefills only what follows their common prefix."""
    port = _free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port)]
    cmd += ["--n_ctx", str(n_ctx), "--n_threads", str(os.cpu_count() or 1), "--verbose", "False"]
    env = dict(os.environ)
    if lib := llama_cpp_lib("native"):  # AVX-512 without AMX, where built
        env["LLAMA_CPP_LIB_PATH"] = lib
    return openai_server("llama.cpp server", cmd, port, env)


def peer_turn(url: str, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        doc = json.load(response)
    return doc["choices"][0]["message"]["content"], doc["usage"]["completion_tokens"]


class Kvmux:
    """A conversation on a kvmux session: only each turn's message goes out."""

    def __init__(self, client, system: str, max_tokens: int):
        self.session = client.open_session(system=system)
        self.max_tokens = max_tokens

    def turn(self, text: str) -> tuple[str, int]:
        stream = self.session.chat(text, max_tokens=self.max_tokens, temperature=0.0, speculative=SPECULATIVE)
        reply = "".join(chunk.text for chunk in stream)
        return reply, stream.result.completion_tokens


class HttpChat:
    """A conversation through `kvmux http` with the `openai` client: the
    whole history every turn; the gateway finds its session."""

    def __init__(self, url: str, system: str, max_tokens: int):
        import openai

        self.api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused-on-loopback", max_retries=0, timeout=600)
        self.max_tokens = max_tokens
        self.messages = [{"role": "system", "content": system}]

    def turn(self, text: str) -> tuple[str, int]:
        self.messages.append({"role": "user", "content": text})
        return self._reply()

    def regenerate(self) -> None:
        """The conversation again without its last reply; the new reply replaces it."""
        self.messages.pop()
        self._reply()

    def _reply(self) -> tuple[str, int]:
        completion = self.api.chat.completions.create(
            model="kvmux",
            messages=self.messages,
            max_tokens=self.max_tokens,
            temperature=0.0,
            extra_body={"speculative": SPECULATIVE},
        )
        reply = completion.choices[0].message.content
        self.messages.append({"role": "assistant", "content": reply})
        return reply, completion.usage.completion_tokens


class HttpResponses:
    """A conversation through `kvmux http`'s Responses API: each turn sends
    only its message and the previous response's id."""

    def __init__(self, url: str, system: str, max_tokens: int):
        import openai

        self.api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused-on-loopback", max_retries=0, timeout=600)
        self.system, self.max_tokens, self.previous = system, max_tokens, None

    def turn(self, text: str) -> tuple[str, int]:
        response = self.api.responses.create(
            model="kvmux",
            input=text,
            instructions=self.system,
            previous_response_id=self.previous,
            max_output_tokens=self.max_tokens,
            temperature=0.0,
            extra_body={"speculative": SPECULATIVE},
        )
        self.previous = response.id
        return response.output_text, response.usage.output_tokens


class HttpMessages:
    """A conversation through `kvmux http`'s Anthropic Messages API with the
    `anthropic` client: the whole history every turn (greedy: the worker's
    default; this SDK takes no temperature in `create`)."""

    def __init__(self, url: str, system: str, max_tokens: int):
        import anthropic

        self.api = anthropic.Anthropic(base_url=url, api_key="unused-on-loopback", max_retries=0, timeout=600)
        self.system, self.max_tokens, self.messages = system, max_tokens, []

    def turn(self, text: str) -> tuple[str, int]:
        self.messages.append({"role": "user", "content": text})
        message = self.api.messages.create(
            model="kvmux",
            system=self.system,
            messages=self.messages,
            max_tokens=self.max_tokens,
            extra_body={"speculative": SPECULATIVE},
        )
        reply = "".join(block.text for block in message.content if block.type == "text")
        self.messages.append({"role": "assistant", "content": reply})
        return reply, message.usage.output_tokens


@contextlib.contextmanager
def http_gateway(frontend: str) -> Iterator[str]:
    """`kvmux http` on a free loopback port, in front of `frontend`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvmux.commands.cli", "http", "--endpoint", frontend, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvmux http did not start (exit {proc.poll()})") from None
                time.sleep(0.2)
        yield url
    finally:
        spawn.stop(proc, timeout_s=10)


class Peer:
    """A conversation against a peer's OpenAI-compatible server: the whole
    history every turn."""

    def __init__(self, url: str, system: str, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.messages = [{"role": "system", "content": system}]

    def turn(self, text: str) -> tuple[str, int]:
        self.messages.append({"role": "user", "content": text})
        reply, tokens = peer_turn(self.url, self.messages, self.max_tokens)
        self.messages.append({"role": "assistant", "content": reply})
        return reply, tokens

    def regenerate(self) -> None:
        """The conversation again without its last reply; the new reply replaces it."""
        self.messages.pop()
        self.messages.append({"role": "assistant", "content": peer_turn(self.url, self.messages, self.max_tokens)[0]})


def conversation(
    new: Callable[[], object], pid: int, turns: int, name: str, progress: bool, regenerate_every: int = 0
) -> list[dict]:
    """Per turn: latency, RSS, tokens, the reply; and every
    `regenerate_every` turns (where the chat can) a regenerate's latency."""
    chat = new()
    rows = []
    for turn in tqdm(range(1, turns + 1), desc=f"{name} conversation", unit="turn", disable=not progress):
        started = time.perf_counter()
        reply, tokens = chat.turn(message(turn))
        row = {"turn": turn, "latency_s": round(time.perf_counter() - started, 4)}
        if regenerate_every and turn % regenerate_every == 0 and hasattr(chat, "regenerate"):
            started = time.perf_counter()
            chat.regenerate()
            row["regenerate_s"] = round(time.perf_counter() - started, 4)
        rows.append(row | {"rss_mb": round(rss_kb(pid) / 1024, 1), "tokens": tokens, "reply": reply})
    return rows


def concurrent(new: Callable[[], object], count: int, turns: int) -> dict:
    chats = [new() for _ in range(count)]
    tokens = [0] * count

    def run(i: int) -> None:
        for turn in range(1, turns + 1):
            tokens[i] += chats[i].turn(message(turn + 7 * i))[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    return {
        "conversations": count,
        "turns": turns,
        "tokens": sum(tokens),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(sum(tokens) / seconds, 2),
    }


def _has(package: str) -> bool:
    try:
        __import__(package)
    except ImportError:
        return False
    return True


GATEWAY_APIS = {  # report key: (the chat class, the package it needs)
    "kvmux_http": (HttpChat, "openai"),
    "kvmux_http_responses": (HttpResponses, "openai"),
    "kvmux_http_messages": (HttpMessages, "anthropic"),
}


def _gateway_summary(doc: dict, name: str, marks: list[int]) -> dict | None:
    """Per-turn latency through one of the gateway's APIs, and its cost over
    the Python client for the same turn (median of the per-turn differences)."""
    if name not in doc:
        return None
    g, k = doc[name]["conversation"], doc["kvmux"]["conversation"]
    turns = min(len(g), len(k))
    extra = sorted(g[i]["latency_s"] - k[i]["latency_s"] for i in range(turns))
    out = {
        "latency_s": {t: g[t - 1]["latency_s"] for t in marks if t <= len(g)},
        "latency_p50_s": percentile([r["latency_s"] for r in g], 50),
        "overhead_vs_client_p50_s": round(extra[len(extra) // 2], 4),
        "replies_equal_to_client": sum(g[i]["reply"] == k[i]["reply"] for i in range(turns)),
    }
    return out | _regenerates(g)


def _regenerates(rows: list[dict]) -> dict:
    """The regenerates' latency: median, and at the last one (the longest history)."""
    times = [r["regenerate_s"] for r in rows if "regenerate_s" in r]
    if not times:
        return {}
    return {"regenerates": len(times), "regenerate_p50_s": percentile(times, 50), "regenerate_last_s": times[-1]}


PEERS = ("mlx_lm_server", "llama_cpp_server")


def summarize(doc: dict) -> dict:
    """Per-turn latency at marked turns, memory, agreement and aggregate
    tokens/s of kvmux and each peer that ran."""
    k = doc["kvmux"]["conversation"]
    peers = [name for name in PEERS if name in doc]

    def at(rows: list[dict], turn: int, key: str):
        return rows[turn - 1][key] if turn <= len(rows) else None

    marks = [t for t in (2, 10, 20, 60, 100, 200, 300, 400) if t <= len(k)]
    runs = {"kvmux": k} | {name: doc[name]["conversation"] for name in peers}
    out = {
        "turns": len(k),
        "latency_s": {t: {name: at(rows, t, "latency_s") for name, rows in runs.items()} for t in marks},
        "latency_p50_s": {name: percentile([r["latency_s"] for r in rows], 50) for name, rows in runs.items()},
        "rss_mb_last": {name: rows[-1]["rss_mb"] for name, rows in runs.items()},
        "concurrent_tokens_per_s": {name: doc[name]["concurrent"]["tokens_per_s"] for name in runs},
    }
    out |= {name: _gateway_summary(doc, name, marks) for name in GATEWAY_APIS}
    for name in peers:
        p = runs[name]
        turns = min(len(k), len(p))
        equal = [k[i]["reply"] == p[i]["reply"] for i in range(turns)]
        out[name] = {
            "turns_kvmux_faster": sum(k[i]["latency_s"] < p[i]["latency_s"] for i in range(turns)),
            "replies_equal": sum(equal),
            "first_different_reply_turn": equal.index(False) + 1 if False in equal else None,
            "latency_p50_vs_kvmux": round(out["latency_p50_s"][name] / out["latency_p50_s"]["kvmux"], 3),
            "concurrent_tokens_per_s_vs_kvmux": round(
                out["concurrent_tokens_per_s"][name] / out["concurrent_tokens_per_s"]["kvmux"], 3
            ),
            **_regenerates(p),
        }
    return out


def run(cfg: PeersConfig, output: Path, model_dir: Path, progress: bool = True) -> dict:
    from kvmux.client import Client

    writer = ReportWriter(output, "peers", asdict(cfg))
    doc = writer.doc
    with spawn.daemon(slabs=cfg.concurrent + 1) as daemon, Client(daemon.frontend, timeout=600) as client:
        with Client(daemon.admin, timeout=10) as admin:
            worker_pid = admin.stats().workers[0].pid

        def new():
            return Kvmux(client, cfg.system, cfg.max_tokens)

        doc["kvmux"] = {"conversation": conversation(new, worker_pid, cfg.turns, "kvmux", progress)}
        writer.write()
        doc["kvmux"]["concurrent"] = concurrent(new, cfg.concurrent, cfg.concurrent_turns)
        writer.write()
        with http_gateway(daemon.frontend) as url:
            for name, (chat, package) in GATEWAY_APIS.items():
                if _has(package):
                    label = name.replace("_", " ", 1).replace("_", " /v1/")
                    new_chat = functools.partial(chat, url, cfg.system, cfg.max_tokens)
                    rows = conversation(new_chat, worker_pid, cfg.turns, label, progress, cfg.regenerate_every)
                    doc[name] = {"conversation": rows}
                    writer.write()
    with mlx_lm_server(export_mlx_dir(model_dir), cfg.max_tokens) as (url, pid):

        def new_peer():
            return Peer(url, cfg.system, cfg.max_tokens)

        rows = conversation(new_peer, pid, cfg.turns, "mlx_lm.server", progress, cfg.regenerate_every)
        doc["mlx_lm_server"] = {"conversation": rows}
        writer.write()
        doc["mlx_lm_server"]["concurrent"] = concurrent(new_peer, cfg.concurrent, cfg.concurrent_turns)
        writer.write()
    if llama_cpp_available():
        from kvmux.paths import default_model_path

        with llama_cpp_server(default_model_path(), LLAMA_CPP_CONTEXT) as (url, pid):

            def new_llama():
                return Peer(url, cfg.system, cfg.max_tokens)

            rows = conversation(new_llama, pid, cfg.turns, "llama.cpp server", progress)
            doc["llama_cpp_server"] = {"conversation": rows}
            writer.write()
            doc["llama_cpp_server"]["concurrent"] = concurrent(new_llama, cfg.concurrent, cfg.concurrent_turns)
    doc["summary"] = summarize(doc)
    writer.write("done")
    return doc


def plot(doc: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines = [("kvmux", "kvmux (session)"), ("kvmux_http", "kvmux http chat completions (whole history)")]
    lines += [("kvmux_http_responses", "kvmux http /v1/responses (previous_response_id)")]
    lines += [("kvmux_http_messages", "kvmux http /v1/messages (anthropic client)")]
    lines += [("mlx_lm_server", "mlx_lm.server (prompt cache)"), ("llama_cpp_server", "llama.cpp server (Q4_1)")]
    for name, label in lines:
        if name not in doc:
            continue
        rows = doc[name]["conversation"]
        turns = [r["turn"] for r in rows]
        lat.plot(turns, [r["latency_s"] for r in rows], label=label, linewidth=0.8)
        mem.plot(turns, [r["rss_mb"] for r in rows], label=label)
    lat.set(xlabel="turn", ylabel="turn latency (s)", title="One long conversation, 8-token replies")
    mem.set(xlabel="turn", ylabel="serving process RSS (MB)", title="Memory")
    for ax in (lat, mem):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_model_dir() -> Path:
    from kvmux.paths import state_dir

    return state_dir() / "models" / "smollm2-135m-mlx"
