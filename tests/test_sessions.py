"""Session semantics of the worker, through the real broker and client:
session-bound prefill, the history as fed, chunking, bounded memory,
sampling, stop strings, streaming text, concurrency."""

from __future__ import annotations

import threading
import time

import pytest
from chat_formats import FORMATS, Chat

from kvmux.client import Client, InvalidArgument
from kvmux.worker.speculative import MAX_DRAFT

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def client(shared_stack):
    with Client(shared_stack.frontend, timeout=120) as c:
        yield c


def run(stream):
    chunks = list(stream)
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], stream.result


def test_each_turn_prefills_only_its_new_message(client, hf_tokenizer):
    """10 turns: each turn prefills exactly the template's pieces its slab
    does not hold yet (the previous reply's closing, left pending so that a
    reply never waits for it, its message and the generation prompt), and
    the history is those pieces, tokenized as they were appended, and the
    replies' ids as generated (docs/design.md, "A session")."""
    with client.open_session() as session:
        chat = Chat(session, FORMATS["smollm2"], hf_tokenizer, SMOLLM_SYSTEM)  # the template's own system prompt
        for turn in range(10):
            user = "Answer yes or no: is water wet?" if turn == 0 else f"Turn {turn}: name one colour."
            chat.turn(user, max_tokens=16 if turn == 0 else 6)
            info = session.info()
            assert info.cached_tokens == len(chat.ids)  # the closing tokens wait for the next turn
        assert session.info(token_ids=True).token_ids == chat.history
        assert hf_tokenizer.decode(chat.history) == chat.history_text
    assert len(chat.ids) > 10 * 10  # the history grew well past any one turn's prefill


def test_a_reply_stays_the_ids_generated_where_its_text_tokenizes_otherwise(client, hf_tokenizer):
    """A reply that ends in two "\\n" tokens: its text re-tokenizes as one
    "\\n\\n", but the history keeps the ids the model generated, and the next
    turn's pieces go in after them as the template puts them; so the history
    is not the tokens of a one-shot rendering (docs/design.md, "A session")."""
    system, question, thanks = "Be brief.", "Write Python code that prints hello.", "Thanks. And in C?"
    with client.open_session(system=system) as probe:
        ids = [t for chunk in probe.chat(question, max_tokens=24) for t in chunk.token_ids]
    newline = hf_tokenizer.encode("\n", add_special_tokens=False)
    ends = [i + 2 for i in range(len(ids) - 1) if ids[i : i + 2] == newline * 2]
    assert ends, f"the greedy reply holds no two newline tokens: {hf_tokenizer.decode(ids)!r}"
    generated = ids[: ends[0]]  # greedy: the same reply, cut right after its two newlines
    assert hf_tokenizer.encode(hf_tokenizer.decode(generated), add_special_tokens=False) != generated
    with client.open_session(system=system) as session:
        fmt = FORMATS["smollm2"]
        chat = Chat(session, fmt, hf_tokenizer, system)
        reply = chat.turn(question, max_tokens=len(generated))
        second = chat.turn(thanks, max_tokens=6)
        history = session.info(token_ids=True).token_ids
    assert history == chat.history  # checks every turn's pieces, after the reply's ids too
    at = len(chat.encode(fmt.turn(0, system, question) + fmt.prompt))
    assert history[at : at + len(generated)] == generated
    conversation = [
        ("system", system),
        ("user", question),
        ("assistant", reply),
        ("user", thanks),
        ("assistant", second),
    ]
    one_shot = hf_tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in conversation], tokenize=False)
    assert hf_tokenizer.decode(history) == one_shot
    assert history != hf_tokenizer.encode(one_shot, add_special_tokens=False)


def test_same_history_in_one_call_or_token_by_token(client, hf_tokenizer):
    """Within the window, how the history was chunked does not change the
    greedy continuation."""
    ids = hf_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4, add_special_tokens=False)
    with client.open_session(window=256) as whole, client.open_session(window=256) as by_token:
        whole.append(token_ids=ids)
        for t in ids:
            by_token.append(token_ids=[t])
        assert whole.info().history_tokens == by_token.info().history_tokens == len(ids)
        assert run(whole.generate(max_tokens=12))[1] == run(by_token.generate(max_tokens=12))[1]


def test_beyond_the_window_chunking_changes_nothing_and_memory_is_bounded(client, hf_tokenizer):
    """Past the window every token sees the sink and the last `window`
    tokens up to itself, whether it came in a chunk or alone
    (docs/design.md): two big appends and token-by-token appends give the
    same greedy tokens, and the cache holds exactly sink + window."""
    ids = hf_tokenizer.encode("One two three four five six seven eight nine ten. " * 5, add_special_tokens=False)
    outputs = []
    with client.open_session(sink=4, window=16) as chunked, client.open_session(sink=4, window=16) as by_token:
        chunked.append(token_ids=ids[:30])
        chunked.append(token_ids=ids[30:])
        for t in ids:
            by_token.append(token_ids=[t])
        for session in (chunked, by_token):
            outputs.append(run(session.generate(max_tokens=8))[1])
            info = session.info()
            assert info.truncated_tokens == len(ids) + 8 - 20
            assert info.cached_tokens == 20
            assert info.kv_live_bytes == info.slab_bytes
    assert outputs[0] == outputs[1]


