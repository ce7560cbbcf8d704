"""Sessions sharing forward passes (worker/forward.py): what a session gets
in a pass with others, at a full window, and while another session's long
history goes in (docs/design.md, "Shared passes")."""

from __future__ import annotations

import threading
import time

import pytest

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


def logit_margin(history: list[int], window: int, sink: int, a: int, b: int) -> float:
    """The model's logit margin between tokens a and b after `history` (in
    this process, with the worker's forward pass): what a failure reports."""
    import mlx.core as mx

    from kvmux.worker.forward import Segment, calibrate, forward
    from kvmux.worker.model import load
    from kvmux.worker.slab import make_slab

    model = load().model
    slab = make_slab([None] * len(model.layers), sink, window, 16)
    floors = calibrate(model, 64)
    for at in range(0, len(history), 128):
        logits = forward(model, [Segment(mx.array(history[at : at + 128]), slab)], floors)[0]
    return abs(logits[0, a].item() - logits[0, b].item())


def decode(session, max_tokens: int) -> list[int]:
    return [t for chunk in session.generate(max_tokens=max_tokens, temperature=0.0) for t in chunk.token_ids]


def test_eight_sessions_past_their_windows_batched_give_what_they_give_alone(stack_factory, hf_tokenizer):
    """8 sessions, each past its window (sinks and windows differ), decode
    220 tokens together and then alone: the same tokens, exactly (a decode
    row's logits do not depend on the rest of its pass)."""
    stack = stack_factory(workers=1, slabs=8)
    shapes = [(4, 96 + 16 * i) if i % 2 else (0, 128 + 8 * i) for i in range(8)]
    # Plain text to continue (no chat turn to end), longer than any window.
    prompts = [hf_tokenizer.encode(" ".join(f"{p} Part {k}." for k in range(12))) for p in PROMPTS]
    tokens = 220
    with Client(stack.frontend, timeout=300) as client:
        sessions = [client.open_session(sink=s, window=w) for s, w in shapes]
        for session, ids in zip(sessions, prompts, strict=True):
            session.append(token_ids=ids)
        histories = [s.info(token_ids=True).token_ids for s in sessions]
        together: dict[int, list[int]] = {}
        threads = [
            threading.Thread(target=lambda i=i: together.__setitem__(i, decode(sessions[i], tokens))) for i in range(8)
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
        a, b = alone[i], together[i]
        if a != b:
            at = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            margin = logit_margin(histories[i] + a[:at], window, sink, a[at], b[at]) if at < min(len(a), len(b)) else 0
            pytest.fail(f"session {i} parted from its run alone at token {at}, on a logit margin of {margin:.4f}")


def test_a_session_keeps_streaming_while_another_appends_a_long_history(shared_stack, hf_tokenizer):
    """A 2,000-token append shares passes with a running stream: the stream
    gets tokens all through the append, one per pass, and the passes carry a
    few prefill tokens each (worker/pace.py keeps such a pass within ~2x a
    decode-only one), not a 128-token chunk; it keeps going after."""
    counting = hf_tokenizer.encode(", ".join(str(i) for i in range(1, 40)) + ",")  # the model counts on, no EOS
    long_text = " ".join(f"Item {i} is a small grey stone from the river bank." for i in range(170))
    arrivals: list[float] = []
    result = {}
    with (
        Client(shared_stack.frontend, timeout=300) as client,
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
    assert appended >= 2000
    assert arrivals[-1] > result["ended"]  # the stream outlived the append
    started, ended = result["started"], result["ended"]
    during = [t for t in arrivals if started < t < ended]
    tenths = {int(10 * (t - started) / (ended - started)) for t in during}
    assert tenths == set(range(10)), tenths  # no stretch of the append without stream tokens
    # A worker that ran the append in 128-token chunks would give the stream
    # ~1 token per 128; sharing passes gives one per few prefill tokens.
    assert len(during) >= appended // 32, (len(during), appended)
