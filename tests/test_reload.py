"""`kvmux serve` answers SIGHUP, a real signal to a real daemon: the
admission limits in its config file change while it runs (and its
sessions stay), what cannot change without a restart is said and left as
it was, and a config that does not load changes nothing."""

from __future__ import annotations

import json
import signal
import time

import pytest

from kvmux.client import Client, Overloaded


def events(stack, name: str) -> list[dict]:
    out = []
    for line in (stack.dir / "broker.log").read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == name:
            out.append(entry)
    return out


def hup(stack, event: str, count: int) -> dict:
    """SIGHUP the broker; its `count`-th `event` line."""
    stack.broker.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while len(found := events(stack, event)) < count:
        assert time.monotonic() < deadline, f"no {event} after SIGHUP\n{stack.logs()}"
        time.sleep(0.1)
    return found[count - 1]


@pytest.mark.stack
def test_sighup_reloads_the_admission_limits_and_names_what_needs_a_restart(stack_factory, tmp_path):
    config = tmp_path / "kvmux.toml"
    config.write_text("client_quota = 1\nmetrics_port = 0\n")
    stack = stack_factory(workers=1, slabs=2, broker_args=["--config", str(config)])
    with Client(stack.frontend) as client:
        first = client.open_session(client_name="alice")
        with pytest.raises(Overloaded):
            client.open_session(client_name="alice")
        config.write_text("client_quota = 3\nmax_store_bytes = 1000000000\nmetrics_port = 9\n")
        reloaded = hup(stack, "reloaded", 1)
        assert reloaded["changed"] == {"client_quota": [1, 3], "max_store_bytes": [0, 1_000_000_000]}
        assert events(stack, "reload_needs_restart")[0]["settings"] == ["metrics_port"]
        second = client.open_session(client_name="alice")  # the new quota, the first session kept
        assert first.info().session_id != second.id
        config.write_text("client_quota = 'many'\n")
        refused = hup(stack, "reload_refused", 1)
        assert "client_quota" in refused["why"]
        client.open_session(client_name="alice")  # still 3
        with pytest.raises(Overloaded):
            client.open_session(client_name="alice")
    assert stack.broker.poll() is None
