"""PNG plots of bench reports (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

_MODES = (("turns", "session (kvmux)", "tab:blue"), ("baseline", "re-prefill (stateless)", "tab:orange"))


def _series(turns: list[dict], key: str) -> tuple[list[int], list[float]]:
    ok = [r for r in turns if not r.get("error") and r.get(key) is not None]
    return [r["turn"] for r in ok], [r[key] for r in ok]


def plot_soak(report: dict, path: Path) -> Path:
    """Per-turn prefill seconds, kv_live_bytes and worker RSS against turn
    number, the session mode and (if run) the re-prefill baseline."""
    runs = {"turns": report.get("turns", []), "baseline": (report.get("baseline") or {}).get("turns", [])}
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for key, label, color in _MODES:
        turns = runs[key]
        if not turns:
            continue
        x, y = _series(turns, "prefill_s")
        axes[0].plot(x, y, ".", ms=3, color=color, label=label)
        x, y = _series(turns, "kv_live_bytes")
        axes[1].plot(x, [v / 2**20 for v in y], ".-", ms=3, lw=0.8, color=color, label=label)
        x, y = _series(turns, "rss_bytes")
        axes[2].plot(x, [v / 2**20 for v in y], ".-", ms=2, lw=0.8, color=color, label=label)
    slab = (report.get("summary") or {}).get("slab_bytes")
    if slab:
        axes[1].axhline(slab / 2**20, ls="--", lw=0.8, color="grey", label="slab capacity")
    for ax in axes:  # from zero: a flat line must look flat, not zoomed-in noise
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("prefill s")
    axes[1].set_ylabel("kv_live MiB")
    axes[2].set_ylabel("worker RSS MiB")
    axes[2].set_xlabel("turn")
    cfg = report.get("config", {})
    fig.suptitle(
        f"kvmux soak: {len(runs['turns'])} turns, window {cfg.get('window')}, "
        f"max_tokens {cfg.get('max_tokens')}, sessions {cfg.get('sessions')}"
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    return save(fig, path)


def plot_perf(report: dict, path: Path) -> Path:
    """The perf ratios as bars, and aggregate tokens/s against concurrent sessions."""
    ratios = report.get("ratios", {})
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [k for k, v in ratios.items() if isinstance(v, (int, float))]
    ax0.barh(names, [ratios[k] for k in names], color="tab:blue")
    ax0.axvline(1.0, ls="--", lw=0.8, color="grey")
    for i, k in enumerate(names):
        ax0.text(ratios[k], i, f" {ratios[k]:.2f}", va="center", fontsize=8)
    ax0.set_title("ratios (1.0 = parity)")
    vs_1 = (report.get("sessions_throughput") or {}).get("vs_1", {})
    if vs_1:
        counts = [int(n) for n in vs_1]
        med = [r["median"] for r in vs_1.values()]
        low = [r["median"] - r["min"] for r in vs_1.values()]
        high = [r["max"] - r["median"] for r in vs_1.values()]
        ax1.errorbar(counts, med, yerr=[low, high], fmt="o-", capsize=3)
        ax1.set_xlabel("concurrent sessions")
        ax1.set_ylabel("aggregate tokens/s vs 1 session (median, min-max)")
        ax1.set_xscale("log", base=2)
    ax1.set_title("sessions_throughput")
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
    fig.suptitle("kvmux bench perf")
    return save(fig, path)


def save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
