"""The MLX GGUF path (dequantized, traditional rope, tied embeddings) gives
the same greedy tokens as transformers' own GGUF loading of the same file."""

from __future__ import annotations

import pytest

from kvmux.client import Client

torch = pytest.importorskip("torch", reason="transformers' GGUF loading needs torch (make test installs it)")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(model_path, hf_tokenizer, transformers_model):
    return hf_tokenizer, transformers_model(model_path)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_transformers(prompt, reference, shared_stack):
    tokenizer, model = reference
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )
    expected = out[0, len(ids) :].tolist()

    with Client(shared_stack.frontend, timeout=120) as client, client.open_session() as session:
        session.append(token_ids=ids)
        got = [t for chunk in session.generate(max_tokens=NEW_TOKENS) for t in chunk.token_ids]
    assert got == expected, (tokenizer.decode(got), tokenizer.decode(expected))