def _capacity_from_gguf(model_path, sink: int, window: int, dtype_size: int) -> int:
    from gguf import GGUFReader

    fields = GGUFReader(str(model_path)).fields

    def value(key):
        return int(fields[key].parts[-1][0])

    head_dim = value("llama.embedding_length") // value("llama.attention.head_count")
    per_token = 2 * value("llama.block_count") * value("llama.attention.head_count_kv") * head_dim * dtype_size
    return (sink + window + MAX_DRAFT) * per_token  # the ring keeps spare slots for speculative drafts


def test_kv_memory_grows_then_stays_flat_at_the_slab_capacity(client, model_path):
    sink, window = 4, 96
    # K and V in float16 where kvmux_native runs the model, else float32 (the weights' floats)
    native = client.stats().workers[0].compute.kernel.startswith("kvmux_native")
    capacity = _capacity_from_gguf(model_path, sink, window, 2 if native else 4)
    series, dropped = [], []
    with client.open_session(sink=sink, window=window) as session:
        session.append([{"role": "user", "content": "Hello there."}])
        series.append(session.info().kv_live_bytes)
        for turn in range(7):
            run(session.chat(f"Tell me fact number {turn} about the moon.", max_tokens=8))
            info = session.info()
            series.append(info.kv_live_bytes)
            dropped.append(info.truncated_tokens)
        assert info.slab_bytes == capacity
    assert 0 < series[0] < capacity
    assert series == sorted(series)  # never shrinks while the session lives
    full = series.index(capacity)
    assert full < len(series) - 2 and set(series[full:]) == {capacity}
    assert dropped == sorted(dropped) and dropped[-1] > 0  # the window keeps dropping, memory does not grow


def test_seeded_sampling_repeats_however_sessions_interleave(client):
    def sample(seed, results, key):
        with client.open_session() as session:
            results[key] = run(
                session.chat(
                    "Invent a name for a cat.", max_tokens=12, temperature=1.5, top_p=0.95, top_k=50, seed=seed
                )
            )[1]

    results: dict = {}
    sample(7, results, "alone")
    threads = [
        threading.Thread(target=sample, args=(seed, results, key)) for seed, key in ((7, "a"), (7, "b"), (8, "other"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["alone"] == results["a"] == results["b"]
    assert results["other"] != results["a"]


def test_three_concurrent_sessions_progress_together(client):
    arrivals: dict[int, list[float]] = {}
    results = {}
    # All three sessions are open before any asks, so the three requests
    # reach the worker together and not a session-open apart.
    ready = threading.Barrier(3)

    def chat(i):
        with client.open_session() as session:
            ready.wait(timeout=60)
            # One token a pass: counting is what lookup drafts guess best, and a
            # stream that took its 24 tokens in a few verify passes could end
            # before a session a busy host started late had its first.
            stream = session.chat(f"Count from {i} upwards.", max_tokens=24, speculative="off")
            arrivals[i] = []
            for _chunk in stream:
                arrivals[i].append(time.monotonic())
            results[i] = stream.result

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2]
    assert all(r.stop_reason in ("max_tokens", "eos") and r.completion_tokens for r in results.values())
    # Interleaved per token: every stream's first token came before every
    # other stream's last one.
    assert max(a[0] for a in arrivals.values()) < min(a[-1] for a in arrivals.values())


def test_sessions_decoding_together_give_the_tokens_they_give_alone(client):
    """Concurrent decode steps run as one batched forward pass; each session
    still gets exactly its greedy tokens (different windows and lengths)."""
    prompts = ["Why is the sky blue?", "Name three fruits.", "What is 12 times 12?", "Describe a cat in one line."]

    def reply(i):
        with client.open_session(window=64 + 32 * i) as session:
            return run(session.chat(prompts[i], max_tokens=12))[1]

    alone = [reply(i) for i in range(len(prompts))]
    together: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, reply(i))) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[i] for i in range(len(prompts))] == alone


def test_stop_string_ends_the_reply_and_is_not_sent(client):
    with client.open_session() as session:
        text, _ids, result = run(session.chat("What is the capital of France?", max_tokens=24, stop=["Paris"]))
    assert result.stop_reason == "stop"
    assert "Paris" not in text and text.startswith("The capital of France")


def test_streamed_text_never_splits_a_character(client, hf_tokenizer):
    with client.open_session() as session:
        session.append(token_ids=hf_tokenizer.encode("Émojis: 🙂🙃 日本語 ", add_special_tokens=False) * 3)
        chunks = list(session.generate(max_tokens=16))
    ids = [t for c in chunks for t in c.token_ids if t != hf_tokenizer.eos_token_id]
    assert any(c.text == "" for c in chunks)  # a character spanned tokens and was held back
    # Only a cut at max_tokens may flush a partial character (as U+FFFD, as a
    # one-shot decode of the same ids does); no chunk before it splits one.
    assert all("\ufffd" not in c.text for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == hf_tokenizer.decode(ids)


@pytest.mark.parametrize(
    "options",
    [{"temperature": -1}, {"top_p": 0.0}, {"top_k": -2}, {"max_tokens": 0}, {"stop": [""]}],
)
def test_bad_sampling_options_are_invalid_arguments(client, options):
    with client.open_session() as session:
        with pytest.raises(InvalidArgument):
            run(session.chat("hi", **options))
        assert run(session.chat("hi", max_tokens=2))[2].completion_tokens == 2  # still usable
