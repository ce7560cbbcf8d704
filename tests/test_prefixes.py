"""Shared prefixes (worker/prefixes.py, kvmux/sessions/prefixes.py): a new
session whose opening starts as an earlier one's takes that KV instead of
prefilling it, on the same worker, after a restart and on another worker
reading the same Redis store; it answers as a cold session does; pinned,
corrupt and evicted prefixes; and conversations that open alike through
the gateway each keep a session of their own."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from conftest import KEY, Daemon, api, http_gateway, kvmux_command, stacks_at_once

from kvmux.bench import redis_server as bench_redis
from kvmux.client import Client
from kvmux.sessions import LocalStore

SYSTEM = "You are the support agent of Acme Widgets. " + " ".join(
    f"Rule {i}: answer politely about widget W{i}, whose warranty lasts {i % 7 + 1} years." for i in range(14)
)
OTHER_SYSTEM = "You are a travel guide for the Alps. " + " ".join(
    f"Fact {i}: the pass number {i} opens in month {i % 12 + 1} and closes in month {(i + 5) % 12 + 1}."
    for i in range(14)
)
TOOLS = [
    {
        "name": f"lookup_{i}",
        "description": f"Look up the record {i} of a widget",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
    }
    for i in range(5)
]
SMALL = ["--prefix-min-tokens", "256"]  # the openings here are ~500 tokens


@pytest.fixture(scope="module")
def stacks():
    """Two stack tests' stacks of their own, started at once."""
    gateway = {"slabs": 6, "worker_args": ["--batch-invariant", *SMALL]}
    with stacks_at_once(gateway=gateway, pair={"workers": 2, "slabs": 3, "worker_args": SMALL}) as stacks:
        yield stacks


def ask(client: Client, question: str, prefix: str = "auto", system: str = SYSTEM, tools=TOOLS, max_tokens: int = 12):
    """(token ids, result, the prompt's token ids) of a new session's first reply."""
    session = client.open_session(system, tools=tools, prefix=prefix)
    stream = session.chat(question, max_tokens=max_tokens)
    tokens = [t for chunk in stream for t in chunk.token_ids]
    info = session.info(token_ids=True)
    session.close()
    context = info.token_ids[: len(info.token_ids) - info.pending_tokens - len(tokens)]
    return tokens, stream.result, context


def test_an_opening_seen_again_is_restored_and_answers_as_a_cold_session(shared_stack, near_tie):
    """Default mode: the second session with an opening takes what the first
    computed (from the worker's memory), prefills only the rest, and its
    tokens are a cold session's, or part from them at a near tie."""
    with Client(shared_stack.frontend) as client:
        _, result, _ = ask(client, "Hello!", system=OTHER_SYSTEM)
        assert result.cached_tokens == 0
        for question in ("What is pass 3?", "When does pass 7 close?"):
            cold, cold_result, context = ask(client, question, prefix="off", system=OTHER_SYSTEM)
            hit, hit_result, _ = ask(client, question, system=OTHER_SYSTEM)
            assert cold_result.cached_tokens == 0
            assert hit_result.cached_tokens >= 256 and hit_result.cached_tokens % 16 == 0
            assert hit_result.prompt_tokens + hit_result.cached_tokens == cold_result.prompt_tokens
            near_tie(context, cold, hit, exact=False)
        deadline = time.monotonic() + 10  # the worker's counts come with its heartbeats
        while (prefixes := client.stats().workers[0].prefixes).hits < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert prefixes.hits >= 2 and prefixes.bytes > 0


