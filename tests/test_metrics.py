"""Prometheus metrics and readiness, scraped from real processes: the
daemon's `--metrics-port` and the gateway's /metrics, parsed with
prometheus_client's own parser, move as a chat runs; a refusal is counted
by its reason, a worker that leaves as lost; the gateway's /ready turns
503 while the daemon drains and while its store is unreachable."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from conftest import KEY, api, http_gateway
from prometheus_client.parser import text_string_to_metric_families

from kvmux.bench import redis_server as bench_redis
from kvmux.client import Client, Overloaded

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> Samples:
    """Every sample of the endpoint: (name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith(
            "text/plain; version=0.0.4"
        )  # what a scraper without Accept gets
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples that have these labels (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def say(session, text: str) -> str:
    return "".join(chunk.text for chunk in session.chat(text, max_tokens=8))


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_daemon_metrics_move_as_a_chat_runs(shared_stack):
    before = scrape(shared_stack.metrics)
    assert value(before, "kvmux_worker_up") == 1
    assert value(before, "kvmux_slabs") == 8
    with Client(shared_stack.frontend) as client:
        session = client.open_session("You are terse.")
        say(session, "Name a colour.")
        first = scrape(shared_stack.metrics)
        say(session, "And another one?")
        second = scrape(shared_stack.metrics)
        history = session.info().history_tokens

    def moved(after: Samples, earlier: Samples, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(earlier, name, **labels)

    assert moved(first, before, "kvmux_requests_total", op="generate", outcome="ok") == 1
    assert moved(first, before, "kvmux_requests_total", op="open", outcome="ok") == 1
    assert moved(first, before, "kvmux_time_to_first_token_seconds_count") == 1
    assert moved(first, before, "kvmux_inter_token_latency_seconds_count") >= 1
    assert moved(first, before, "kvmux_generated_tokens_total") >= 2
    assert moved(first, before, "kvmux_prefilled_tokens_total") > 0
    # The first turn prefills everything; the second finds the first in its slab.
    assert moved(first, before, "kvmux_cached_tokens_total", source="session") == 0
    cached = moved(second, first, "kvmux_cached_tokens_total", source="session")
    assert 0 < cached < history
    assert moved(second, first, "kvmux_time_to_first_token_seconds_count") == 1
    assert value(second, "kvmux_sessions", state="live") >= 1
    assert value(second, "kvmux_slabs_used") + value(second, "kvmux_slabs_free") == 8
    assert value(second, "process_resident_memory_bytes") > 0
    # No session id, anywhere.
    assert not any(dict(labels).get("session") for _, labels in second)


def test_kv_live_bytes_come_with_the_heartbeat(shared_stack):
    with Client(shared_stack.frontend) as client:
        session = client.open_session()
        say(session, "Say hi.")
        deadline = time.monotonic() + 10
        while value(scrape(shared_stack.metrics), "kvmux_kv_live_bytes") < session.info().kv_live_bytes:
            assert time.monotonic() < deadline, "kv_live_bytes never reached the session's"
            time.sleep(0.3)


def test_gateway_metrics_count_requests_tokens_and_cache_hits(base):
    url = f"{base}/metrics"
    before = scrape(url)
    client = api(base)
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(model="kvmux", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    messages += [{"role": "user", "content": "Another?"}]
    second = client.chat.completions.create(model="kvmux", messages=messages, max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in second if c.choices)
    after = scrape(url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("kvmux_http_requests_total", api="chat_completions", status="200") == 2
    assert moved("kvmux_http_time_to_first_token_seconds_count", api="chat_completions") == 2
    assert moved("kvmux_http_generated_tokens_total", api="chat_completions") >= 2
    assert moved("kvmux_http_prefilled_tokens_total", api="chat_completions") > 0
    assert moved("kvmux_http_cached_tokens_total", api="chat_completions") > 0  # the second turn's
    with pytest.raises(openai.AuthenticationError):
        api(base, "sk-wrong").models.list()
    assert value(scrape(url), "kvmux_http_requests_total", api="models", status="401") >= 1


@pytest.mark.stack
def test_refusals_by_reason_and_ready_through_a_drain(stack_factory, tmp_path):
    stack = stack_factory(workers=1, slabs=2, metrics=True, broker_args=["--client-quota", "1"])
    with http_gateway(stack, tmp_path, [KEY]) as base, Client(stack.frontend) as client:
        assert get(f"{base}/ready") == (200, {"status": "ready"})
        # The quota: a second session of one client is refused, and counted so.
        client.open_session(client_name="alice")
        with pytest.raises(Overloaded):
            client.open_session(client_name="alice")
        assert value(scrape(stack.metrics), "kvmux_refusals_total", reason="quota") == 1
        # The gateway's caller is one client too: its second conversation is refused (429).
        chat = api(base)
        chat.chat.completions.create(model="kvmux", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        with pytest.raises(openai.RateLimitError):
            chat.chat.completions.create(model="kvmux", messages=[{"role": "user", "content": "Yo"}], max_tokens=2)
        gateway = scrape(f"{base}/metrics")
        assert value(gateway, "kvmux_http_refusals_total", reason="quota") == 1
        assert value(gateway, "kvmux_http_requests_total", api="chat_completions", status="429") == 1
        assert value(scrape(stack.metrics), "kvmux_refusals_total", reason="quota") == 2
        # A worker that leaves is counted lost, and no longer up.
        stack.add_worker()
        assert value(scrape(stack.metrics), "kvmux_worker_up") == 2
        stack.kill_worker(1, signal.SIGTERM)  # it drains, says DISCONNECT, exits
        deadline = time.monotonic() + 10
        while value(samples := scrape(stack.metrics), "kvmux_workers_lost_total") < 1:
            assert time.monotonic() < deadline, "the worker's loss was never counted"
            time.sleep(0.2)
        assert value(samples, "kvmux_worker_up") == 1
        # A stream that waits for credit keeps the drain waiting: /ready says so meanwhile.
        session = client.open_session(client_name="bob")
        stream = session.generate(messages=[{"role": "user", "content": "Count to fifty."}], credit=1, max_tokens=200)
        started = threading.Event()

        def read_one() -> None:
            next(iter(stream))
            started.set()

        threading.Thread(target=read_one, daemon=True).start()
        assert started.wait(60)
        with Client(stack.admin) as admin:
            admin.drain(grace_s=60)
        status, body = get(f"{base}/ready")
        assert status == 503
        assert body["reasons"] == ["the daemon is draining"]
        assert value(scrape(stack.metrics), "kvmux_draining") == 1


def test_a_shared_prefix_is_counted_as_cached_from_the_prefix(shared_stack):
    system = "You keep the inventory of a lighthouse. " + " ".join(
        f"Item {i}: shelf {i % 9} holds {i * 3} spare lamps of type L{i}." for i in range(40)
    )  # an opening past the daemon's prefix_min_tokens (512)
    before = scrape(shared_stack.metrics)
    with Client(shared_stack.frontend) as client:
        results = []
        for _ in range(2):  # the second session's opening is the first's
            session = client.open_session(system)
            stream = session.chat("Which shelf holds item 4?", max_tokens=4)
            "".join(chunk.text for chunk in stream)
            results.append(stream.result)
            session.close()
    taken = results[1].cached_tokens
    assert results[0].cached_tokens == 0 and taken >= 512
    deadline = time.monotonic() + 10  # the hit's count comes with the worker's heartbeat
    while value(after := scrape(shared_stack.metrics), "kvmux_prefix_hits_total") <= value(
        before, "kvmux_prefix_hits_total"
    ):
        assert time.monotonic() < deadline, "the prefix hit was never counted"
        time.sleep(0.3)
    moved = value(after, "kvmux_cached_tokens_total", source="prefix") - value(
        before, "kvmux_cached_tokens_total", source="prefix"
    )
    assert moved == taken


def wait_ready(base: str, status: int, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (answer := get(f"{base}/ready"))[0] != status:
        assert time.monotonic() < deadline, f"/ready stayed {answer}"
        time.sleep(0.2)
    return answer[1]


@pytest.mark.stack
def test_ready_turns_503_while_the_store_is_unreachable(stack_factory, tmp_path):
    with bench_redis.redis_server(tmp_path / "redis") as server:
        store = ["--store", server.url]
        stack = stack_factory(workers=1, slabs=1, broker_args=store, worker_args=store)
        with http_gateway(stack, tmp_path, [KEY]) as base:
            assert wait_ready(base, 200) == {"status": "ready"}
            server.kill()
            (reason,) = wait_ready(base, 503)["reasons"]
            assert reason.startswith("the session store: ")
            server.start()
            wait_ready(base, 200)
