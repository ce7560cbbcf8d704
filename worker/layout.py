"""How a model is split over a worker group's ranks (worker/group.py):
each rank's range of layers (`Layout`), the share a rank loads (`Part`,
which worker/model.py's loader keeps, the rest never read), and every
layer's window, which the split keeps whole."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache, RotatingKVCache


@dataclass(frozen=True)
class Layout:
    """How a worker splits its model: the layer range each rank holds."""

    spans: tuple[tuple[int, int], ...]

    @classmethod
    def even(cls, layers: int, ranks: int) -> Layout:
        if not 1 <= ranks <= layers:
            raise ValueError(f"--pipeline {ranks}: the model has {layers} layers, one rank needs one at least")
        bounds = [layers * r // ranks for r in range(ranks + 1)]
        return cls(tuple(itertools.pairwise(bounds)))

    @property
    def ranks(self) -> int:
        return len(self.spans)

    def __str__(self) -> str:
        """What a record notes: "" for one process, else each rank's layers."""
        if self.ranks == 1:
            return ""
        return f"pipeline {self.ranks}: layers " + " | ".join(f"{a}-{b - 1}" for a, b in self.spans)


def layer_windows(model: nn.Module) -> list[int | None]:
    """Per layer, the window mlx-lm's own cache for the model bounds it to
    (a RotatingKVCache; a KVCache keeps everything). A model whose layers
    cache anything else (a recurrent state) has no place in a slab."""
    if not hasattr(model, "make_cache"):
        return [None] * len(model.layers)
    windows = []
    for cache in model.make_cache():
        if type(cache) is RotatingKVCache:
            windows.append(cache.max_size)
        elif type(cache) is KVCache:
            windows.append(None)
        else:
            raise ValueError(f"{type(model).__module__}: its layers keep a {type(cache).__name__}, not a KV cache")
    return windows


@dataclass
class Part:
    """The share of a model rank `rank` of a worker group of `ranks` holds:
    its range of layers (`layout`, set by `keep`), and the embedding and
    head where it is rank 0."""

    rank: int
    ranks: int
    layout: Layout | None = None  # set by `keep`, as `windows`: every layer's (`layer_windows`)
    windows: list[int | None] | None = None

    def keep(self, model: nn.Module, weights: dict[str, mx.array] | None = None) -> dict[str, mx.array] | None:
        """Drop the rest from `model` and from `weights` (its tensors by
        parameter name, not loaded yet), before anything is read or
        dequantized; the layers renumbered from 0."""
        self.layout = Layout.even(len(model.model.layers), self.ranks)
        self.windows = layer_windows(model)
        start, stop = self.layout.spans[self.rank]
        model.model.layers = model.model.layers[start:stop]
        if self.rank:
            model.model.pop("embed_tokens")
            if "lm_head" in model:
                model.pop("lm_head")
        if weights is None:
            return None
        kept = {}
        for name, array in weights.items():
            if name.startswith("model.layers."):
                index, rest = name[len("model.layers.") :].split(".", 1)
                if start <= int(index) < stop:
                    kept[f"model.layers.{int(index) - start}.{rest}"] = array
            elif not self.rank or not name.startswith(("model.embed_tokens.", "lm_head.")):
                kept[name] = array
        return kept
