"""KV slabs: one bounded cache per session (StreamingLLM: `sink` tokens kept
forever plus the last `window`), and the fixed pool they come from."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache


class SlabCache(RotatingKVCache):
    """mlx-lm's RotatingKVCache, with one attention rule for every token: a
    query at position P sees the sink and the last `window` positions up to
    P, itself included, whether its token came alone or inside a chunk (a
    single decode step always did; the stock multi-token path let a chunk's
    later tokens see `sink` more and hid the sink from most of the chunk).

    A multi-token update writes the new tokens into the ring in place and
    returns the slab as it stood plus the new keys, which `make_mask` masks
    by the position each slot holds: one copy of the slab where the stock
    path made three (temporal reorder, concatenation, trim back), and the
    stored arrays never exceed `max_size`. worker/attention.py attends over
    the same two blocks without even that copy.
    """

    def __init__(self, max_size: int, keep: int = 0):
        super().__init__(max_size, keep=keep)
        # Decode steps grow the arrays by `step` slots: mlx-lm's 256, but at
        # most an eighth of the slab, so a small slab also grows as it fills.
        self.step = max(16, min(256, max_size // 8))

    @property
    def window(self) -> int:
        return self.max_size - self.keep

    def positions(self) -> np.ndarray:
        """The position each stored slot holds (-1: not written yet)."""
        slots = self.keys.shape[2]
        if self.offset <= slots and self._idx == self.offset:  # not wrapped: slot i holds position i
            pos = np.arange(slots)
            pos[self.offset :] = -1
            return pos
        # Wrapped: the sink, then a ring whose newest entry sits just before
        # _idx (mlx-lm's convention, whatever chunking led here).
        slot = np.arange(slots)
        back = (self._idx - 1 - slot) % self.window
        return np.where(slot < self.keep, slot, self.offset - 1 - back)

    def visible(self, n: int, window: int | None = None) -> np.ndarray:
        """(n, stored slots + n) bool: what each of `n` new tokens may see of
        the slab as it stands followed by the new tokens themselves."""
        query = self.offset + np.arange(n)
        key = query if self.keys is None else np.concatenate([self.positions(), query])
        window = min(self.window, window or self.window)
        q, k = query[:, None], key[None, :]
        return (k >= 0) & (k <= q) & ((k < self.keep) | (k > q - window))

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Store new tokens: appended while the arrays are shorter than the
        slab (exactly as long as needed: decode steps grow them by `step`),
        then in place in the ring, a contiguous run of slots at a time
        (mlx-lm's single-token update, generalised)."""
        total, done = keys.shape[2], 0
        while done < total:
            stored = 0 if self.keys is None else self.keys.shape[2]
            if self._idx == stored < self.max_size:  # not full yet: append
                run = min(total - done, self.max_size - stored)
                new_k, new_v = keys[..., done : done + run, :], values[..., done : done + run, :]
                if self.keys is None:
                    self.keys, self.values = new_k, new_v
                else:
                    self.keys = mx.concatenate([self.keys, new_k], axis=2)
                    self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                if self._idx == self.max_size:
                    self._idx = self.keep
                run = min(total - done, stored - self._idx)
                self.keys[..., self._idx : self._idx + run, :] = keys[..., done : done + run, :]
                self.values[..., self._idx : self._idx + run, :] = values[..., done : done + run, :]
            self._idx += run
            self.offset += run
            done += run

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        if self.keys is None:
            self.write(keys, values)
            return keys, values
        out_k = mx.concatenate([self.keys, keys], axis=2)
        out_v = mx.concatenate([self.values, values], axis=2)
        # Written once copied out: the update reuses the stored buffer in place.
        self.write(*mx.depends([keys, values], [out_k, out_v]))
        return out_k, out_v

    def make_mask(self, N, window_size=None, return_array=False):
        if N == 1:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        return mx.array(self.visible(N, window_size))

    @property
    def dropped(self) -> int:
        """History tokens the window has dropped so far."""
        return max(0, self.offset - self.max_size)


def make_slab(num_layers: int, sink: int, window: int) -> list[SlabCache]:
    # make_prompt_cache(max_kv_size=...) returns unbounded caches for llama
    # (it defines make_cache), so the per-layer caches are built here.
    return [SlabCache(sink + window, keep=sink) for _ in range(num_layers)]


def live_bytes(slab: list[SlabCache]) -> int:
    """Bytes the cache's arrays really hold now (not a formula)."""
    return sum(layer.nbytes for layer in slab)


class SlabPool:
    """A fixed number of slab slots; a session holds one from open to close."""

    def __init__(self, slabs: int):
        self.total = slabs
        self.used = 0

    @property
    def free(self) -> int:
        return self.total - self.used

    def take(self) -> bool:
        if self.used >= self.total:
            return False
        self.used += 1
        return True

    def give_back(self) -> None:
        self.used -= 1
