"""`kvmux bench prefix`: new agent conversations that share one long
opening (a system prompt of ~1,500 tokens and 5 tools), each a chat
completion streamed through an OpenAI-style server: time to first token
and the prompt tokens each server says it took from a cache, kvmux against
mlx_lm.server's prompt cache and llama.cpp's server (its slot keeps the
previous request's tokens), the same requests side by side in one run.

kvmux (`kvmux http` in front of `kvmux serve`, default settings) is
measured four ways: on the worker that computed the opening (the first
conversation cold, the rest hits, with cold conversations, `X-Kvmux-Prefix:
off`, interleaved for the ratio); after the daemon restarted on the same
state dir; and on another daemon whose worker never saw the opening but
reads the same Redis store (a real redis-server), where the first daemon
wrote it.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from . import spawn
from .peers import export_mlx_dir, http_gateway, llama_cpp_available, llama_cpp_server, mlx_lm_server
from .redis_server import redis_server
from .report import ReportWriter

LLAMA_CPP_CONTEXT = 4096


@dataclass
class PrefixConfig:
    conversations: int = 10  # new conversations on the worker that computed the opening
    colds: int = 3  # cold ones (no shared prefix) interleaved, for the ratio
    others: int = 3  # conversations after the restart, and on the other worker
    max_tokens: int = 8
    rules: int = 55  # lines of the system prompt: ~1,500 tokens with SmolLM2's tokenizer
    tools: int = 5


def opening(cfg: PrefixConfig) -> tuple[str, list[dict]]:
    """The shared opening: an agent's system prompt and its tools."""
    system = "You are the support agent of Acme Widgets. " + " ".join(
        f"Rule {i}: answer politely about widget W{i}, whose warranty lasts {i % 7 + 1} years."
        for i in range(cfg.rules)
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"lookup_{i}",
                "description": f"Look up the record {i} of a widget",
                "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
            },
        }
        for i in range(cfg.tools)
    ]
    return system, tools


def first_token(url: str, system: str, tools: list[dict], question: str, max_tokens: int, headers=None) -> dict:
    """One new conversation's first request, streamed: seconds to its
    first chunk with content or a call, and the usage the server reports."""
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "tools": tools,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    started = time.perf_counter()
    ttft, usage = None, None
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            delta = (event.get("choices") or [{}])[0].get("delta") or {}
            if ttft is None and (delta.get("content") or delta.get("tool_calls")):
                ttft = time.perf_counter() - started
            usage = event.get("usage") or usage
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached}


def series(url: str, cfg: PrefixConfig, label: str, questions: list[str], colds: int = 0, progress=True) -> list[dict]:
    """`questions` as new conversations (the first one's cold where
    nothing was computed yet); `colds` cold ones (`X-Kvmux-Prefix: off`,
    kvmux only) interleaved after the first."""
    system, tools = opening(cfg)
    plan = [(q, False) for q in questions]
    for i in range(colds):
        plan.insert(2 + 2 * i, (f"Cold question {i}: what is W{i + 40}?", True))
    rows = []
    for i, (question, cold) in enumerate(tqdm(plan, desc=label, unit="conv", disable=not progress)):
        headers = {"X-Kvmux-Prefix": "off"} if cold else None
        row = first_token(url, system, tools, question, cfg.max_tokens, headers)
        rows.append({"conversation": i + 1, "cold": cold, **row})
    return rows


def _questions(n: int, start: int = 0) -> list[str]:
    return [f"What is the warranty of W{i}?" for i in range(start, start + n)]


@contextlib.contextmanager
def kvmux(state: Path, *serve_args: str) -> Iterator[str]:
    """`kvmux http` in front of a fresh `kvmux serve` on `state`."""
    with spawn.daemon(state_dir=state, serve_args=serve_args) as daemon, http_gateway(daemon.frontend) as url:
        yield url


