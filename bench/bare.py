"""The bare-model reference for `stack_vs_bare_decode`: mlx-lm's own
`generate_step`, in this process, on the model object the worker loads, with
mlx-lm's stock cache of a slab's size (one `RotatingKVCache(sink + window,
keep=sink)` per layer, which `worker/slab.py` extends), greedy."""

from __future__ import annotations

import time


def measure(loaded, prompt_ids: list[int], max_tokens: int, sink: int, window: int) -> dict:
    """One run: seconds to the first token (prefill) and decode tokens/s
    counted between the first and the last token, the same way the stack's
    stream is timed on the client."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache

    eos = set(loaded.tokenizer.eos_token_ids)
    cache = [RotatingKVCache(max_size=sink + window, keep=sink) for _ in loaded.model.layers]
    tokens, stamps = [], []
    start = time.perf_counter()
    for token, _logprobs in generate_step(
        mx.array(prompt_ids), loaded.model, max_tokens=max_tokens, prompt_cache=cache
    ):
        stamps.append(time.perf_counter())
        tokens.append(token)
        if token in eos:
            break
    return {
        "engine": "mlx-lm generate_step",
        "prompt_tokens": len(prompt_ids),
        "first_token_s": stamps[0] - start,
        "completion_tokens": len(tokens),
        "decode_tokens_per_s": (len(tokens) - 1) / (stamps[-1] - stamps[0]) if len(tokens) > 1 else None,
        "token_ids": tokens,
    }
