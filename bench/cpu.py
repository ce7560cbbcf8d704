"""`kvmux bench perf --only cpu` (a part of every `bench perf` run): where
the CPU kernel (worker/native) stands against the machine and the peers,
at the daemon's default settings (window 2048 + sink 4), measured side by
side in one run:

- bandwidth: a STREAM-like copy (the bench's threads, 256 MB arrays),
  GB/s counting bytes read and written: the machine's memory bandwidth
  right now;
- kernel: the model's quantized products of one decode step (every
  projection and the head, one row each) evaluated on their own: weight
  bytes read per second, and that against the copy's bandwidth (the
  physical limit's yardstick);
- vs_llama_cpp: one session's greedy decode through the daemon against
  llama.cpp (llama-cpp-python on the same GGUF, the same thread count, a
  child process per run), interleaved pairs, the same prompt tokens; the
  instruction sets that llama.cpp ran (`llama_cpp_system_info`: the
  haswell family's is built for AVX2 alone, bench/kernels.py);
- vs_llama_cpp_sampled: the same, both sampling at a chat client's usual
  settings (SAMPLED: temperature 0.7, top-p 0.9; llama.cpp without its
  default top-k and min-p);
- int8: the same greedy decode on a daemon with `--cpu-products int8`
  (llama.cpp's arithmetic: x quantized to int8), against the exact
  products' daemon and against llama.cpp, interleaved;
- vs_float32: the same decode, and a 1,000-token message's prefill, on a
  daemon with `--cpu-kernel off` (float32 copies of the weights: what a
  worker did before, and does where the kernel is not built),
  interleaved with the kernel's daemon;
- vs_glibc_malloc: the same decode on a daemon whose worker runs without
  jemalloc (KVMUX_NO_JEMALLOC=1: glibc's allocator; worker/preload.py),
  where jemalloc is installed;
- vs_small_pages: the same decode on a daemon whose worker's heap stays
  on 4 KB pages (KVMUX_NO_HUGE_PAGES=1; worker/preload.py), where the
  kernel gives huge pages on request (THP mode "madvise");
- memory: each daemon's worker's resident set after its runs, and how
  much of it is in huge pages.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

from kvmux.client import Client
from kvmux.worker.preload import huge_pages_mb, jemalloc_path, thp_mode

from . import spawn
from .report import ratio_summary, rss_kb

COPY_BYTES = 256 << 20
PREFILL_TOKENS = 1000
LLAMA_CPP_CONTEXT = 4096
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 1}


def bandwidth(threads: int, repeats: int = 5) -> dict:
    """Best STREAM-like copy rate over `threads` threads (numpy's copy
    releases the GIL), bytes read plus bytes written."""
    src = np.ones(COPY_BYTES // 4, np.float32)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), threads)
    spans = [(int(p[0]), int(p[-1]) + 1) for p in parts]
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in spans]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return {"threads": threads, "copy_gb_per_s": round(2 * src.nbytes / best / 1e9, 2)}


def kernel_rate(loaded, repeats: int = 20) -> dict:
    """One decode step's quantized products, alone: bytes of weights per second."""
    import mlx.core as mx
    from mlx import nn

    model = loaded.model
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    if not linears:
        return {"kernel": loaded.kernel.describe(), "note": "no quantized weights: float32 products"}
    inputs = {id(m): mx.random.normal((1, m.weight.shape[1] * 32 // m.bits)) for m in linears}
    embed = model.model.embed_tokens
    head = isinstance(embed, nn.QuantizedEmbedding) and "lm_head" not in model
    h = mx.random.normal((1, embed.weight.shape[1] * 32 // embed.bits)) if head else None

    def step() -> list:
        outs = [m(inputs[id(m)]) for m in linears]
        return [*outs, embed.as_linear(h)] if head else outs

    mx.eval(step())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(step())
        best = min(best, time.perf_counter() - t0)
    modules = [*linears, embed] if head else linears
    weight_bytes = sum(m[part].nbytes for m in modules for part in ("weight", "scales", "biases") if part in m)
    return {
        "kernel": loaded.kernel.describe(),
        "products": len(modules),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "step_ms": round(best * 1000, 2),
        "gb_per_s": round(weight_bytes / best / 1e9, 2),
    }


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_cpp_decode(gguf: str, prompt_ids: list[int], tokens: int, threads: int, sampling: dict) -> dict:
    """llama.cpp's decode of `tokens` after `prompt_ids` (greedy, or with
    kvmux's `sampling` settings), in a child process (its threads and
    memory apart from the daemon's)."""
    args = json.dumps({"gguf": gguf, "prompt": prompt_ids, "tokens": tokens, "threads": threads, "sampling": sampling})
    done = subprocess.run(
        [sys.executable, "-c", "from kvmux.bench.cpu import llama_cpp_child; llama_cpp_child()", args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode:
        raise RuntimeError(f"llama.cpp run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cpp_child() -> None:
    """The child's side: load, prefill, decode, print the timings."""
    from llama_cpp import Llama, llama_print_system_info

    args = json.loads(sys.argv[1])
    sampling = args["sampling"]
    llm = Llama(
        model_path=args["gguf"],
        n_ctx=LLAMA_CPP_CONTEXT,
        n_threads=args["threads"],
        n_threads_batch=args["threads"],
        seed=sampling.get("seed", 0),
        verbose=False,
    )
    if sampling:  # top_k 0: no top-k, as kvmux's requests here
        chain = {"top_k": 0, "top_p": sampling["top_p"], "temp": sampling["temperature"]}
    else:
        chain = {"top_k": 1, "top_p": 1.0, "temp": 0.0}
    stamps, ids = [], []
    start = time.perf_counter()
    for token in llm.generate(args["prompt"], min_p=0.0, repeat_penalty=1.0, **chain):
        stamps.append(time.perf_counter())
        ids.append(token)
        if len(ids) == args["tokens"]:
            break
    print(
        json.dumps(
            {
                "engine": "llama.cpp (llama-cpp-python)",
                "threads": args["threads"],
                "system_info": llama_print_system_info().decode().strip(),  # the instruction sets it runs
                "first_token_s": stamps[0] - start,
                "decode_tokens_per_s": (len(ids) - 1) / (stamps[-1] - stamps[0]),
                "rss_kb": rss_kb(os.getpid()),
                "token_ids": ids,
            }
        )
    )


def _prefill(client: Client, message_ids: list[int]) -> float:
    """Tokens/s of one message's prefill on a fresh session (the worker's
    own timing); prefix snapshots off, or every round after the first
    would take the message from the first's."""
    with client.open_session(prefix="off") as session:
        appended = session.append(token_ids=message_ids)
    return appended.new_tokens / appended.prefill_s


def run(loaded, model_path: str, story_ids: list[int], passage: str, repeats: int, tokens: int, decode) -> dict:
    """The part's report (see the module's docstring); `decode(client,
    sampling)` is bench perf's one-session stream (`stack_decode`) of
    `tokens` tokens, greedy where `sampling` is empty."""
    threads = len(os.sched_getaffinity(0))
    doc: dict = {"threads": threads, "decode_tokens": tokens, "bandwidth": bandwidth(threads)}
    doc["kernel"] = kernel_rate(loaded)
    if "gb_per_s" in doc["kernel"]:
        doc["kernel"]["vs_copy_bandwidth"] = round(doc["kernel"]["gb_per_s"] / doc["bandwidth"]["copy_gb_per_s"], 3)
    message = loaded.tokenizer.encode(passage * (PREFILL_TOKENS // 20 + 1), add_special_tokens=False)[:PREFILL_TOKENS]
    llama = llama_cpp_available() and model_path.endswith(".gguf")
    progress = tqdm(total=repeats, desc="cpu kernel", unit="round")
    with (
        spawn.daemon(workers=1, slabs=2, model=model_path) as kernel_daemon,
        spawn.daemon(workers=1, slabs=2, model=model_path, serve_args=("--cpu-kernel", "off")) as off_daemon,
        Client(kernel_daemon.frontend, timeout=600) as kernel,
        Client(off_daemon.frontend, timeout=600) as off,
        _variant_client(model_path, {"KVMUX_NO_JEMALLOC": "1"}, jemalloc_path() is not None) as glibc_malloc,
        _variant_client(model_path, {"KVMUX_NO_HUGE_PAGES": "1"}, thp_mode() == "madvise") as small_pages,
        _variant_client(model_path, {"KVMUX_CPU_PRODUCTS": "int8"}, loaded.kernel.isa is not None) as int8,
    ):
        workers = {"kernel": kernel.stats().workers[0], "float32": off.stats().workers[0]}
        if int8 is not None:
            workers["int8"] = int8.stats().workers[0]
        variants = {"glibc_malloc": glibc_malloc, "small_pages": small_pages}
        workers |= {name: c.stats().workers[0] for name, c in variants.items() if c is not None}
        doc["compute"] = {name: w.compute.kernel for name, w in workers.items()}
        vs_llama, vs_llama_sampled, vs_off, prefill, vs_exact_int8, vs_llama_int8 = [], [], [], [], [], []
        vs_variant: dict[str, list] = {name: [] for name, c in variants.items() if c is not None}
        last: dict = {}
        for _ in range(repeats):
            if llama:
                last["llama_cpp"] = llama_cpp_decode(model_path, story_ids, tokens, threads, {})
                last["llama_cpp_sampled"] = llama_cpp_decode(model_path, story_ids, tokens, threads, SAMPLED)
                last["kvmux_sampled"] = decode(kernel, SAMPLED)
                vs_llama_sampled.append(
                    (last["llama_cpp_sampled"]["decode_tokens_per_s"], last["kvmux_sampled"]["decode_tokens_per_s"])
                )
            last["kvmux"] = decode(kernel, {})
            last["float32"] = decode(off, {})
            for name, pairs in vs_variant.items():
                last[name] = decode(variants[name], {})
                pairs.append((last[name]["decode_tokens_per_s"], last["kvmux"]["decode_tokens_per_s"]))
            if int8 is not None:
                last["int8"] = decode(int8, {})
                vs_exact_int8.append((last["kvmux"]["decode_tokens_per_s"], last["int8"]["decode_tokens_per_s"]))
            if llama:
                vs_llama.append((last["llama_cpp"]["decode_tokens_per_s"], last["kvmux"]["decode_tokens_per_s"]))
                if int8 is not None:
                    vs_llama_int8.append(
                        (last["llama_cpp"]["decode_tokens_per_s"], last["int8"]["decode_tokens_per_s"])
                    )
            vs_off.append((last["float32"]["decode_tokens_per_s"], last["kvmux"]["decode_tokens_per_s"]))
            prefill.append((_prefill(off, message), _prefill(kernel, message)))
            progress.update()
        progress.close()
        doc["vs_llama_cpp_decode"] = ratio_summary(vs_llama) if llama else None
        doc["vs_llama_cpp_sampled_decode"] = ratio_summary(vs_llama_sampled) if llama else None
        doc["sampled"] = SAMPLED
        doc["vs_float32_decode"] = ratio_summary(vs_off)
        for name in variants:
            doc[f"vs_{name}_decode"] = ratio_summary(vs_variant[name]) if name in vs_variant else None
        doc["vs_float32_prefill_1000"] = ratio_summary(prefill)
        doc["int8_vs_exact_decode"] = ratio_summary(vs_exact_int8) if int8 is not None else None
        doc["int8_vs_llama_cpp_decode"] = ratio_summary(vs_llama_int8) if vs_llama_int8 else None
        if int8 is not None:
            doc["same_tokens_int8_as_exact"] = last["int8"]["token_ids"] == last["kvmux"]["token_ids"]
        doc["same_tokens_as_float32"] = last["kvmux"]["token_ids"] == last["float32"]["token_ids"]
        if llama:
            doc["same_tokens_as_llama_cpp"] = last["kvmux"]["token_ids"] == last["llama_cpp"]["token_ids"]
            doc["llama_cpp_rss_mb"] = round(last["llama_cpp"]["rss_kb"] / 1024, 1)
            doc["llama_cpp_system_info"] = last["llama_cpp"]["system_info"]
        doc["worker_rss_mb"] = {name: round(rss_kb(w.pid) / 1024, 1) for name, w in workers.items()}
        doc["worker_huge_pages_mb"] = {name: huge_pages_mb(w.pid) for name, w in workers.items()}
    return doc


@contextlib.contextmanager
def _variant_client(model_path: str, env: dict[str, str], wanted: bool) -> Iterator[Client | None]:
    """A client of a daemon whose worker runs with `env` (glibc's
    allocator, small pages); None where the difference does not exist
    here (`wanted` false: no jemalloc to leave out, no huge pages to ask
    for)."""
    if not wanted:
        yield None
        return
    with (
        spawn.daemon(workers=1, slabs=2, model=model_path, env=env) as daemon,
        Client(daemon.frontend, timeout=600) as client,
    ):
        yield client


def ratios(doc: dict) -> dict:
    """The part's headline numbers for `bench perf`'s ratios."""
    out = {
        "cpu_decode_vs_float32": doc["vs_float32_decode"]["median"],
        "cpu_prefill_1000_vs_float32": doc["vs_float32_prefill_1000"]["median"],
        "cpu_worker_rss_vs_float32": round(doc["worker_rss_mb"]["kernel"] / doc["worker_rss_mb"]["float32"], 3),
    }
    if doc["vs_llama_cpp_decode"]:
        out["cpu_decode_vs_llama_cpp"] = doc["vs_llama_cpp_decode"]["median"]
    if doc.get("vs_llama_cpp_sampled_decode"):
        out["cpu_sampled_decode_vs_llama_cpp"] = doc["vs_llama_cpp_sampled_decode"]["median"]
    if doc.get("int8_vs_exact_decode"):
        out["cpu_int8_decode_vs_exact"] = doc["int8_vs_exact_decode"]["median"]
    if doc.get("int8_vs_llama_cpp_decode"):
        out["cpu_int8_decode_vs_llama_cpp"] = doc["int8_vs_llama_cpp_decode"]["median"]
    for name in ("glibc_malloc", "small_pages"):
        if doc.get(f"vs_{name}_decode"):
            out[f"cpu_decode_vs_{name}"] = doc[f"vs_{name}_decode"]["median"]
    if "vs_copy_bandwidth" in doc["kernel"]:
        out["cpu_kernel_gb_per_s_vs_copy"] = doc["kernel"]["vs_copy_bandwidth"]
    return out
