"""Where each opening was last placed: a new session that opens as an
earlier one did (the same system prompt, tools, template options and
window) goes to that session's worker, where the worker's shared prefixes
(worker/prefixes.py) hold that opening in memory (a copy, not a read from
the store), as a fork goes to its original's worker. The broker never
tokenizes: an opening is named by the fields that render it, and one too
short to share a prefix (under SHAREABLE characters) is placed by load
alone. Load still wins: the preferred worker is passed over where another
has more than twice its free slabs (a cold prefill there costs less than a
queue here, and a store read gives the prefix all the same)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import msgspec

from kvmux.protocol import OpenSession, PrefixMode

from .registry import WorkerEntry

REMEMBERED = 4096  # openings, least recently placed forgotten first
SHAREABLE = 1024  # characters of system prompt and tools: ~256 tokens, the least worth a prefix


class Openings:
    def __init__(self) -> None:
        self._placed: OrderedDict[str, WorkerEntry] = OrderedDict()

    @staticmethod
    def key(request: OpenSession, model: str | None) -> str | None:
        """The opening's name on `model`; None for one that shares nothing
        (a fork, a short opening, or `prefix` off)."""
        if request.fork is not None or request.prefix == PrefixMode.OFF:
            return None
        fields = msgspec.msgpack.encode(
            [model, request.system, request.tools, request.chat_template_kwargs, request.sink, request.window]
        )
        if len(fields) < SHAREABLE:
            return None
        return hashlib.sha256(fields).hexdigest()

    def worker(self, key: str | None, workers: list[WorkerEntry]) -> WorkerEntry | None:
        """The worker the opening was last placed on, unless another of
        `workers` (its model's) has more than twice its free slabs (the
        registry checks that it is still there, with a free slab)."""
        placed = self._placed.get(key) if key else None
        most = max((w.free_slabs for w in workers if not w.draining), default=0)
        return placed if placed is not None and 2 * placed.free_slabs >= most else None

    def placed(self, key: str | None, worker: WorkerEntry) -> None:
        if key:
            self._placed[key] = worker
            self._placed.move_to_end(key)
            while len(self._placed) > REMEMBERED:
                self._placed.popitem(last=False)
