"""KV slabs: one bounded cache per session (StreamingLLM: `sink` tokens kept
forever plus the last `window`), and the fixed pool they come from."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache


class SlabCache(RotatingKVCache):
    """mlx-lm's RotatingKVCache, with one attention rule for every token: a
    query at position P sees the sink and the last `window` positions up to
    P, itself included, whether its token came alone, inside a prefill chunk
    or inside a speculative verify pass.

    The ring holds `spare` slots more than the window: a verify pass writes
    its k drafted tokens before it knows how many the model accepts, and the
    rejected ones are taken back (`rewind`) without having overwritten any
    position a later query can see (llama.cpp sizes its sliding-window cache
    at window + batch for the same reason). mlx-lm's cache cannot be trimmed
    once it has wrapped; this one can, by up to `spare` tokens.

    Tokens are written into the ring in place (`write`); the arrays grow by
    `step` slots while the slab is not full, so `kv_live_bytes` is what a
    session really holds. worker/attention.py reads the slots where they
    are, masked by the position each holds (`positions`).
    """

    def __init__(self, sink: int, window: int, spare: int = 0):
        super().__init__(sink + window + spare, keep=sink)
        self.window = window
        self.spare = spare
        # Arrays grow by `step` slots: mlx-lm's 256, but at most an eighth of
        # the slab, so a small slab also grows as it fills.
        self.step = max(16, min(256, self.max_size // 8))

    @property
    def ring(self) -> int:
        """Slots after the sink: the window and the spare room."""
        return self.max_size - self.keep

    def positions(self, slots: int | None = None, ahead: int = 0) -> np.ndarray:
        """The position each of the first `slots` stored slots holds (-1: not
        written yet), once `ahead` more tokens are written."""
        slots = self.keys.shape[2] if slots is None else slots
        offset, idx = self.offset + ahead, self._idx
        while ahead:  # write()'s walk through the ring, without the arrays
            if idx == self.max_size:
                idx = self.keep
            run = min(ahead, self.max_size - idx)
            idx += run
            ahead -= run
        slot = np.arange(slots)
        if idx == offset:  # not wrapped: slot i holds position i
            return np.where(slot < offset, slot, -1)
        # Wrapped: the sink, then a ring whose newest entry sits just before
        # _idx (mlx-lm's convention, whatever chunking led here).
        back = (idx - 1 - slot) % self.ring
        return np.where(slot < self.keep, slot, offset - 1 - back)

    def visible(self, n: int, window: int | None = None) -> np.ndarray:
        """(n, stored slots + n) bool: what each of `n` new tokens may see of
        the slab as it stands followed by the new tokens themselves."""
        query = self.offset + np.arange(n)
        key = query if self.keys is None else np.concatenate([self.positions(), query])
        return self.sees(query, key, window)

    def sees(self, query: np.ndarray, key: np.ndarray, window: int | None = None) -> np.ndarray:
        """(queries, keys) bool: whether a query at each position sees a key
        at each position (-1: an empty slot)."""
        window = min(self.window, window or self.window)
        q, k = query[:, None], key[None, :]
        return (k >= 0) & (k <= q) & ((k < self.keep) | (k > q - window))

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Store new tokens in place, a contiguous run of slots at a time
        (mlx-lm's single-token update, generalised), growing the arrays as
        needed until the slab is full, then wrapping after the sink."""
        for slot, done, run in self._claim(keys.shape[2], keys):
            self.keys[..., slot : slot + run, :] = keys[..., done : done + run, :]
            self.values[..., slot : slot + run, :] = values[..., done : done + run, :]

    def claim(self, total: int, like: mx.array, dtype: mx.Dtype) -> list[tuple[int, int, int]]:
        """The runs (slot, first token, run) `total` new tokens like `like`
        (1, kv heads, tokens, D) go to, the arrays grown for them (in
        `dtype`) and the positions advanced past them: for a writer of its
        own (kvmux_native's attend), which gives the arrays back updated."""
        return list(self._claim(total, like, dtype))

    def _claim(self, total: int, like: mx.array, dtype: mx.Dtype | None = None):
        """The runs of slots `total` new tokens go to, as (slot, first token,
        run): each run's slots reserved before it is yielded, the positions
        advanced past it after."""
        done = 0
        while done < total:
            if self._idx == self.max_size:
                self._idx = self.keep
            run = min(total - done, self.max_size - self._idx)
            self._reserve(self._idx + run, like, dtype)
            yield self._idx, done, run
            self._idx += run
            self.offset += run
            done += run

    def _reserve(self, slots: int, like: mx.array, dtype: mx.Dtype | None) -> None:
        """Grow the arrays to hold `slots` slots, by whole `step`s (at most
        to the slab's size), in `dtype` (None: like's): a token at a time
        would copy them every step."""
        stored = 0 if self.keys is None else self.keys.shape[2]
        if slots <= stored:
            return
        grown = min(self.max_size, stored + -(-(slots - stored) // self.step) * self.step)
        shape = (like.shape[0], like.shape[1], grown - stored, like.shape[3])
        dtype = dtype or like.dtype
        new_k, new_v = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def can_rewind(self, n: int) -> bool:
        """Whether the newest `n` tokens can be taken back: they overwrote
        nothing a later query sees (the ring has not wrapped yet, or they fit
        in its spare slots)."""
        return n <= self.offset and (n <= self.spare or self.offset <= self.max_size)

    def rewind(self, n: int) -> None:
        """Take back the newest `n` tokens (a verify pass's rejected drafts,
        a stop inside its accepted run, a rewound turn). Their slots stay as
        they are and are overwritten next; none of them can be seen by a
        later query."""
        if not self.can_rewind(n):
            raise ValueError(f"cannot take back {n} tokens: the slab has {self.spare} spare slots")
        wrapped = self.offset > self._idx
        self.offset -= n
        self._idx -= n
        if wrapped and self._idx <= self.keep:
            self._idx += self.ring  # back across the wrap: the newest entry is at the ring's end

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
    def cached(self) -> int:
        """History tokens the window still holds."""
        return min(self.offset, self.keep + self.window)

    @property
    def dropped(self) -> int:
        """History tokens the window has dropped so far."""
        return max(0, self.offset - self.keep - self.window)


def make_slab(windows: list[int | None], sink: int, window: int, spare: int = 0) -> list[SlabCache]:
    """A cache per layer: the session's sink and window; a layer the model
    bounds to a sliding window of its own (`windows`: mlx-lm's make_cache
    gives it a RotatingKVCache) keeps that window alone, within the
    session's, and no sink: the model never attends past its window there."""
    return [SlabCache(sink, window, spare) if w is None else SlabCache(0, min(w, window), spare) for w in windows]


def widest(slab: list[SlabCache]) -> SlabCache:
    """The layer holding the session's whole view (its sink and window): the
    one that tells what the session holds and has dropped."""
    return max(slab, key=lambda layer: layer.max_size)


def rewind(slab: list[SlabCache], n: int) -> None:
    """Take the newest `n` tokens back out of every layer."""
    if n:
        for layer in slab:
            layer.rewind(n)


def copy_slab(slab: list[SlabCache]) -> list[SlabCache]:
    """A copy that shares no array with `slab` (a slab is updated in place)."""
    twins = []
    for layer in slab:
        twin = copy.copy(layer)
        if layer.keys is not None:
            twin.keys, twin.values = mx.array(layer.keys), mx.array(layer.values)
        twins.append(twin)
    return twins


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
