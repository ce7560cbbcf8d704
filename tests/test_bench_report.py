"""Report aggregation, the atomic checkpointed writer and the plots, on real
report files the soak produced (tests/data/bench/README.md says how each was
made), failing cases included."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvmux.bench import plot
from kvmux.bench.report import ReportWriter, load, write_json_atomic
from kvmux.bench.summary import SeriesError, summarize, verdicts_pass
from kvmux.commands.cli import app

DATA = Path(__file__).parent / "data" / "bench"


def ok_turns(doc: dict) -> list[dict]:
    return [r for r in doc["turns"] if not r.get("error")]


def test_passing_soak_summary_matches_its_turns():
    doc = load(DATA / "soak-window64-30turns.json")
    turns = ok_turns(doc)
    s = summarize(doc["turns"])
    assert s["turns"] == 30 and s["errors"] == 0
    # Hand-checked against the records: 30 turns -> deciles of 3 turns.
    prefill = [r["prefill_s"] for r in sorted(turns, key=lambda r: r["turn"])]
    assert s["prefill_s_first_decile_p50"] == pytest.approx(sorted(prefill[:3])[1])
    assert s["prefill_s_last_decile_p50"] == pytest.approx(sorted(prefill[-3:])[1])
    assert s["prefill_drift_ratio"] == pytest.approx(s["prefill_s_last_decile_p50"] / s["prefill_s_first_decile_p50"])
    assert s["latency_p50_s"] == pytest.approx(float(np.median([r["latency_s"] for r in turns])))
    kv = [r["kv_live_bytes"] for r in turns]
    assert (s["kv_live_bytes_min"], s["kv_live_bytes_max"]) == (min(kv), max(kv))
    # History 44, 67, 90 tokens: window 64 + sink 4 = 68 fills on turn 3;
    # from then on the slab is flat and full.
    assert s["window_filled_at_turn"] == 3
    assert s["kv_bytes_after_fill_spread"] == 1.0
    assert s["kv_live_bytes_max"] == s["slab_bytes"]
    assert s["kv_bounded"] is True
    assert s["rss_growth_ratio"] >= 1.0 and s["rss_bounded"] == (s["rss_growth_ratio"] <= 1.05)


def test_kv_is_judged_flat_from_the_turn_the_slab_is_full_spare_slots_included():
    """The window drops tokens a turn before the slab's spare slots (a verify
    pass's drafts) are written: flatness is measured from the turn the
    arrays hold every slot, where it holds."""
    doc = load(DATA / "soak-window64-spare.json")
    s = summarize(doc["turns"])
    turns = sorted(ok_turns(doc), key=lambda r: r["turn"])
    assert s["window_filled_at_turn"] == 2 and s["slab_full_at_turn"] == 3
    assert turns[1]["truncated_tokens"] > 0 and turns[1]["kv_live_bytes"] < s["slab_bytes"]
    assert {r["kv_live_bytes"] for r in turns[2:]} == {s["slab_bytes"]}
    assert s["kv_bytes_after_fill_spread"] == 1.0 and s["kv_bounded"] is True
    assert verdicts_pass(s)  # the run the issue saw exit 1 passes


def test_growing_kv_series_fails_kv_bounded():
    doc = load(DATA / "soak-window2048-growing.json")
    s = summarize(doc["turns"])
    kv = [r["kv_live_bytes"] for r in sorted(ok_turns(doc), key=lambda r: r["turn"])]
    assert kv == sorted(kv) and kv[-1] > kv[0]  # the file really is a growing series
    assert s["window_filled_at_turn"] is None and s["slab_full_at_turn"] is None
    assert s["kv_bytes_after_fill_spread"] is None
    assert s["kv_bounded"] is False
    assert not verdicts_pass(s)


def test_drifting_prefill_series_fails_prefill_bounded():
    # The re-prefill baseline of the same run: each turn re-sends the whole
    # (growing) conversation, so its prefill seconds drift upward.
    doc = load(DATA / "soak-window2048-growing.json")
    base = doc["baseline"]["turns"]
    tokens = [r["prompt_tokens"] for r in sorted(base, key=lambda r: r["turn"])]
    assert tokens == sorted(tokens) and tokens[-1] > 3 * tokens[0]
    s = summarize(base)
    assert s["prefill_drift_ratio"] > 1.10
    assert s["prefill_bounded"] is False


def test_constant_kv_series_is_an_error():
    doc = load(DATA / "soak-window16-constant.json")
    assert len({r["kv_live_bytes"] for r in ok_turns(doc)}) == 1
    with pytest.raises(SeriesError, match="constant"):
        summarize(doc["turns"])


def test_zero_kv_series_is_an_error():
    doc = load(DATA / "soak-zero-kv.json")
    with pytest.raises(SeriesError, match="zero"):
        summarize(doc["turns"])


def test_failed_turns_count_as_errors_and_are_left_out():
    doc = load(DATA / "soak-window64-30turns.json")
    turns = doc["turns"] + [{"session": 0, "turn": 31, "latency_s": 0.1, "error": "WorkerLost: gone"}]
    s = summarize(turns)
    assert (s["turns"], s["errors"]) == (31, 1)
    assert s["latency_p50_s"] == summarize(doc["turns"])["latency_p50_s"]


def test_report_command_exit_codes(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["bench", "report", str(DATA / "soak-window64-30turns.json")])
    assert "kv_bounded: True" in ok.output
    bad = runner.invoke(app, ["bench", "report", str(DATA / "soak-window16-constant.json")])
    assert bad.exit_code == 1 and "ERROR" in bad.output
    grow = runner.invoke(app, ["bench", "report", str(DATA / "soak-window2048-growing.json")])
    assert grow.exit_code == 1 and "kv_bounded: False" in grow.output


def test_atomic_write_replaces_whole_file_or_nothing(tmp_path):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})  # fails mid-serialization
    assert load(path) == {"a": 1}
    assert os.listdir(tmp_path) == ["r.json"]  # no temp file left behind


def test_checkpoints_follow_the_interval(tmp_path):
    path = tmp_path / "r.json"
    writer = ReportWriter(path, "soak", {"turns": 3}, every_s=3600)
    writer.doc["turns"] = []
    assert writer.checkpoint() is True  # first one is always due
    writer.doc["turns"].append({"turn": 1})
    assert writer.checkpoint() is False and load(path)["turns"] == []
    writer.every_s = 0.0
    assert writer.checkpoint() is True and load(path)["turns"] == [{"turn": 1}]
    writer.write("interrupted")
    doc = load(path)
    assert doc["status"] == "interrupted" and doc["config"] == {"turns": 3} and doc["machine"]["cpu_count"]


def test_plots_are_pngs(tmp_path):
    soak_png = plot.plot_soak(load(DATA / "soak-window2048-growing.json"), tmp_path / "soak.png")
    perf_png = plot.plot_perf(load(DATA / "perf-small.json"), tmp_path / "perf.png")
    for png in (soak_png, perf_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_perf_report_ratios_are_consistent():
    from kvmux.bench.perf import ratios

    doc = load(DATA / "perf-small.json")
    r = ratios(doc)
    assert r == doc["ratios"]
    assert r["stack_vs_bare_decode"] == doc["stack_vs_bare_decode"]["ratio"]["median"]
    pairs = doc["stack_vs_bare_decode"]["ratio"]
    assert min(b / a for a, b in zip(pairs["a"], pairs["b"], strict=True)) == pytest.approx(pairs["min"], abs=1e-3)
    assert {"broker_rtt_p50_vs_direct_ipc", "broker_rtt_p50_vs_direct_tcp"} <= r.keys()
    json.dumps(r)  # plain numbers only
