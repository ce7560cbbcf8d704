"""Broker settings: TOML + command line, validated with errors that name the
key; and the queue-wait percentiles reported in stats."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import Daemon, kvmux_command

from kvmux.broker.admission import percentiles
from kvmux.broker.config import BrokerConfig, load
from kvmux.settings import ConfigError


def test_toml_values_and_command_line_override(tmp_path):
    path = tmp_path / "kvmux.toml"
    path.write_text(
        'admission = "queue"\nqueue_depth = 5\nqueue_wait_s = 2.5\nclient_quota = 3\nworker_args = ["--window", "256"]\n'
    )
    cfg = load(path, queue_depth=9, idle_timeout_s=None)
    assert (cfg.admission, cfg.queue_depth, cfg.queue_wait_s, cfg.client_quota) == ("queue", 9, 2.5, 3)
    assert cfg.worker_args == ["--window", "256"]
    assert cfg.idle_timeout_s == 0.0  # None = not given: the default stays
    assert load() == BrokerConfig()


@pytest.mark.parametrize(
    ("toml", "overrides", "expected"),
    [
        ("slabs = 0", {}, "slabs: Expected `int` >= 1"),
        ('admission = "fifo"', {}, "admission: Invalid enum value 'fifo' (choose one of: reject, queue)"),
        ("queue_wait_s = -1", {}, "queue_wait_s: Expected `float` > 0"),
        ("queue_wait_s = 'long'", {}, "queue_wait_s: Expected `float`, got `str`"),
        ("slab = 4", {}, "unknown field `slab`"),
        ("slabs = [", {}, "not valid TOML"),
        ("", {"admission": "queue", "queue_depth": 0}, "admission = 'queue' needs queue_depth >= 1"),
        ("", {"client_quota": -2}, "client_quota: Expected `int` >= 0"),
        ("client_liveness_s = 1.5", {}, "client_liveness_s must be 0 (never) or at least two heartbeat intervals"),
    ],
)
def test_bad_values_are_named(tmp_path, toml, overrides, expected):
    path = tmp_path / "kvmux.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load(path, **overrides)
    assert expected in str(info.value)
    assert str(path) in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config .*nope\.toml"):
        load(tmp_path / "nope.toml")


def test_serve_refuses_a_bad_config(tmp_path):
    path = tmp_path / "kvmux.toml"
    path.write_text("queue_depth = -3\n")
    done = subprocess.run(
        kvmux_command("serve", "--workers", "0", "--config", str(path)), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "queue_depth: Expected `int` >= 0" in done.stderr
    done = subprocess.run(
        kvmux_command("serve", "--workers", "0", "--admission", "lifo"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "choose one of: reject, queue" in done.stderr


def test_percentiles():
    assert percentiles([]) == (0.0, 0.0)
    assert percentiles([0.25]) == (0.25, 0.25)
    p50, p99 = percentiles([float(i) for i in range(1, 101)])  # 1..100
    assert p50 == pytest.approx(50.5)
    assert p99 == pytest.approx(99.01)
    p50, p99 = percentiles([0.1] * 99 + [10.0])
    assert p50 == pytest.approx(0.1)
    assert 0.1 < p99 < 10.0  # the one slow wait shows in the tail, not the median


@pytest.mark.stack
def test_batch_invariant_from_toml_reaches_the_local_workers(tmp_path):
    """`batch_invariant = true` in the TOML: `kvmux serve`'s worker makes
    every pass row-invariant (with float32 weights on AVX2 BLAS kernels too,
    `cpu_kernel = "off"`, where the default would not), and stats and
    doctor say so."""
    path = tmp_path / "kvmux.toml"
    path.write_text('batch_invariant = true\ncpu_kernel = "off"\n')
    with Daemon(tmp_path, slabs=1, args=["--config", str(path)], env={"OPENBLAS_CORETYPE": "Haswell"}) as daemon:
        stats = daemon.wait_workers(1)
        compute = stats.workers[0].compute
        assert (compute.mode, compute.exact, compute.blas) == ("batch-invariant", True, "OpenBLAS Haswell")
        # AVX2 kernels' rows depend on where they sit: decode rows go one at a time, whatever it costs
        assert compute.rows_alone and compute.pad_cost > 1.05
        doctor = subprocess.run(
            kvmux_command("doctor", "--endpoint", daemon.frontend), capture_output=True, text=True, timeout=60
        )
        assert "none (off); OpenBLAS Haswell, batch-invariant: exact, decode rows one at a time" in doctor.stdout, (
            doctor.stdout
        )


def test_models_are_declared_once_and_checked(tmp_path):
    """[[models]], or --model repeated (once: `model`, as ever); a model
    beside [[models]], a name given twice, [[models]] without local workers
    and a key a model does not take are refused by name."""
    cfg = load(model=("a.gguf", "b.gguf"))
    assert [m.path for m in cfg.models] == ["a.gguf", "b.gguf"] and cfg.model is None
    cfg = load(model=("a.gguf",))
    assert cfg.model == "a.gguf" and cfg.models == []
    path = tmp_path / "kvmux.toml"
    for toml, why in (
        ('model = "a.gguf"\n[[models]]\npath = "b.gguf"\n', "give `model` (one) or [[models]], not both"),
        ('[[models]]\npath = "a.gguf"\naliases = ["x"]\n[[models]]\npath = "b.gguf"\naliases = ["x"]\n', "x named"),
        ('workers = 0\n[[models]]\npath = "a.gguf"\n', "workers must be at least 1"),
        ('[[models]]\npath = "a.gguf"\nquantized = true\n', "unknown field `quantized`"),
    ):
        path.write_text(toml)
        with pytest.raises(ConfigError, match=re.escape(why)):
            load(path)
