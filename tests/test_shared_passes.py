"""Sessions sharing forward passes (worker/forward.py): what a session gets
in a pass with others, at a full window, in either padding mode on either
BLAS kernel family (worker/padding.py), and while another session's long
history goes in (docs/design.md, "Shared passes")."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import KERNELS

from kvmux.client import Client

PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain how bread rises, step by step, in detail.",
    "Describe a walk through a busy market in the morning.",
    "List the planets and say one thing about each.",
    "Tell a story about a robot learning to paint.",
    "Explain why the sea is salty, at length.",
    "Describe the life of a honey bee through a year.",
    "Write a letter from a sailor to his family.",
]


def decode(session, max_tokens: int) -> list[int]:
    return [t for chunk in session.generate(max_tokens=max_tokens, temperature=0.0) for t in chunk.token_ids]


def together_and_alone(stack, hf_tokenizer, near_tie, count: int, tokens: int) -> None:
    """`count` sessions, each past its window (sinks and windows differ),
    decode `tokens` together and then alone: the same tokens, or (a worker
    whose passes are not exact) a parting at a near tie."""
    shapes = [(4, 96 + 16 * i) if i % 2 else (0, 128 + 8 * i) for i in range(count)]
    # Plain text to continue (no chat turn to end), longer than any window.
    prompts = [hf_tokenizer.encode(" ".join(f"{p} Part {k}." for k in range(12))) for p in PROMPTS[:count]]
    exact = stack.exact()
    with Client(stack.frontend, timeout=600) as client:
        sessions = [client.open_session(sink=s, window=w) for s, w in shapes]
        for session, ids in zip(sessions, prompts, strict=True):
            session.append(token_ids=ids)
        together: dict[int, list[int]] = {}
        threads = [
            threading.Thread(target=lambda i=i: together.__setitem__(i, decode(sessions[i], tokens)))
            for i in range(count)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for session in sessions:
            assert session.info().truncated_tokens > 0  # decoded at a full window
            session.close()
        alone = []
        for (sink, window), ids in zip(shapes, prompts, strict=True):
            with client.open_session(sink=sink, window=window) as session:
                session.append(token_ids=ids)
                alone.append(decode(session, tokens))
    for i, (sink, window) in enumerate(shapes):
        near_tie(prompts[i], alone[i], together[i], exact, sink=sink, window=window)


@pytest.mark.stack
@pytest.mark.parametrize("kernels", KERNELS)
def test_eight_sessions_past_their_windows_batched_give_what_they_give_alone(
    stack_factory, hf_tokenizer, near_tie, kernels
):
    """The default mode, on either kernel family: 8 sessions decode 160
    tokens together as alone (96 on the forced AVX2 kernels, slower here),
    bit for bit: kvmux's CPU kernel sums each row in a fixed order, so
    nothing needs padding (test_native.py has the fallback's near ties),
    and the worker says so."""
    stack = stack_factory(workers=1, slabs=8, env=KERNELS[kernels])
    compute = stack.stats().workers[0].compute
    assert compute.mode == "default" and compute.blas.startswith("OpenBLAS")
    assert compute.exact and not compute.floors and not compute.rows_alone and compute.pad_cost == 1.0
    if kernels == "haswell":
        assert compute.blas == "OpenBLAS Haswell" and compute.kernel.startswith("kvmux_native avx2")
    together_and_alone(stack, hf_tokenizer, near_tie, 8, 160 if kernels == "native" else 96)


@pytest.mark.stack
@pytest.mark.parametrize("kernels", KERNELS)
def test_batch_invariant_mode_is_bit_identical_on_either_kernel_family(stack_factory, hf_tokenizer, near_tie, kernels):
    """--batch-invariant pads every pass whatever it costs: sessions decode
    together exactly what they decode alone, bit for bit."""
    stack = stack_factory(workers=1, slabs=3, worker_args=["--batch-invariant"], env=KERNELS[kernels])
    compute = stack.stats().workers[0].compute
    assert compute.mode == "batch-invariant" and compute.exact
    together_and_alone(stack, hf_tokenizer, near_tie, 3, 24)


@pytest.mark.stack
def test_a_session_keeps_streaming_while_another_appends_a_long_history(stack_factory, hf_tokenizer):
    """A 1,200-token append shares passes with a running stream: the stream
    gets tokens all through the append, one per pass, and the passes carry a
    few prefill tokens each (worker/pace.py keeps such a pass within ~2x a
    decode-only one), not a 128-token chunk; it keeps going after. On a
    worker of its own: its pace learns from this stream's rounds alone (a
    shared worker's earlier rounds could hold the share at one token). The
    append is long enough that a tenth of it (~0.3 s here) outlasts a stall
    of the 2-core CI host running two tests at once."""
    stack = stack_factory(workers=1, slabs=2)
    counting = hf_tokenizer.encode(", ".join(str(i) for i in range(1, 40)) + ",")  # the model counts on, no EOS
    long_text = " ".join(f"Item {i} is a small grey stone from the river bank." for i in range(86))
    arrivals: list[float] = []
    result = {}
    with (
        Client(stack.frontend, timeout=300) as client,
        client.open_session() as streaming,
        client.open_session() as appending,
    ):
        streaming.append(token_ids=counting)
        stream = streaming.generate(max_tokens=4000, temperature=0.0)
        next(stream)

        def append():
            result["started"] = time.monotonic()
            result["reply"] = appending.append([{"role": "user", "content": long_text}])
            result["ended"] = time.monotonic()

        worker = threading.Thread(target=append)
        worker.start()
        for _chunk in stream:
            arrivals.append(time.monotonic())
            if "ended" in result and arrivals[-1] > result["ended"] + 1:
                break  # the stream outlived the append: enough
        stream.close()
        worker.join()
    appended = result["reply"].new_tokens
    assert appended >= 1200
    assert arrivals[-1] > result["ended"]  # the stream outlived the append
    started, ended = result["started"], result["ended"]
    during = [t for t in arrivals if started < t < ended]
    tenths = {int(10 * (t - started) / (ended - started)) for t in during}
    assert tenths == set(range(10)), tenths  # no stretch of the append without stream tokens
    # A worker that ran the append in 128-token chunks would give the stream
    # ~1 token per 128; sharing passes gives one per few prefill tokens.
    assert len(during) >= appended // 32, (len(during), appended)
