"""Speculative decoding (worker/speculative.py, docs/design.md "Speculative
decoding"): drafts from the session's history or a draft model, verified in
one pass, greedy output token for token what `speculative=off` gives (on a
worker whose passes are not exact, parting only at a near tie), on either
BLAS kernel family."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import KERNELS, broker_stats, kvmux_command, stacks_at_once

from kvmux import protocol as p
from kvmux.client import Client, errors

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)

PASSAGE = (
    "The lighthouse stood on a rock at the edge of the bay. Every night the keeper climbed its one hundred "
    "and twelve steps, trimmed the wick, polished the lens and wound the clockwork that turned the light. "
    "Ships passing in the dark counted its flashes, three short and one long, and knew where they were."
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
FRUIT = ["apple", "pear", "plum", "cherry", "grape", "lemon", "melon", "peach"]
LIST = "\n".join(f"{i}. {word}" for i, word in enumerate(FRUIT, 1))

# (prompt, max_tokens): edits and quotes that repeat their input (drafts
# stand), and open-ended ones (drafts mostly fail, or none are made).
PROMPTS = [
    (f"Rewrite this passage, changing 'keeper' to 'guardian', and keep everything else the same:\n\n{PASSAGE}", 320),
    (f"Repeat this passage exactly:\n\n{PASSAGE}", 320),
    (f"Rename the function to compute_total and keep the rest of the code the same:\n\n{CODE}", 200),
    (f"Add a docstring to this function and repeat the rest unchanged:\n\n{CODE}", 200),
    (f"Repeat this list, then add one more fruit:\n\n{LIST}", 120),
    (f"Copy this list in reverse order:\n\n{LIST}", 120),
    (f"Quote the second sentence of this passage:\n\n{PASSAGE}", 80),
    (f"Rewrite the passage in the past perfect tense:\n\n{PASSAGE}", 160),
    (f"Translate the variable names of this code to French and keep the structure:\n\n{CODE}", 160),
    (f"Summarise this passage in one sentence:\n\n{PASSAGE}", 80),
    ("Write a long story about a lighthouse keeper and a storm.", 200),
    ("Explain how bread rises, step by step, in detail.", 160),
    ("List the planets and say one thing about each.", 160),
    ("Tell a story about a robot learning to paint.", 120),
    ("What is the capital of France?", 40),
    ("Write a haiku about the sea.", 40),
    ("Count from one to twenty in words, separated by commas.", 120),
    ("Describe a walk through a busy market in the morning.", 120),
    ("Give three tips for learning a new language.", 120),
    ("Why is the sky blue?", 80),
]


def reply(session, text: str, **options) -> tuple[list[int], p.GenerateResult]:
    stream = session.chat(text, temperature=0.0, **options)
    tokens = [t for chunk in stream for t in chunk.token_ids]
    return tokens, stream.result


def context(session, tokens: list[int]) -> list[int]:
    """The session's history before the reply `tokens` (what they continue)."""
    history = session.info(token_ids=True).token_ids
    end = next(e for e in range(len(history), len(tokens) - 1, -1) if history[e - len(tokens) : e] == tokens)
    return history[: end - len(tokens)]


