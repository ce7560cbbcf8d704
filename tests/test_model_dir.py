"""A local mlx-lm model directory loads and serves like the GGUF it was made
from: the embedded model is written out with mlx-lm's own save functions,
quantized as the GGUF stores it (what an mlx-lm 4-bit directory is), a
worker serves it with the CPU kernel, and greedy tokens equal the GGUF
path's."""

from __future__ import annotations

import dataclasses

import pytest

from kvmux.client import Client

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mlx_lm.utils import save_config, save_model

    from kvmux.worker.model import load

    # MLX's own quantized layers (its affine triplets, as mx.load reads the
    # file): the kernel's layers may hold modes MLX has not (a Q8_0
    # embedding without its biases: symmetric), which mlx-lm cannot load.
    loaded = load(kernel="off", keep_quantized=True)
    assert loaded.quantized
    path = tmp_path_factory.mktemp("models") / "smollm2-mlx"
    save_model(path, loaded.model)
    # mlx-lm reads each layer's width (Q4_1: 4 bits, the Q8_0 embedding: 8) off its saved scales
    config = dataclasses.asdict(loaded.model.args) | {"quantization": {"group_size": 32, "bits": 4}}
    save_config(config, path / "config.json")
    loaded.tokenizer.save_pretrained(str(path))
    return path


def greedy(frontend: str, ids: list[int]) -> tuple[str, list[int]]:
    with Client(frontend, timeout=120) as client, client.open_session() as session:
        session.append(token_ids=ids)
        tokens = [t for chunk in session.generate(max_tokens=16) for t in chunk.token_ids]
        return session.opened.model, tokens


def test_mlx_lm_directory_serves_the_same_tokens(model_dir, stack_factory, shared_stack, hf_tokenizer):
    ids = hf_tokenizer.encode(
        "<|im_start|>user\nName the planets of the solar system.<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    stack = stack_factory(workers=1, slabs=1, worker_args=["--model", str(model_dir)])
    assert stack.stats().workers[0].compute.kernel == shared_stack.stats().workers[0].compute.kernel
    model, from_dir = greedy(stack.frontend, ids)
    assert model == "smollm2-mlx"
    assert from_dir == greedy(shared_stack.frontend, ids)[1]
