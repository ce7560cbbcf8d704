"""Slab snapshots: a session's KV arrays and its last logits in one
safetensors file, restored bit for bit.

mlx-lm's save_prompt_cache/load_prompt_cache would fit but for one thing:
load_prompt_cache finds each cache's class by name in mlx-lm's own module,
so our SlabCache subclass cannot come back through it. The arrays and the
rotating buffer's positions are stored as they are (not in temporal order),
so the restored slab is the same buffer and every later step computes
exactly what it would have. A slab is the worker's list of SlabCache
layers (worker/slab.py: mlx-lm's RotatingKVCache with spare slots); this
module reads and sets only the fields they share with it.
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from .files import atomic_file

_SUFFIX = ".safetensors"


def name() -> str:
    """A new snapshot's name: later ones sort after earlier ones."""
    return f"slab-{time.time_ns()}{_SUFFIX}"


def part_name(name: str, rank: int) -> str:
    """The name of a worker group rank's part of snapshot `name` (rank 0's
    part is the snapshot itself)."""
    return name if rank == 0 else f"{name.removesuffix(_SUFFIX)}-rank{rank}{_SUFFIX}"


def whole(name: str) -> str:
    """The snapshot a part belongs to (a snapshot's own name for itself)."""
    stem, _, rank = name.removesuffix(_SUFFIX).rpartition("-rank")
    return f"{stem}{_SUFFIX}" if stem and rank.isdigit() else name


def save(path: Path, slab: list, logits: mx.array | None) -> int:
    """Write the snapshot atomically; returns its size in bytes."""
    arrays, meta = _arrays(slab, logits)
    with atomic_file(path) as tmp:
        mx.save_safetensors(str(tmp), arrays, meta)
    return path.stat().st_size


def to_bytes(slab: list, logits: mx.array | None) -> bytes:
    """A snapshot file's bytes, for a store that is no directory (MLX
    writes safetensors only to a path)."""
    arrays, meta = _arrays(slab, logits)
    with tempfile.TemporaryDirectory(prefix="kvmux-snap-") as tmp:
        path = Path(tmp) / "slab.safetensors"
        mx.save_safetensors(str(path), arrays, meta)
        return path.read_bytes()


def from_bytes(data: bytes, snapshot: str, slab: list) -> tuple[list, mx.array | None]:
    """`load` of a snapshot's bytes (read from memory: no file)."""
    slab, logits = load(io.BytesIO(data), slab, snapshot)
    mx.eval([layer.state for layer in slab], [] if logits is None else logits)
    return slab, logits


def _arrays(slab: list, logits: mx.array | None) -> tuple[dict[str, mx.array], dict[str, str]]:
    arrays: dict[str, mx.array] = {}
    positions = []
    for i, layer in enumerate(slab):
        if layer.keys is not None:
            arrays[f"{i}.keys"], arrays[f"{i}.values"] = layer.keys, layer.values
        positions.append([layer.offset, layer._idx])
    if logits is not None:
        arrays["logits"] = logits
    return arrays, {"positions": json.dumps(positions), "layers": str(len(slab)), "slots": str(slab[0].max_size)}


def load(path: Path | io.BytesIO, slab: list, name: str = "") -> tuple[list, mx.array | None]:
    """`slab` (empty, as the session's settings make it) filled from the
    snapshot at `path` (or in a buffer, called `name`), and the logits
    saved with it; raises ValueError when it does not hold a snapshot of
    that shape."""
    source, name = (path, name) if isinstance(path, io.BytesIO) else (str(path), path.name)
    try:
        arrays, meta = mx.load(source, format="safetensors", return_metadata=True)
        positions = json.loads(meta["positions"])
    except Exception as exc:  # mx.load raises RuntimeError/ValueError on a bad file
        raise ValueError(f"unreadable slab snapshot {name}: {exc}") from None
    if len(positions) != len(slab):
        raise ValueError(f"slab snapshot {name} has {len(positions)} layers, the model {len(slab)}")
    slots = int(meta.get("slots", slab[0].keep + slab[0].window))  # written before slabs had spare slots
    if slots != slab[0].max_size:
        raise ValueError(f"slab snapshot {name} has {slots} slots, this worker's slab {slab[0].max_size}")
    for i, (layer, (offset, idx)) in enumerate(zip(slab, positions, strict=True)):
        if f"{i}.keys" in arrays:
            layer.keys, layer.values = arrays[f"{i}.keys"], arrays[f"{i}.values"]
        layer.offset, layer._idx = offset, idx
    return slab, arrays.get("logits")
