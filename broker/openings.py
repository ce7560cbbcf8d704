"""Where each opening was last placed: a new session that opens as an
earlier one did (the same system prompt, tools, template options and
window) goes to that session's worker when it has a free slab, where the
worker's shared prefixes (worker/prefixes.py) hold that opening in memory
(a copy, not a read from the store). The broker never tokenizes: an
opening is named by the fields that render it, as a fork is placed by its
session's worker."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import msgspec

from kvmux.protocol import OpenSession, PrefixMode

from .registry import WorkerEntry

REMEMBERED = 4096  # openings, least recently placed forgotten first


class Openings:
    def __init__(self) -> None:
        self._placed: OrderedDict[str, WorkerEntry] = OrderedDict()

    @staticmethod
    def key(request: OpenSession) -> str | None:
        """The opening's name; None for one that shares nothing (a fork, no
        system prompt or tools, or `prefix` off)."""
        if request.fork is not None or request.prefix == PrefixMode.OFF or not (request.system or request.tools):
            return None
        fields = [request.system, request.tools, request.chat_template_kwargs, request.sink, request.window]
        return hashlib.sha256(msgspec.msgpack.encode(fields)).hexdigest()

    def worker(self, key: str | None) -> WorkerEntry | None:
        """The worker the opening was last placed on (the registry checks
        that it is still there, with a free slab)."""
        return self._placed.get(key) if key else None

    def placed(self, key: str | None, worker: WorkerEntry) -> None:
        if key:
            self._placed[key] = worker
            self._placed.move_to_end(key)
            while len(self._placed) > REMEMBERED:
                self._placed.popitem(last=False)
