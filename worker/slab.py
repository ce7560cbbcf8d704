"""KV slabs: one bounded cache per session (StreamingLLM: `sink` tokens kept
forever plus the last `window`), and the fixed pool they come from."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache


class SlabCache(RotatingKVCache):
    """mlx-lm's RotatingKVCache, mended where a session cache needs more:

    - A multi-token update past the window returns `max_size + S - 1` keys so
      every new token sees a full window, and the stock cache then *keeps*
      that larger buffer until the next single-token step. Here the stored
      arrays are trimmed back to `max_size` at once: memory stays bounded
      whatever the chunking.
    - The stock mask for a multi-token update past the window hides the sink
      tokens from most of the chunk, while a single-token step sees them.
      Here the sink columns stay visible, as StreamingLLM intends.
    """

    def _update_concat(self, keys, values):
        keys_out, values_out = super()._update_concat(keys, values)
        excess = self.keys.shape[2] - self.max_size
        if excess > 0:
            self.keys = self._trim(excess, self.keys)
            self.values = self._trim(excess, self.values)
            self._idx = self.max_size
        return keys_out, values_out

    def make_mask(self, N, window_size=None, return_array=False):
        mask = super().make_mask(N, window_size=window_size, return_array=return_array)
        if isinstance(mask, mx.array) and N > 1 and self.keep:
            mask = mask | (mx.arange(mask.shape[-1]) < self.keep)
        return mask

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
