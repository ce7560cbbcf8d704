"""The verify pass's exactness, in this process on the real model and the
worker's own forward pass: each position's logits from a verify pass equal
a one-token step's bit for bit (after the window wraps, after drafts are
taken back, beside other sessions), and speculative sampling draws from
plain sampling's distribution."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvmux.worker.lookup import Lookup
from kvmux.worker.speculative import DraftLength, Proposal, accept_sampled, distributions


@pytest.fixture(scope="module")
def model():
    from kvmux.worker.forward import calibrate
    from kvmux.worker.model import load

    model = load().model
    return model, calibrate(model, 64)


def run(model, floors, slab, tokens: list[int], rows: bool) -> mx.array:
    from kvmux.worker.forward import Segment, forward

    logits = forward(model, [Segment(mx.array(tokens), slab, rows)], floors)[0]
    mx.eval(logits)
    return logits


@pytest.mark.parametrize(("sink", "window", "draft"), [(4, 2048, 5), (4, 32, 9), (0, 40, 16), (4, 24, 3)])
def test_verify_rows_equal_one_token_steps_bit_for_bit(model, sink, window, draft):
    from kvmux.worker.forward import Segment, forward
    from kvmux.worker.slab import make_slab, rewind

    model, floors = model
    layers = len(model.layers)
    rng = np.random.default_rng(window)
    prompt = rng.integers(100, 5000, 60).tolist()
    following = rng.integers(100, 5000, 48).tolist()
    stepped, verified, other = (make_slab([None] * layers, sink, window, 16) for _ in range(3))
    for slab in (stepped, verified):
        run(model, floors, slab, prompt, rows=False)
    run(model, floors, other, prompt[:20], rows=False)
    expected = np.concatenate([np.array(run(model, floors, stepped, [t], rows=True)) for t in following])
    at = 0
    while at < len(following):
        tokens = following[at : at + draft]
        # Beside another session's prefill chunk, then with rejected drafts
        # written and taken back before the next pass.
        segments = [Segment(mx.array(tokens), verified, True), Segment(mx.array(prompt[:7]), other)]
        got = np.array(forward(model, segments, floors)[0])
        for i in range(len(tokens)):
            assert np.array_equal(got[i], expected[at + i]), f"position {at + i} differs"
        rejected = rng.integers(100, 5000, min(draft, 16)).tolist()
        run(model, floors, verified, rejected, rows=True)
        rewind(verified, len(rejected))
        at += len(tokens)
    assert stepped[0].dropped == verified[0].dropped and stepped[0].offset == verified[0].offset
    assert window > 100 or stepped[0].dropped > 0


# chi-square critical value at 9 degrees of freedom and significance 0.001
CHI2_9_0001 = 27.877


def chi_square(draws: np.ndarray, expected: np.ndarray) -> float:
    """Over the nine likeliest tokens and the rest lumped together."""
    top = np.argsort(expected)[::-1][:9]
    observed = np.array([*(np.sum(draws == t) for t in top), np.sum(~np.isin(draws, top))], dtype=np.float64)
    probs = np.array([*expected[top], 1 - expected[top].sum()])
    want = probs * len(draws)
    return float(((observed - want) ** 2 / want).sum())


def test_speculative_sampling_draws_from_plain_samplings_distribution(model):
    """At a fixed context, the token after a verified draft, over 6000
    seeds, fits the distribution plain sampling draws from: with a lookup
    draft (a point mass) and with drafts drawn from another distribution."""
    from kvmux.worker.model import load
    from kvmux.worker.slab import make_slab

    model, floors = model
    tokenizer = load().tokenizer
    context = tokenizer.encode("My favourite animal in the whole world is the", add_special_tokens=False)
    slab = make_slab([None] * len(model.layers), 4, 256, 16)
    run(model, floors, slab, context[:-1], rows=False)
    logits = run(model, floors, slab, [*context[-1:], 0], rows=True)  # the last token, and a draft slot
    p = distributions(logits, 1.0, 1.0, 0)
    q = distributions(logits[:1], 1.6, 1.0, 0)[0]  # a flatter draft distribution
    point = int(np.argsort(p[0])[-2])  # the second likeliest token as the lookup's draft
    trials = 6000
    for name in ("lookup", "draft"):
        draws = np.empty(trials, dtype=np.int64)
        for seed in range(trials):
            rng = np.random.default_rng([seed, 0])
            drawn = Proposal([int(rng.choice(len(q), p=q))], q[None]) if name == "draft" else None
            proposal = drawn or Proposal([point])
            kept, following = accept_sampled(p, proposal, rng)
            draws[seed] = proposal.tokens[0] if kept else following
        statistic = chi_square(draws, p[0])
        assert statistic < CHI2_9_0001, f"{name}: chi-square {statistic:.1f} over 9 degrees of freedom"
    # The test can fail: the same draws against the draft's own distribution do not fit.
    assert chi_square(draws, q) > CHI2_9_0001


def test_lookup_drafts_what_followed_the_longest_match():
    lookup = Lookup()
    lookup.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    assert lookup.propose([0, 1, 2, 3], 3) == [4, 5, 9]  # matches "1 2 3", not just "2 3"
    assert lookup.propose([6, 2, 3], 2) == [7, 8]  # the latest "2 3"
    assert lookup.propose([4, 6], 3) == []  # never seen
    bounded = Lookup(bound=8)
    bounded.extend(list(range(20)))
    assert len(bounded.tokens) <= 8 and bounded.propose([16, 17], 2) == [18, 19]


def test_a_session_whose_drafts_keep_failing_rests():
    drafting = DraftLength()
    assert drafting.allowed() == 4
    drafting.update(4, 4)
    assert drafting.allowed() == 8
    drafting.update(8, 0)
    drafting.update(4, 0)
    assert [drafting.allowed() for _ in range(5)] == [0, 0, 0, 0, 2]  # a rest of four steps, then shorter drafts
    drafting.update(2, 1)
    assert drafting.allowed() == 2
