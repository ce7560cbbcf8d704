"""`kvmux bench perf`: the runtime's cost over the bare model, measured side
by side in one run on the same model.

- stack_vs_bare_decode: decode tokens/s of a stream through client -> broker
  -> worker, against mlx-lm's `generate_step` in this process on the model
  object the worker loads, with the same cache kind and the same prompt
  tokens (this process has OpenBLAS preloaded the way the worker has).
- broker_overhead: see roundtrip.py; ipc and tcp.
- sessions_throughput: aggregate generated tokens/s of 1, 2, 4, 8 concurrent
  sessions, relative to 1.
- prefill_stall: inter-token latency p99 of 2 streams while another session
  appends 2,000 tokens, against the same streams alone, in interleaved
  pairs (median, min, max of the ratio).
- vs_transformers: prefill and decode tokens/s of the worker's engine (the
  timings its replies carry) against transformers/PyTorch CPU on the same
  GGUF and the same prompt tokens, where torch is installed.
- speculative: decode tokens/s with speculative decoding against without,
  on edit, agentic and chat workloads (bench/speculative.py), with lookup
  drafts and with a draft model. `--only speculative` runs just this part.
- cpu: the CPU kernel against the machine's memory bandwidth, llama.cpp
  and the float32 fallback, and the workers' memory (bench/cpu.py).
  `--only cpu` runs just this part.

`kvmux bench perf` runs all this once per BLAS kernel family, each in a
run of its own (bench/kernels.py), and reports a column per family; each
run records the worker's kernels, padding mode and floors.

stack_vs_bare_decode, sessions_throughput and prefill_stall are ratios of
interleaved pairs (A B A B ...: the cores are shared and noisy), reported
as median, min and max; the engine and transformers timings are the best of
`repeats`. `--window` sets the sessions' window:
2048 is the serve default, 256 a short one; the report says which.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
from tqdm import tqdm

from kvmux.client import Client

from . import bare, cpu, hf, roundtrip, spawn, speculative
from .report import ReportWriter, percentile, ratio_summary

# Every part but `speculative` decodes a token per pass, as the bare model
# does: repeats of one prompt would otherwise be drafted from the worker's
# lookup of its last reply, and measure that instead of the engine.
PLAIN = "off"
STORY = "Write a long story about a dragon who learns to bake bread in a small mountain village."
PASSAGE = (
    "The river rose in the spring and the village moved its boats up the bank. Children counted the "
    "herons, the miller checked his wheel, and the old bridge creaked under carts of grain. "
)


@dataclass
class PerfConfig:
    model: str | None = None
    decode_tokens: int = 48
    window: int = 2048  # the serve default
    sink: int = 4
    sessions: tuple[int, ...] = (1, 2, 4, 8, 16)
    session_tokens: int = 24
    prefill_tokens: int = 256
    repeats: int = 3
    round_trips: int = 2000
    pipelined_frames: int = 20000
    transformers: bool = True
    timeout_s: float = 300.0
    stall_streams: int = 2
    stall_tokens: int = 2000
    stall_pairs: int = 3
    stall_normal_s: float = 6.0
    only: str | None = None  # "speculative": just that part
    spec_pairs: int = 2
    spec_tokens: int = 160  # max tokens per reply
    draft_model: str | None = None  # "" = no draft-model run; None = the verifier's own file
    draft_quantized: bool = False


def _stream_decode(session, max_tokens: int, **sampling) -> dict:
    """Time one generate stream on the client: first chunk to last chunk
    (greedy, or with the `sampling` settings given)."""
    stamps, tokens = [], []
    stream = session.generate(max_tokens=max_tokens, speculative=PLAIN, **sampling)
    for chunk in stream:
        stamps.append(time.perf_counter())
        tokens.append(len(chunk.token_ids))
    result = stream.result
    after_first = sum(tokens) - tokens[0]
    return {
        "completion_tokens": result.completion_tokens,
        "decode_tokens_per_s": after_first / (stamps[-1] - stamps[0]) if after_first else None,
        "worker_decode_tokens_per_s": result.completion_tokens / result.decode_s if result.decode_s else None,
        "worker_prefill_s": result.prefill_s,
    }


def stack_decode(client: Client, prompt_ids: list[int], cfg: PerfConfig, **sampling) -> dict:
    """One stream through the stack, from the same prompt tokens."""
    with client.open_session(sink=cfg.sink, window=cfg.window) as session:
        session.append(token_ids=prompt_ids)
        run = _stream_decode(session, cfg.decode_tokens, **sampling)
        run["token_ids"] = session.info(token_ids=True).token_ids[len(prompt_ids) :]
    return run


def stack_vs_bare(client: Client, loaded, prompt_ids: list[int], cfg: PerfConfig) -> dict:
    """Decode tokens/s through the stack against mlx-lm's generate_step in
    this process, in interleaved pairs (the daemon idles while the bare
    model runs)."""
    pairs, stack, bare_run = [], None, None
    for _ in range(cfg.repeats):
        bare_run = bare.measure(loaded, prompt_ids, cfg.decode_tokens, cfg.sink, cfg.window)
        stack = stack_decode(client, prompt_ids, cfg)
        pairs.append((bare_run["decode_tokens_per_s"], stack["decode_tokens_per_s"]))
    return {
        "ratio": ratio_summary(pairs),
        "stack": stack,
        "bare": bare_run,
        "same_tokens": stack["token_ids"] == bare_run["token_ids"],
    }


def at_once(n: int, run: Callable[[int], None]) -> float:
    """Seconds `run(0)` .. `run(n - 1)` take, each on a thread of its own,
    started together."""
    barrier = threading.Barrier(n + 1)

    def start(i: int) -> None:
        barrier.wait()
        run(i)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _sessions_tps(client: Client, n: int, cfg: PerfConfig) -> float:
    """Aggregate generated tokens/s of `n` sessions decoding at once."""
    sessions = [client.open_session(sink=cfg.sink, window=cfg.window) for _ in range(n)]
    for s in sessions:  # prefill outside the clock: this times generation only
        s.append([{"role": "user", "content": STORY}])
    counts = [0] * n

    def run(i: int) -> None:
        stream = sessions[i].generate(max_tokens=cfg.session_tokens, speculative=PLAIN)
        for _ in stream:
            pass
        counts[i] = stream.result.completion_tokens

    elapsed = at_once(n, run)
    for s in sessions:
        s.close()
    return sum(counts) / elapsed


def sessions_throughput(client: Client, cfg: PerfConfig) -> dict:
    """n sessions against 1, in interleaved pairs for each n."""
    return {
        "session_tokens": cfg.session_tokens,
        "vs_1": {
            str(n): ratio_summary(
                [(_sessions_tps(client, 1, cfg), _sessions_tps(client, n, cfg)) for _ in range(cfg.repeats)]
            )
            for n in cfg.sessions
            if n > 1
        },
    }


def _stream_gaps(session, stop: threading.Event, started: threading.Event) -> list[tuple[float, float]]:
    """(arrival, gap since the previous chunk) of one stream until `stop`."""
    arrivals = []
    with session.generate(max_tokens=4000, temperature=0.0, speculative=PLAIN) as stream:
        for _chunk in stream:
            arrivals.append(time.perf_counter())
            started.set()
            if stop.is_set():
                break
    return [(b, b - a) for a, b in itertools.pairwise(arrivals)]


def prefill_stall(client: Client, prompt_ids: list[int], cfg: PerfConfig) -> dict:
    """Inter-token latency of `stall_streams` streaming sessions while no one
    else works (A) and while another session appends `stall_tokens` tokens
    (B), in interleaved pairs: the p99 ratio B/A, median, min and max."""
    history = PASSAGE * (cfg.stall_tokens // 30 + 1)
    streams = [client.open_session() for _ in range(cfg.stall_streams)]
    for s in streams:
        s.append(token_ids=prompt_ids)
    pairs, append_s = [], []
    try:
        for _ in range(cfg.stall_pairs):
            p99 = []
            for appending in (False, True):
                stop, started, gaps = threading.Event(), threading.Event(), []
                threads = [
                    threading.Thread(target=lambda s=s, g=gaps, a=stop, b=started: g.extend(_stream_gaps(s, a, b)))
                    for s in streams
                ]
                for t in threads:
                    t.start()
                started.wait()
                time.sleep(0.5)  # every stream under way
                t0 = time.perf_counter()
                if appending:
                    with client.open_session() as other:
                        appended = other.append([{"role": "user", "content": history}]).new_tokens
                else:
                    time.sleep(cfg.stall_normal_s)
                t1 = time.perf_counter()
                if appending:
                    append_s.append(round(t1 - t0, 2))
                stop.set()
                for t in threads:
                    t.join()
                p99.append(percentile([g for at, g in gaps if t0 < at <= t1], 99))
            pairs.append((p99[0], p99[1]))
    finally:
        for s in streams:
            s.close()
    return {
        "streams": cfg.stall_streams,
        "appended_tokens": appended,
        "append_s": append_s,
        "itl_p99_ratio": ratio_summary(pairs),
    }


def engine_prefill_decode(client: Client, prompt_ids: list[int], cfg: PerfConfig) -> dict:
    """The worker engine's own timings (from its replies) for a long prompt."""
    best: dict = {}
    for _ in range(cfg.repeats):
        with client.open_session(sink=cfg.sink, window=len(prompt_ids) + cfg.decode_tokens + 8) as session:
            appended = session.append(token_ids=prompt_ids)
            stream = session.generate(max_tokens=cfg.decode_tokens, speculative=PLAIN)
            for _ in stream:
                pass
            result = stream.result
        prefill = appended.new_tokens / appended.prefill_s
        decode = result.completion_tokens / result.decode_s if result.decode_s else 0.0
        best["prefill_tokens_per_s"] = max(best.get("prefill_tokens_per_s", 0.0), prefill)
        best["decode_tokens_per_s"] = max(best.get("decode_tokens_per_s", 0.0), decode)
        best["prompt_tokens"], best["decode_tokens"] = appended.new_tokens, result.completion_tokens
    return {"engine": "kvmux worker (MLX)", **best}


