"""`kvmux bench engine`: the worker's engine where sessions live, in this
process on the model the worker loads (OpenBLAS preloaded as the worker
has it), as ratios of two sides measured in interleaved repeats (A B A B
...), each reported as median, min and max.

- decode: tokens/s at a full window against an empty cache;
- prefill: a 24-token message at a full window against an empty cache;
- shared passes: tokens/s of 8 and 16 sessions decoding together against
  one, at an empty and at a full window;
- verify passes: a pass of 9 and of 17 decode rows (a speculative verify
  pass: a token and its drafts, the drafts taken back after) against a
  one-token step, at a full window;
- before/after: the same decode and prefill through mlx-lm's own forward
  pass and its stock RotatingKVCache (what the worker ran before
  worker/attention.py), against the worker's pass;
- padding: decode at a full window and 8 shared sessions, padded as the
  batch-invariant mode pads against as the default mode runs here
  (worker/padding.py; 1.0 where the default pads too);
- sampling: 1 and 8 sessions decoding sampled tokens (bench/cpu.py's
  SAMPLED: temperature 0.7, top-p 0.9; each step's token chosen as the
  worker chooses it) with
  kvmux_native's sampler against mlx-lm's, at an empty cache (where
  kvmux_native runs the model);
- int8 products: 1 and 8 sessions decoding together, and a verify pass of
  9 rows, on the model loaded with `--cpu-products int8` against the
  exact products (where kvmux_native runs the model).

The passes are padded as a worker's are in the mode asked for, decided
the same way (the report's `padding`). `kvmux bench engine` measures each
BLAS kernel family in a run of its own (bench/kernels.py).

Each case runs at the serve default window (2048 + sink 4) and at a short
one (256), and says which is which.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from .cpu import SAMPLED
from .report import ReportWriter, ratio_summary

MESSAGE_TOKENS = 24
VERIFY_ROWS = (9, 17)  # a token and 8 drafts (the lookup's usual k), and the most a pass verifies
SAMPLED_SESSIONS = (1, 8)
INT8_SESSIONS = (1, 8)


@dataclass
class EngineConfig:
    windows: tuple[int, ...] = (2048, 256)
    sink: int = 4
    repeats: int = 5
    decode_tokens: int = 16
    sessions: tuple[int, ...] = (8, 16)
    model: str | None = None
    batch_invariant: bool = False  # pad as a worker with --batch-invariant does


class Bench:
    def __init__(self, cfg: EngineConfig):
        from kvmux.worker.preload import ensure_preloaded

        ensure_preloaded()
        import mlx.core as mx

        from kvmux.worker.model import load

        self.mx = mx
        self.cfg = cfg
        from kvmux.worker import padding
        from kvmux.worker.speculative import MAX_DRAFT

        loaded = load(cfg.model)
        self.model = loaded.model
        # The same model on the int8 products, where the kernel runs.
        self.int8 = load(cfg.model, products="int8").model if loaded.kernel.isa else None
        self.layers = len(self.model.layers)
        most_rows = max(cfg.sessions) * 17 + 128  # as a worker with that many slabs
        self.padding = padding.decide(
            self.model, most_rows, cfg.batch_invariant, lambda: loaded.make_slab(cfg.sink, padding.HISTORY, MAX_DRAFT)
        )
        self.floors = self.padding.floors

    # ------------------------------------------------------------ slabs

    def slab(self, window: int, fill: int, stock: bool = False) -> list:
        """A slab (or mlx-lm's stock cache) holding `fill` history tokens."""
        from mlx_lm.models.cache import RotatingKVCache

        from kvmux.worker.slab import make_slab
        from kvmux.worker.speculative import MAX_DRAFT

        cache = (
            [RotatingKVCache(self.cfg.sink + window, keep=self.cfg.sink) for _ in range(self.layers)]
            if stock
            else make_slab([None] * self.layers, self.cfg.sink, window, MAX_DRAFT)  # as the worker makes them
        )
        ids = [(17 * i) % 30000 + 100 for i in range(fill)]
        for at in range(0, fill, 128):
            self.run(cache, ids[at : at + 128], stock)
        return cache

    def copy(self, slab: list) -> list:
        """Another slab holding the same history (prefilling each full slab
        anew would take most of the bench's time)."""
        from mlx_lm.models.cache import RotatingKVCache

        from kvmux.worker.slab import SlabCache

        mx = self.mx
        out = []
        for layer in slab:
            if isinstance(layer, SlabCache):
                twin = SlabCache(layer.keep, layer.window, layer.spare)
            else:
                twin = RotatingKVCache(layer.max_size, keep=layer.keep)
            keys, values, *rest = layer.state
            twin.state = (keys + 0, values + 0, *rest)  # own buffers: updated in place like any slab
            out.append(twin)
        mx.eval([c.state for c in out])
        return out

    def run(self, cache: list, tokens: list[int], stock: bool = False, floors=None, model=None):
        from kvmux.worker.forward import Segment, forward

        mx = self.mx
        if stock:
            logits = self.model(mx.array(tokens)[None], cache=cache)[:, -1, :]
        else:
            logits = forward(model or self.model, [Segment(mx.array(tokens), cache)], floors or self.floors)[0]
        mx.eval(logits, [c.state for c in cache])
        return logits

    def full(self, window: int) -> int:
        from kvmux.worker.speculative import MAX_DRAFT

        return self.cfg.sink + window + MAX_DRAFT + 8  # the ring (window and spare slots) has wrapped

    # ------------------------------------------------------------ measures

    def decode_tps(self, cache: list, stock: bool = False, floors=None) -> float:
        n = self.cfg.decode_tokens
        started = time.perf_counter()
        for i in range(n):
            self.run(cache, [100 + i], stock, floors)
        return n / (time.perf_counter() - started)

    def prefill_s(self, cache: list, stock: bool = False) -> float:
        started = time.perf_counter()
        self.run(cache, [200 + i for i in range(MESSAGE_TOKENS)], stock)
        return time.perf_counter() - started

    def shared_tps(self, slabs: list[list], floors=None, model=None) -> float:
        """Tokens/s of len(slabs) sessions decoding in shared passes (on
        `model`: the bench's own where None)."""
        from kvmux.worker.forward import Segment, forward

        mx = self.mx
        n = self.cfg.decode_tokens
        started = time.perf_counter()
        for i in range(n):
            segments = [Segment(mx.array([100 + i]), slab) for slab in slabs]
            logits = forward(model or self.model, segments, floors or self.floors)
            mx.eval(logits, [[c.state for c in slab] for slab in slabs])
        return n * len(slabs) / (time.perf_counter() - started)

    def sampled_tps(self, slabs: list[list], native) -> float:
        """Tokens/s of len(slabs) sessions decoding in shared passes, each
        step's token sampled from the last (decoding.Choice: `native`'s
        sampler, or mlx-lm's where None) and fed to the next."""
        from kvmux.protocol import SpeculativeMode
        from kvmux.worker.decoding import Choice, GenerationParams
        from kvmux.worker.forward import Segment, forward

        mx = self.mx
        n = self.cfg.decode_tokens
        choices = [
            Choice(
                GenerationParams(
                    n, SAMPLED["temperature"], SAMPLED["top_p"], 0, seed=i, stop=[], speculative=SpeculativeMode.OFF
                ),
                native,
            )
            for i in range(len(slabs))
        ]
        tokens = [mx.array([100 + i]) for i in range(len(slabs))]
        started = time.perf_counter()
        for step in range(n):
            logits = forward(
                self.model, [Segment(t, slab, True) for t, slab in zip(tokens, slabs, strict=True)], self.floors
            )
            tokens = [c.sample(row, step) for c, row in zip(choices, logits, strict=True)]
            mx.eval(tokens, [[c.state for c in slab] for slab in slabs])
        return n * len(slabs) / (time.perf_counter() - started)

    def pass_s(self, cache: list, rows: int, model=None) -> float:
        """Seconds of a pass of `rows` decode rows: a token and its drafts,
        the drafts taken back after (all rejected), as a worker does."""
        from kvmux.worker.forward import Segment, forward
        from kvmux.worker.slab import rewind

        mx = self.mx
        n = self.cfg.decode_tokens
        started = time.perf_counter()
        for i in range(n):
            logits = forward(
                model or self.model, [Segment(mx.array([100 + i + j for j in range(rows)]), cache, True)], self.floors
            )
            mx.eval(logits, [c.state for c in cache])
            rewind(cache, rows - 1)
        return (time.perf_counter() - started) / n

    def interleaved(self, a: Callable[[], float], b: Callable[[], float], bar: tqdm) -> dict:
        pairs = []
        for _ in range(self.cfg.repeats):
            pairs.append((a(), b()))
            bar.update()
        return ratio_summary(pairs)


def run(cfg: EngineConfig, output: Path, progress: bool = True) -> dict:
    from kvmux.worker import cpu_kernel

    bench = Bench(cfg)
    writer = ReportWriter(output, "engine", asdict(cfg))
    results: dict = {}
    writer.doc["padding"] = asdict(bench.padding)
    writer.doc["results"] = results
    native = cpu_kernel.native_of(bench.model)
    sampled = len(SAMPLED_SESSIONS) if native else 0
    int8 = len(INT8_SESSIONS) + 1 if bench.int8 is not None else 0
    cases = len(cfg.windows) * (6 + len(VERIFY_ROWS) + 2 * len(cfg.sessions) + sampled + int8)
    padded = bench.padding.calibrated
    with tqdm(total=cases * cfg.repeats, desc="engine", unit="pair", disable=not progress) as bar:
        for window in cfg.windows:
            label = f"window_{window}" + (" (serve default)" if window == 2048 else " (short)")
            r = results[label] = {"sink": cfg.sink, "window": window, "full_tokens": bench.full(window)}
            # An empty cache is made afresh for each measure (a measure adds
            # tokens); a full one stays full.
            full = bench.slab(window, bench.full(window))

            def empty(window=window):
                return bench.slab(window, MESSAGE_TOKENS)

            r["decode_full_vs_empty"] = bench.interleaved(
                lambda: bench.decode_tps(empty()), lambda f=full: bench.decode_tps(f), bar
            )
            r["prefill24_full_vs_empty"] = bench.interleaved(
                lambda: bench.prefill_s(empty()), lambda f=full: bench.prefill_s(f), bar
            )
            stock_full = bench.slab(window, bench.full(window), stock=True)
            r["decode_full_worker_vs_stock"] = bench.interleaved(
                lambda s=stock_full: bench.decode_tps(s, stock=True), lambda f=full: bench.decode_tps(f), bar
            )
            r["prefill24_full_worker_vs_stock"] = bench.interleaved(
                lambda s=stock_full: bench.prefill_s(s, stock=True), lambda f=full: bench.prefill_s(f), bar
            )
            r["decode_full_batch_invariant_vs_default"] = bench.interleaved(
                lambda f=full: bench.decode_tps(f), lambda f=full: bench.decode_tps(f, floors=padded), bar
            )
            for rows in VERIFY_ROWS:
                r[f"verify_{rows}_rows_vs_step_full"] = bench.interleaved(
                    lambda f=full: bench.pass_s(f, 1), lambda f=full, n=rows: bench.pass_s(f, n), bar
                )
            if bench.int8 is not None:  # seconds a pass: exact over int8, a speed-up as the others
                r["int8_verify_9_rows_vs_exact_full"] = bench.interleaved(
                    lambda f=full: bench.pass_s(f, 9, bench.int8), lambda f=full: bench.pass_s(f, 9), bar
                )
            eight = [full] + [bench.copy(full) for _ in range(7)]
            r["shared_8_full_batch_invariant_vs_default"] = bench.interleaved(
                lambda k=eight: bench.shared_tps(k), lambda k=eight: bench.shared_tps(k, floors=padded), bar
            )
            del stock_full, full, eight

            def fresh(n, empty=empty):
                return [empty() for _ in range(n)]

            for count in cfg.sessions:
                r[f"shared_{count}_vs_1_empty"] = bench.interleaved(
                    lambda f=fresh: bench.shared_tps(f(1)), lambda f=fresh, c=count: bench.shared_tps(f(c)), bar
                )
                first = bench.slab(window, bench.full(window))
                kept = [first] + [bench.copy(first) for _ in range(count - 1)]
                r[f"shared_{count}_vs_1_full"] = bench.interleaved(
                    lambda k=kept: bench.shared_tps(k[:1]), lambda k=kept: bench.shared_tps(k), bar
                )
                del kept
            for count in INT8_SESSIONS if bench.int8 is not None else ():
                r[f"int8_{count}_vs_exact_empty"] = bench.interleaved(
                    lambda f=fresh, c=count: bench.shared_tps(f(c)),
                    lambda f=fresh, c=count: bench.shared_tps(f(c), model=bench.int8),
                    bar,
                )
            for count in SAMPLED_SESSIONS if native else ():
                r[f"sampled_{count}_kernel_vs_mlx_lm_empty"] = bench.interleaved(
                    lambda f=fresh, c=count: bench.sampled_tps(f(c), None),
                    lambda f=fresh, c=count: bench.sampled_tps(f(c), native),
                    bar,
                )
            writer.write()
    writer.write("done")
    return writer.doc


def summary(doc: dict) -> dict:
    """The median ratios, one line each."""
    out = {}
    for label, r in doc.get("results", {}).items():
        for key, value in r.items():
            if isinstance(value, dict) and "median" in value:
                out[f"{label.split()[0]} {key}"] = f"{value['median']} ({value['min']}-{value['max']})"
    return out