@pytest.mark.stack
def test_six_conversations_through_the_gateway_share_their_opening_and_keep_their_own_sessions(stacks, tmp_path):
    """Batch-invariant mode, through the openai package: conversations 2..6
    report the shared opening as cached and answer exactly as a cold session;
    three conversations whose first request is the same each keep a session
    of their own, and their second turns find it."""
    stack = stacks["gateway"]
    questions = [f"What is the warranty of W{i}?" for i in range(6)]
    with http_gateway(stack, tmp_path, ["sk-a"]) as base, Client(stack.frontend) as client:
        openai = api(base, "sk-a")
        tools = [{"type": "function", "function": t} for t in TOOLS]
        cached, texts = [], []
        for question in questions:
            reply = openai.chat.completions.create(
                model="kvmux",
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                tools=tools,
                max_tokens=12,
            )
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            message = reply.choices[0].message
            texts.append(
                (message.content or "", [(c.function.name, c.function.arguments) for c in message.tool_calls or []])
            )
            assert reply.usage.prompt_tokens > cached[-1]
        assert cached[0] == 0
        assert all(c >= 256 and c % 128 == 0 for c in cached[1:]), cached
        for question, text in zip(questions, texts, strict=True):
            session = client.open_session(SYSTEM, tools=TOOLS, prefix="off")
            stream = session.chat(question, max_tokens=12)
            streamed = "".join(chunk.text for chunk in stream)
            result = stream.result
            calls = [(c.name, c.arguments) for c in result.tool_calls]
            assert (streamed.strip() if calls else streamed, calls) == text
            session.close()

        # Three conversations open alike (as an app serving many people does),
        # get their own sampled replies, then go on, interleaved.
        opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
        firsts = [
            openai.chat.completions.with_raw_response.create(
                model="kvmux", messages=opening, max_tokens=16, temperature=1.0, seed=seed
            )
            for seed in range(3)
        ]
        ids = [raw.headers["x-kvmux-session"] for raw in firsts]
        assert len(set(ids)) == 3, ids
        assert len({raw.parse().choices[0].message.content for raw in firsts}) == 3
        for i, raw in enumerate(firsts):
            first = raw.parse()
            follow = [*opening, {"role": "assistant", "content": first.choices[0].message.content}]
            follow.append({"role": "user", "content": f"Tell me about W{i}."})
            second = openai.chat.completions.with_raw_response.create(model="kvmux", messages=follow, max_tokens=8)
            assert second.headers["x-kvmux-session"] == ids[i]
            usage = second.parse().usage
            held = first.usage.prompt_tokens + first.usage.completion_tokens
            assert usage.prompt_tokens_details.cached_tokens >= held - 2  # its own session: all of it held


