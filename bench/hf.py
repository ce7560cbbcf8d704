"""transformers/PyTorch (CPU) prefill and decode timing of a model (the GGUF
file or the model directory the worker loads), the reference
`vs_transformers` compares the worker's engine to.

Runs as its own process (`python -m kvmux.bench.hf`), started without the
OpenBLAS preload the MLX side uses, so each library runs with its own BLAS.
Reads {"model": path, "prompt_ids": [...], "decode_tokens": n, "repeats": r}
as JSON on stdin and prints the timings as JSON on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def measure(model_path: str, prompt_ids: list[int], decode_tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = path.parent if gguf else path
    model = AutoModelForCausalLM.from_pretrained(str(root), **gguf, dtype=torch.float32, local_files_only=True)
    model.eval()
    ids = torch.tensor([prompt_ids])
    prefill, decode = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            prefill.append(time.perf_counter() - t0)
            past = out.past_key_values
            t0 = time.perf_counter()
            for _ in range(decode_tokens):
                out = model(token, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = out.logits[:, -1:].argmax(-1)
            decode.append(time.perf_counter() - t0)
    best_prefill, best_decode = min(prefill), min(decode)
    return {
        "engine": f"transformers {__import__('transformers').__version__} / torch {torch.__version__} CPU float32",
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt_ids),
        "decode_tokens": decode_tokens,
        "prefill_s": best_prefill,
        "decode_s": best_decode,
        "prefill_tokens_per_s": len(prompt_ids) / best_prefill,
        "decode_tokens_per_s": decode_tokens / best_decode,
    }


def run_subprocess(model_path: str, prompt_ids: list[int], decode_tokens: int, repeats: int = 2) -> dict:
    """Measure in a child process without LD_PRELOAD (torch brings its own BLAS)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    job = {"model": str(model_path), "prompt_ids": prompt_ids, "decode_tokens": decode_tokens, "repeats": repeats}
    proc = subprocess.run(
        [sys.executable, "-m", "kvmux.bench.hf"], input=json.dumps(job), capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"transformers bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    job = json.load(sys.stdin)
    print(json.dumps(measure(job["model"], job["prompt_ids"], job["decode_tokens"], job["repeats"])))