def summarize(doc: dict) -> dict:
    def median(rows, pick):
        values = [r["ttft_s"] for r in rows if pick(r) and r["ttft_s"] is not None]
        return round(statistics.median(values), 4) if values else None

    out = {}
    same = doc["kvmux"]["same_worker"]
    cold = median(same, lambda r: r["cold"] or r["conversation"] == 1)
    hit = median(same, lambda r: not r["cold"] and r["conversation"] > 1)
    out["kvmux"] = {
        "cold_ttft_s": cold,
        "hit_ttft_s": hit,
        "hit_vs_cold": round(hit / cold, 3) if cold and hit else None,
        "cached_tokens": sorted({r["cached_tokens"] for r in same if not r["cold"] and r["conversation"] > 1}),
    }
    for name in ("after_restart", "other_worker"):
        rows = doc["kvmux"].get(name) or []
        ttft = median(rows, lambda r: True)
        out["kvmux"][f"{name}_ttft_s"] = ttft
        out["kvmux"][f"{name}_vs_cold"] = round(ttft / cold, 3) if ttft and cold else None
    for peer in ("mlx_lm_server", "llama_cpp_server"):
        rows = doc.get(peer)
        if rows:
            first, rest = rows[0]["ttft_s"], median(rows[1:], lambda r: True)
            out[peer] = {
                "first_ttft_s": round(first, 4),
                "later_ttft_s": rest,
                "later_vs_kvmux_hit": round(rest / hit, 2) if rest and hit else None,
            }
    return out


def run(cfg: PrefixConfig, output: Path, model_dir: Path, progress: bool = True) -> dict:
    writer = ReportWriter(output, "prefix", asdict(cfg))
    doc = writer.doc
    doc["kvmux"] = {}
    with tempfile.TemporaryDirectory(prefix="kvb-prefix-") as tmp:
        state = Path(tmp) / "state"
        with kvmux(state) as url:
            doc["kvmux"]["same_worker"] = series(url, cfg, "kvmux", _questions(cfg.conversations), cfg.colds, progress)
            writer.write()
        with kvmux(state) as url:
            rows = series(url, cfg, "kvmux after a restart", _questions(cfg.others, 100), 0, progress)
            doc["kvmux"]["after_restart"] = rows
            writer.write()
        with redis_server(Path(tmp) / "redis") as redis:
            with kvmux(Path(tmp) / "a", "--store", redis.url) as url:  # it computes the opening, and stores it
                series(url, cfg, "kvmux on Redis", _questions(2, 200), 0, progress)
            with kvmux(Path(tmp) / "b", "--store", redis.url) as url:
                rows = series(url, cfg, "kvmux, another worker on Redis", _questions(cfg.others, 300), 0, progress)
                doc["kvmux"]["other_worker"] = rows
                writer.write()
    with mlx_lm_server(export_mlx_dir(model_dir), cfg.max_tokens) as (url, _):
        doc["mlx_lm_server"] = series(url, cfg, "mlx_lm.server", _questions(cfg.conversations), 0, progress)
        writer.write()
    if llama_cpp_available():
        from kvmux.paths import default_model_path

        with llama_cpp_server(default_model_path(), LLAMA_CPP_CONTEXT) as (url, _):
            doc["llama_cpp_server"] = series(url, cfg, "llama.cpp server", _questions(cfg.conversations), 0, progress)
    doc["summary"] = summarize(doc)
    writer.write("done")
    return doc


def plot(doc: dict, path: Path) -> Path:
    from .plot import plt, save  # matplotlib with its Agg backend

    fig, ax = plt.subplots(figsize=(9, 4.5))
    same = doc["kvmux"]["same_worker"]
    hits = [r for r in same if not r["cold"]]
    colds = [r for r in same if r["cold"]]
    ax.plot([r["conversation"] for r in hits], [r["ttft_s"] for r in hits], "o-", label="kvmux (shared prefix)")
    ax.plot([r["conversation"] for r in colds], [r["ttft_s"] for r in colds], "x", label="kvmux, prefix off (cold)")
    for name, label in (("mlx_lm_server", "mlx_lm.server (prompt cache)"), ("llama_cpp_server", "llama.cpp server")):
        rows = doc.get(name) or []
        if rows:
            ax.plot([r["conversation"] for r in rows], [r["ttft_s"] for r in rows], "s--", label=label)
    ax.set(
        xlabel="new conversation",
        ylabel="time to first token (s)",
        yscale="log",
        title="New conversations sharing a 1,500-token system prompt and 5 tools",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    return save(fig, path)