def pin(frontend: str, system: str) -> str:
    done = subprocess.run(
        kvmux_command("prefix", "pin", "--system", system, "-e", frontend), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def listed(state: str) -> str:
    done = subprocess.run(kvmux_command("prefix", "list", "--state-dir", state), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.stack
def test_pinned_restarted_corrupt_and_evicted_prefixes(tmp_path):
    """A pinned opening hits on its first use and after a daemon restart; a
    corrupt prefix is dropped and the session prefills cold with the same
    tokens; past the store's budget the least recently used unpinned
    prefix goes, never a pinned one."""
    state = str(tmp_path / "state")
    # No copies in memory: every hit reads the store. A budget for two prefixes (~24 MB each).
    args = ["--batch-invariant", "--prefix-memory-bytes", "0", "--prefix-store-bytes", str(60 << 20), *SMALL]
    with Daemon(tmp_path, args=args) as daemon:
        assert "pinned" in pin(daemon.frontend, SYSTEM)
        assert " yes " in listed(state)
        with Client(daemon.frontend) as client:
            hit, result, _ = ask(client, "Hello!", tools=[])
            assert result.cached_tokens >= 256
            cold, _, _ = ask(client, "Hello!", prefix="off", tools=[])
            assert hit == cold
    with Daemon(tmp_path, args=args) as daemon, Client(daemon.frontend) as client:
        again, result, _ = ask(client, "Hello!", tools=[])
        assert result.cached_tokens >= 256 and again == cold
        # Two unpinned openings, each seen twice: the budget keeps the pinned one and the newest.
        for system in (OTHER_SYSTEM, OTHER_SYSTEM, SYSTEM + " Be brief.", SYSTEM + " Be brief."):
            ask(client, "Hi.", system=system, tools=TOOLS)
        stored = LocalStore(state).prefixes(0).entries()
        assert sum(e.bytes for e in stored) <= 60 << 20
        assert min(stored, key=lambda e: e.used).pinned
        assert len(stored) == 2, listed(state)
        # Corrupt the pinned one: dropped, and the session prefills cold.
        (blob,) = [e for e in stored if e.pinned]
        path = tmp_path / "state" / "prefixes" / f"{blob.key}.prefix"
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
        again, result, _ = ask(client, "Hello!", tools=[])
        assert result.cached_tokens == 0 and again == cold
        assert not path.exists()
        assert any(event.get("key") == blob.key for event in daemon.events("prefix_dropped"))
    dropped = subprocess.run(
        kvmux_command("prefix", "drop", "--all", "--state-dir", state), capture_output=True, text=True
    )
    assert dropped.returncode == 0 and "dropped 1 prefixes" in dropped.stdout, dropped
    assert "no shared prefixes stored" in listed(state)


@pytest.fixture
def redis_server(tmp_path):
    with bench_redis.redis_server(tmp_path / "redis") as server:
        yield server


@pytest.mark.stack
def test_another_worker_on_the_redis_store_restores_the_prefix(stack_factory, redis_server):
    """Worker A stores a shared opening in Redis, then stops; worker B,
    which never saw it, restores it for a new session."""
    store = ["--store", redis_server.url]
    exact = ["--batch-invariant", *SMALL]  # a hit's tokens are a cold session's, bit for bit
    stack = stack_factory(workers=1, slabs=2, broker_args=store, worker_args=[*store, *exact])
    with Client(stack.frontend) as client:
        ask(client, "Hello!")
        _, result, _ = ask(client, "Hi there!")
        assert result.cached_tokens >= 256
        cold, _, _ = ask(client, "What can you do?", prefix="off")
    stack.kill_worker(0, signal.SIGTERM)  # drained: the broker forgets it at once
    stack.add_worker(*store, *exact)
    with Client(stack.frontend) as client:
        hit, result, _ = ask(client, "What can you do?")
        assert result.cached_tokens >= 256
        assert hit == cold


def test_prefix_options_are_checked(shared_stack):
    with Client(shared_stack.frontend) as client:
        with pytest.raises(Exception, match="prefix must be one of auto, pin, off"):
            client.open_session("Hi", prefix="always")
        session = client.open_session("Hi")
        with pytest.raises(Exception, match="a fork takes its session's settings: prefix"):
            session.fork(prefix="off")
        session.close()


@pytest.mark.stack
def test_a_session_that_opens_as_an_earlier_one_goes_to_its_worker(stacks):
    """The broker places a new session beside the sessions that opened as it
    does (the worker holds their prefix in memory), even where another
    worker has more free slabs."""
    stack = stacks["pair"]
    with Client(stack.frontend) as client:
        first = client.open_session(SYSTEM, tools=TOOLS)
        list(first.chat("Hello!", max_tokens=4))
        second = client.open_session(SYSTEM, tools=TOOLS)  # its worker has 2 free slabs, the other 3
        assert second.opened.worker_id == first.opened.worker_id
        stream = second.chat("Hi there!", max_tokens=4)
        list(stream)
        assert stream.result.cached_tokens >= 256
        other = client.open_session(OTHER_SYSTEM, tools=TOOLS)
        assert other.opened.worker_id != first.opened.worker_id  # nothing to prefer: the most free slabs


def test_the_gateway_pins_an_opening_by_header_and_refuses_a_bad_one(base):
    """X-Kvmux-Prefix: pin on a conversation's first request stores its
    opening at once: the next conversation takes it, on first use."""
    openai = api(base)
    system = "You answer questions about the tide tables of a small harbour. " + " ".join(
        f"Table {i} lists high water at {i % 12 + 1} o'clock." for i in range(12)
    )

    def first(question: str, **headers):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return openai.chat.completions.create(model="kvmux", messages=messages, max_tokens=4, extra_headers=headers)

    assert first("When is high water?", **{"X-Kvmux-Prefix": "pin"}).usage.prompt_tokens_details.cached_tokens == 0
    assert first("And low water?").usage.prompt_tokens_details.cached_tokens >= 64
    with pytest.raises(Exception, match="X-Kvmux-Prefix must be one of auto, pin, off"):
        first("Anything?", **{"X-Kvmux-Prefix": "always"})


def test_anthropic_and_responses_report_a_shared_prefix_as_cached(base):
    """The Messages API's cache_read_input_tokens and the Responses API's
    input_tokens_details.cached_tokens count what a new conversation took
    from a shared prefix."""
    import anthropic

    system = "You keep the lighthouse log of a northern island. " + " ".join(
        f"Entry {i}: the lamp burned {i % 9 + 3} hours and the wind came from bearing {i * 30 % 360}."
        for i in range(10)
    )
    pin = {"X-Kvmux-Prefix": "pin"}
    claude = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=300)

    def message(question: str, **headers):
        messages = [{"role": "user", "content": question}]
        return claude.messages.create(
            model="kvmux", system=system, messages=messages, max_tokens=4, extra_headers=headers
        )

    assert message("How long did the lamp burn?", **pin).usage.cache_read_input_tokens == 0
    assert message("Where did the wind come from?").usage.cache_read_input_tokens >= 64
    openai = api(base)

    def response(question: str, **headers):
        return openai.responses.create(
            model="kvmux",
            instructions="Answer in one word. " + system,  # another opening than the one pinned above
            input=question,
            max_output_tokens=4,
            extra_headers=headers,
        )

    assert response("Which entry is first?", **pin).usage.input_tokens_details.cached_tokens == 0
    assert response("Which entry is last?").usage.input_tokens_details.cached_tokens >= 64
