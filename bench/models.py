"""`kvmux bench models`: models side by side through the daemon, one
`kvmux serve` each, all up at once and their runs interleaved (the machine
is shared and noisy: each round runs every model once, in turn).

A run is one session: a plain-text prompt of `prompt_words` words appended
as raw token ids (each model's own tokenizer: a base model may have no chat
template), then `decode_tokens` greedy tokens with speculative decoding off
(a token per pass). Per model: the worker's start (from `kvmux serve` to
registered), prefill and decode tok/s from the result frames, and each
model's median decode tok/s over the first model's.

Then the switch cost (`switch_rounds`, with two models or more): one
`kvmux serve` declaring the first two with a memory budget that holds one
at a time (`max_resident_bytes` = 1), so each switch unloads the other.
Each round times to the first token (from the open, or the call on an
existing session, through the append of a short prompt to the first chunk): on the first model while it is resident; on the
second, which must be loaded (the first is unloaded, its session
hibernated); and on the first model's session again, after its unload
(the model loaded again, the session restored).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvmux.client import Client
from kvmux.paths import default_model_path

from . import spawn
from .report import ReportWriter

STORY = "Once upon a time, in a small village by the sea, there lived a fisherman who"


@dataclass
class ModelsConfig:
    models: list[str] = field(default_factory=list)  # GGUF files or mlx-lm dirs
    rounds: int = 5
    prompt_words: int = 200
    decode_tokens: int = 128
    switch_rounds: int = 3  # 0: no switch cost


def _token_ids(model: str, words: int) -> list[int]:
    from kvmux.worker import gguf_tokenizer

    path = Path(model)
    if path.suffix == ".gguf":
        tokenizer = gguf_tokenizer.load(path)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    story = STORY.split()
    return tokenizer.encode(" ".join(story[i % len(story)] for i in range(words)), add_special_tokens=False)


def _run(frontend: str, ids: list[int], cfg: ModelsConfig) -> dict:
    with Client(frontend, timeout=600) as client, client.open_session() as session:
        appended = session.append(token_ids=ids)
        stream = session.generate(max_tokens=cfg.decode_tokens, temperature=0.0, speculative="off")
        for _chunk in stream:
            pass
        r = stream.result
        return {
            "prompt_tokens": appended.new_tokens,
            "prefill_tok_s": round(appended.new_tokens / appended.prefill_s, 2),
            "completion_tokens": r.completion_tokens,
            "decode_tok_s": round(r.completion_tokens / r.decode_s, 2),
        }


def _first_token(session, ids: list[int], started: float | None = None) -> float:
    """Seconds from `started` (the session's open; else now) to the first
    token of a one-token reply to `ids`."""
    started = time.monotonic() if started is None else started
    session.append(token_ids=ids)
    stream = session.generate(max_tokens=1, temperature=0.0, speculative="off")
    next(iter(stream))
    seconds = time.monotonic() - started
    for _chunk in stream:
        pass
    return seconds


def _switch(models: list[str], cfg: ModelsConfig) -> dict:
    """Time to first token on a resident model, on one that must be loaded,
    and on a session whose model was unloaded (one daemon, one model at a time)."""
    first, second = models[:2]
    ids = [_token_ids(m, 20) for m in (first, second)]
    args = ("--model", first, "--model", second, "--max-resident-bytes", "1")
    out: dict[str, list[float]] = {"resident_s": [], "load_s": [], "after_unload_s": []}
    with spawn.serve(workers=1, slabs=2, serve_args=args) as frontend, Client(frontend, timeout=600) as client:
        for _ in tqdm(range(cfg.switch_rounds), desc="switches", unit="round"):
            started = time.monotonic()
            kept = client.open_session(model=Path(first).name)
            out["resident_s"].append(_first_token(kept, ids[0], started))
            started = time.monotonic()
            with client.open_session(model=Path(second).name) as other:
                out["load_s"].append(_first_token(other, ids[1], started))
            out["after_unload_s"].append(_first_token(kept, ids[0]))
            kept.close()
    return {
        "resident": Path(first).name,
        "loaded": Path(second).name,
        "runs": out,
        **{f"{k}_median": round(statistics.median(v), 3) for k, v in out.items()},
    }


def run(cfg: ModelsConfig, output: Path) -> dict:
    models = cfg.models or [str(default_model_path())]
    names = [Path(m).name for m in models]
    writer = ReportWriter(output, "models", asdict(cfg))
    doc = writer.doc
    doc["models"] = {name: {"path": m, "runs": []} for name, m in zip(names, models, strict=True)}
    with contextlib.ExitStack() as stack:
        frontends = []
        for name, model in zip(names, models, strict=True):
            started = time.monotonic()
            frontends.append(stack.enter_context(spawn.serve(workers=1, slabs=1, model=model)))
            doc["models"][name]["worker_registered_s"] = round(time.monotonic() - started, 1)
        prompts = [_token_ids(m, cfg.prompt_words) for m in models]
        for _ in tqdm(range(cfg.rounds), desc="rounds", unit="round"):
            for name, frontend, ids in zip(names, frontends, prompts, strict=True):
                doc["models"][name]["runs"].append(_run(frontend, ids, cfg))
            writer.checkpoint()
    first = None
    for name in names:
        entry = doc["models"][name]
        entry["decode_tok_s_median"] = statistics.median(r["decode_tok_s"] for r in entry["runs"])
        entry["prefill_tok_s_median"] = statistics.median(r["prefill_tok_s"] for r in entry["runs"])
        first = first or entry["decode_tok_s_median"]
        entry["decode_vs_first"] = round(entry["decode_tok_s_median"] / first, 3)
    doc["summary"] = {
        name: {k: doc["models"][name][k] for k in ("decode_tok_s_median", "prefill_tok_s_median", "decode_vs_first")}
        for name in names
    }
    if cfg.switch_rounds and len(models) > 1:
        doc["switch"] = _switch(models, cfg)
        doc["summary"]["switch"] = {k: v for k, v in doc["switch"].items() if k != "runs"}
    writer.write("complete")
    return doc