def run_all(client: Client, prompts, window: int | None = None, **options):
    """Every prompt in its own session, all at once (they share passes):
    per prompt, the reply's tokens, its result and the history it continues.
    The prompts are prefilled first, every session's before any decodes,
    and with no shared prefix: a prefill's chunks are then the same in
    every run (a chunk's bits depend on where it starts, and chunks shrink
    while other sessions decode, worker/pace.py), so two runs' replies
    differ only by how they decode."""
    out: dict[int, tuple[list[int], p.GenerateResult, list[int]]] = {}
    prefilled = threading.Barrier(len(prompts))

    def one(i: int, text: str, max_tokens: int) -> None:
        with client.open_session(prefix="off", **({"window": window} if window else {})) as session:
            session.append([p.ChatMessage(role="user", content=text)])
            prefilled.wait(timeout=600)
            stream = session.generate(temperature=0.0, max_tokens=max_tokens, **options)
            tokens = [t for chunk in stream for t in chunk.token_ids]
            out[i] = tokens, stream.result, context(session, tokens)

    threads = [threading.Thread(target=one, args=(i, *prompt)) for i, prompt in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [out[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def stacks():
    """A worker on each kernel family, both started at once."""
    with stacks_at_once(**{kernels: {"slabs": 10, "env": env} for kernels, env in KERNELS.items()}) as stacks:
        yield stacks


@pytest.fixture(scope="module")
def spec_stack(stacks):
    return stacks["native"]


@pytest.mark.parametrize("kernels", KERNELS)
def test_greedy_speculative_equals_off_in_mixed_batches(stacks, near_tie, kernels):
    """The ten edits and six open prompts, short and long, ten sessions at
    a time sharing passes (speculating and plain ones together): `auto`
    gives the tokens `off` gives (or parts at a near tie), and drafts were
    made and taken on the edits. On the forced AVX2 kernels the ten edits
    and two of the open prompts: the same passes, slower there."""
    stack = stacks[kernels]
    exact = stack.exact()
    long = PROMPTS[10:16] if kernels == "native" else PROMPTS[10:12]
    with Client(stack.frontend, timeout=600) as client:
        plain = run_all(client, PROMPTS[:10], speculative="off") + run_all(client, long, speculative="off")
        spec = run_all(client, PROMPTS[:10]) + run_all(client, long)
    for (a, ra, prompt), (b, rb, _) in zip(plain, spec, strict=True):
        assert ra.drafted_tokens == 0
        if near_tie(prompt, a, b, exact) is None:
            assert ra.stop_reason == rb.stop_reason and ra.completion_tokens == rb.completion_tokens == len(b)
    edits = spec[:10]
    assert sum(r.accepted_tokens for _, r, _ in edits) > sum(len(t) for t, _, _ in edits) // 3  # edits drafted a lot
    assert any(r.accepted_tokens < r.drafted_tokens for _, r, _ in spec)  # and some drafts failed
    assert sum(len(t) for t, _, _ in spec) > 150 * len(long)  # hundreds of tokens per long generation
    drafted = sum(r.drafted_tokens for _, r, _ in spec)
    deadline = time.monotonic() + 10  # the counts come with the worker's next heartbeat
    while (worker := broker_stats(stack.admin).workers[0]).drafted < drafted and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker.drafted >= drafted
    assert 0 < worker.accepted <= worker.drafted


@pytest.mark.parametrize("kernels", KERNELS)
def test_speculation_past_the_window_wrap_equals_off(stacks, near_tie, kernels):
    """Sessions whose 64-token window wraps many times while they draft and
    take back rejected drafts decode what they decode plainly."""
    stack = stacks[kernels]
    exact = stack.exact()
    length = 1 if kernels == "native" else 0.5  # the window wraps 2-4 times on the forced AVX2 kernels, 4-6 here
    prompts = [(text, int(300 * length)) for text, _ in PROMPTS[:4]] + [
        (text, int(200 * length)) for text, _ in PROMPTS[10:12]
    ]
    with Client(stack.frontend, timeout=600) as client:
        plain = run_all(client, prompts, window=64, speculative="off")
        spec = run_all(client, prompts, window=64, speculative="lookup")
    for (a, _, prompt), (b, rb, _) in zip(plain, spec, strict=True):
        near_tie(prompt, a, b, exact, window=64)
        assert rb.truncated_tokens > 0  # the window dropped tokens: the ring wrapped
    assert sum(r.accepted_tokens for _, r, _ in spec) > 0


def test_exact_edges_stop_string_and_max_tokens_inside_accepted_runs(spec_stack, near_tie):
    """A stop string inside an accepted run ends the reply there, and
    max_tokens is never passed, exactly as without speculation."""
    text = f"Repeat this passage exactly:\n\n{PASSAGE}"
    exact = spec_stack.exact()
    with Client(spec_stack.frontend, timeout=300) as client:
        for options in ({"stop": ["clockwork"], "max_tokens": 200}, {"max_tokens": 37}, {"max_tokens": 1}):
            results = []
            for mode in ("off", "lookup"):
                with client.open_session() as session:
                    tokens, result = reply(session, text, speculative=mode, **options)
                    prompt = context(session, tokens)
                    follow, _ = reply(session, "Now say it again.", speculative="off", max_tokens=20)
                    results.append((tokens, result, follow, prompt))
            (a, ra, fa, prompt), (b, rb, fb, _) = results
            if near_tie(prompt, a, b, exact) is None:
                assert ra.stop_reason == rb.stop_reason
                assert fa == fb  # the slab held exactly the tokens sent
        assert rb.completion_tokens == 1


def test_cancel_mid_speculation_then_the_next_turn_equals_a_control_session(spec_stack, near_tie):
    text = f"Repeat this passage exactly:\n\n{PASSAGE}"
    exact = spec_stack.exact()
    with (
        Client(spec_stack.frontend, timeout=300) as client,
        client.open_session() as cancelled,
        client.open_session() as control,
    ):
        stream = cancelled.chat(text, temperature=0.0, max_tokens=300, speculative="lookup")
        sent: list[int] = []
        for chunk in stream:
            sent.extend(chunk.token_ids)
            if len(sent) >= 25 and len(sent) - len(chunk.token_ids) < 25:
                cancelled.cancel()
        assert stream.result.stop_reason == p.StopReason.CANCELLED
        assert stream.result.drafted_tokens > 0
        same, _ = reply(control, text, max_tokens=len(sent), speculative="off")
        if near_tie(context(control, same), same, sent, exact) is None:
            a, _ = reply(cancelled, "Thank you. Now write one line about ships.", max_tokens=40)
            b, _ = reply(control, "Thank you. Now write one line about ships.", max_tokens=40)
            near_tie(context(control, b), b, a, exact)


def test_seeded_sampling_with_speculation_repeats(spec_stack):
    text = f"Repeat this passage exactly:\n\n{PASSAGE}"
    with Client(spec_stack.frontend, timeout=300) as client:
        runs = []
        for _ in range(2):
            with client.open_session() as session:
                stream = session.chat(text, temperature=0.7, seed=1234, max_tokens=80)
                runs.append(([t for c in stream for t in c.token_ids], stream.result))
        (a, ra), (b, rb) = runs
        assert a == b and ra.drafted_tokens == rb.drafted_tokens > 0


def test_bad_speculative_options_are_typed_errors(spec_stack):
    with Client(spec_stack.frontend, timeout=60) as client, client.open_session() as session:
        with pytest.raises(errors.InvalidArgument, match="speculative must be one of"):
            reply(session, "Hello", speculative="always")
        with pytest.raises(errors.InvalidArgument, match="no draft model"):
            reply(session, "Hello", speculative="draft")
        tokens, result = reply(session, "Hello", max_tokens=5)  # the session is fine
        assert result.completion_tokens == len(tokens) > 0


def test_draft_models_give_off_s_tokens_and_a_different_one_gets_rejections(
    model_path, hf_tokenizer, tmp_path, near_tie
):
    """The embedded model as its own draft (its drafts stand), and a tiny
    random model with the same tokenizer (a draft that differs: its drafts
    are rejected, and the session soon rests from drafting); both give
    `off`'s tokens."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    hf_tokenizer.save_pretrained(tiny)
    _write_tiny_llama(tiny, len(hf_tokenizer))
    prompts = [(PROMPTS[i][0], 48) for i in (0, 2, 10, 12)]
    results, exact = {}, True
    drafts = {
        name: {"slabs": 4, "worker_args": ["--draft-model", str(draft)]}
        for name, draft in (("self", model_path), ("tiny", tiny))
    }
    with stacks_at_once(**drafts) as stacks:
        for name, stack in stacks.items():
            exact &= stack.exact()
            with Client(stack.frontend, timeout=600) as client:
                if name == "self":
                    results["off"] = run_all(client, prompts, speculative="off")
                results[name] = run_all(client, prompts, speculative="draft")
    for name in ("self", "tiny"):
        for (a, _, prompt), (b, rb, _) in zip(results["off"], results[name], strict=True):
            near_tie(prompt, a, b, exact)
            assert rb.drafted_tokens > 0
    self_drafted = sum(r.drafted_tokens for _, r, _ in results["self"])
    self_accepted = sum(r.accepted_tokens for _, r, _ in results["self"])
    assert self_accepted >= 0.9 * self_drafted  # the same weights propose what they verify
    tiny_results = [r for _, r, _ in results["tiny"]]
    rejected = sum(r.drafted_tokens - r.accepted_tokens for r in tiny_results)
    assert rejected > 0  # a different draft gets rejected
    assert all(r.drafted_tokens < r.completion_tokens for r in tiny_results)  # and the sessions rest from it


def test_a_draft_model_with_another_tokenizer_is_refused_at_start(tmp_path):
    """`kvmux worker --draft-model` with a tokenizer that differs exits 2
    (a configuration to fix) and says why."""
    import subprocess

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    other = tmp_path / "other"
    other.mkdir()
    words = ["<unk>", "<s>", "</s>", "hello", "world"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(other)
    _write_tiny_llama(other, len(words))
    done = subprocess.run(
        kvmux_command("worker", "--connect", f"ipc://{tmp_path}/none.ipc", "--draft-model", str(other)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tokenizer differs" in done.stderr + done.stdout


def _write_tiny_llama(where, vocab: int) -> None:
    """A tiny random llama in mlx-lm's directory layout (next to its
    tokenizer's files)."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {
        "model_type": "llama",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
    }
    (where / "config.json").write_text(json.dumps(config))
    model = llama.Model(llama.ModelArgs(**config))
    mx.save_safetensors(str(where / "model.safetensors"), dict(tree_flatten(model.parameters())))