def run(cfg: PerfConfig, output: Path) -> dict:
    from kvmux.worker import model as model_mod

    writer = ReportWriter(output, "perf", asdict(cfg), every_s=0.0)
    doc = writer.doc
    if cfg.only == "speculative":
        doc["speculative"] = speculative_part(cfg)
        doc["ratios"] = ratios(doc)
        writer.write("complete")
        return doc
    loaded = model_mod.load(cfg.model)
    doc["model"] = loaded.model_id
    from kvmux.worker.preload import preloaded

    doc["bench_process_openblas"] = preloaded()
    tok = loaded.tokenizer
    story_ids = list(tok.apply_chat_template([{"role": "user", "content": STORY}], add_generation_prompt=True))
    long_ids = tok.encode(PASSAGE * (cfg.prefill_tokens // 20 + 1), add_special_tokens=False)[: cfg.prefill_tokens]
    model_path = str(cfg.model or _default_model())
    doc["cpu"] = cpu.run(
        loaded,
        model_path,
        story_ids,
        PASSAGE,
        cfg.repeats,
        cfg.decode_tokens,
        lambda c, sampling: stack_decode(c, story_ids, cfg, **sampling),
    )
    writer.write()
    if cfg.only == "cpu":
        doc["ratios"] = ratios(doc)
        writer.write("complete")
        return doc
    steps = tqdm(total=8, desc="perf", unit="step")
    slabs = max(cfg.sessions) + 1
    started = time.perf_counter()
    with spawn.serve(workers=1, slabs=slabs, model=cfg.model) as frontend:
        doc["worker_start_s"] = round(time.perf_counter() - started, 2)  # serve started to a worker registered
        with Client(frontend, timeout=cfg.timeout_s) as client:
            worker = client.stats().workers[0]
            doc["worker_openblas"] = preloaded(worker.pid)
            doc["worker_compute"] = msgspec.to_builtins(worker.compute)  # kernels, mode, floors, padding's cost
            doc["stack_vs_bare_decode"] = stack_vs_bare(client, loaded, story_ids, cfg)
            steps.update()
            writer.write()
            doc["sessions_throughput"] = sessions_throughput(client, cfg)
            steps.update()
            writer.write()
            doc["engine"] = engine_prefill_decode(client, long_ids, cfg)
            steps.update()
            writer.write()
            doc["prefill_stall"] = prefill_stall(client, story_ids, cfg)
            steps.update()
            writer.write()
        ipc_direct = frontend.rsplit("/", 1)[0] + "/direct.ipc"
        doc["broker_overhead"] = {
            "ipc": roundtrip.measure(frontend, ipc_direct, n=cfg.round_trips, total=cfg.pipelined_frames)
        }
    steps.update()
    writer.write()
    with spawn.serve(workers=1, slabs=1, model=cfg.model, transport="tcp") as frontend:
        doc["broker_overhead"]["tcp"] = roundtrip.measure(
            frontend, spawn.tcp_endpoint(), n=cfg.round_trips, total=cfg.pipelined_frames
        )
    steps.update()
    writer.write()
    del loaded
    if cfg.transformers and hf.available():
        doc["transformers"] = hf.run_subprocess(
            str(cfg.model or _default_model()), long_ids, cfg.decode_tokens, cfg.repeats
        )
    else:
        doc["transformers"] = None
    steps.update()
    writer.write()
    doc["speculative"] = speculative_part(cfg)
    steps.update()
    steps.close()
    doc["ratios"] = ratios(doc)
    writer.write("complete")
    return doc


def speculative_part(cfg: PerfConfig) -> dict:
    """bench/speculative.py on a daemon with the defaults (lookup drafts),
    then on one with a draft model."""
    workloads = len(speculative.WORKLOADS)
    runs = 1 + (cfg.draft_model != "")
    progress = tqdm(total=runs * workloads * cfg.spec_pairs, desc="speculative", unit="pair")
    with spawn.serve(workers=1, slabs=2, model=cfg.model) as frontend, Client(frontend, timeout=cfg.timeout_s) as c:
        part = {"mode": "auto", **speculative.measure(c, "auto", cfg.window, cfg.spec_pairs, cfg.spec_tokens, progress)}
    part["window"] = cfg.window
    part["draft_model"] = None
    if cfg.draft_model != "":
        draft = cfg.draft_model or str(cfg.model or _default_model())
        args = ("--draft-model", draft, *(("--draft-quantized",) if cfg.draft_quantized else ()))
        with (
            spawn.serve(workers=1, slabs=2, model=cfg.model, serve_args=args) as frontend,
            Client(frontend, timeout=cfg.timeout_s) as c,
        ):
            measured = speculative.measure(c, "draft", cfg.window, cfg.spec_pairs, cfg.spec_tokens, progress)
        part["draft_model"] = {"model": Path(draft).name, "quantized": cfg.draft_quantized, **measured}
    progress.close()
    return part


def _default_model() -> Path:
    from kvmux.paths import default_model_path

    return default_model_path()


def ratios(doc: dict) -> dict:
    """The headline numbers, each >1 where kvmux is faster / costs more."""
    window = doc["config"]["window"]
    out = {"window": f"{window} ({'serve default' if window == 2048 else 'short'})"}
    spec = doc.get("speculative")
    if spec:
        for name in speculative.WORKLOADS:
            out[f"speculative_{name}_speedup"] = spec[name]["speedup"]
            out[f"speculative_{name}_acceptance"] = spec[name]["acceptance"]
            if spec["draft_model"]:
                out[f"speculative_draft_{name}_speedup"] = spec["draft_model"][name]["speedup"]
    if doc.get("cpu"):
        out.update(cpu.ratios(doc["cpu"]))
    if "stack_vs_bare_decode" not in doc:
        return out
    out["stack_vs_bare_decode"] = doc["stack_vs_bare_decode"]["ratio"]["median"]
    for transport, r in doc["broker_overhead"].items():
        out[f"broker_rtt_p50_vs_direct_{transport}"] = (
            r["broker_ping"]["round_trip"]["p50_us"] / r["direct"]["round_trip"]["p50_us"]
        )
        out[f"broker_rtt_p99_vs_direct_{transport}"] = (
            r["broker_ping"]["round_trip"]["p99_us"] / r["direct"]["round_trip"]["p99_us"]
        )
        out[f"broker_frames_per_s_vs_direct_{transport}"] = (
            r["broker_ping"]["pipelined"]["frames_per_s"] / r["direct"]["pipelined"]["frames_per_s"]
        )
        if "forwarded_info" in r:
            out[f"forwarded_rtt_p50_vs_direct_{transport}"] = (
                r["forwarded_info"]["round_trip"]["p50_us"] / r["direct"]["round_trip"]["p50_us"]
            )
    out["prefill_stall_itl_p99_ratio"] = doc["prefill_stall"]["itl_p99_ratio"]["median"]
    for n, ratio in doc["sessions_throughput"]["vs_1"].items():
        out[f"sessions_{n}_throughput_vs_1"] = ratio["median"]
    if doc.get("transformers"):
        out["vs_transformers_prefill"] = (
            doc["engine"]["prefill_tokens_per_s"] / doc["transformers"]["prefill_tokens_per_s"]
        )
        out["vs_transformers_decode"] = (
            doc["engine"]["decode_tokens_per_s"] / doc["transformers"]["decode_tokens_per_s"]
        )
    return out
