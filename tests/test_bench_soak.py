"""A short soak end to end over ipc on the real stack, through `kvmux bench
soak`, with the re-prefill baseline on every 10th turn. No timing asserts:
prefill seconds on 2 shared cores are the bench's to report, not a test's."""

from __future__ import annotations

from typer.testing import CliRunner

from kvmux.bench.report import load
from kvmux.commands.cli import app

TURNS = 30


def test_short_soak_end_to_end(shared_stack, tmp_path):
    out = tmp_path / "soak.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "soak",
            "--endpoint",
            shared_stack.frontend,
            "--turns",
            str(TURNS),
            "--window",
            "64",
            "--max-tokens",
            "4",
            "--baseline",
            "reprefill",
            "--baseline-every",
            "10",
            "--output",
            str(out),
            "--no-progress",
            "--checkpoint-s",
            "1",
        ],
    )
    assert result.exit_code in (0, 1), result.output  # 1: a verdict failed (timing noise), reported below
    doc = load(out)
    assert doc["status"] == "complete" and doc["summary_error"] is None, doc.get("summary_error")
    s = doc["summary"]
    assert s["turns"] == TURNS and s["errors"] == 0, [t for t in doc["turns"] if t.get("error")]
    assert s["window_filled_at_turn"] is not None
    assert s["kv_bounded"] is True and s["kv_live_bytes_max"] == s["slab_bytes"]
    turns = sorted(doc["turns"], key=lambda r: r["turn"])
    assert all(r["rss_bytes"] and r["worker_pid"] for r in turns)  # read from the worker's /proc
    assert [r["history_tokens"] for r in turns] == sorted(r["history_tokens"] for r in turns)
    # Session-bound prefill: after turn 1 a turn prefills only its new
    # message; the stateless baseline re-sends the history that fits.
    base = sorted(doc["baseline"]["turns"], key=lambda r: r["turn"])
    assert [r["turn"] for r in base] == [1, 11, 21]
    by_turn = {r["turn"]: r for r in turns}
    for r in base[1:]:
        assert r["resent_messages"] > 1
        assert r["prompt_tokens"] > 2 * by_turn[r["turn"]]["prompt_tokens"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
