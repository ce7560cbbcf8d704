"""Shared prefixes on the worker: a new session whose opening starts with
tokens some earlier session computed takes their KV instead of prefilling
them, and prefills only the rest.

Keys. A session's opening (its first prefill: system prompt, tools, the
messages it is opened with) is cut into blocks of `block` tokens, and each
block boundary is named by a hash chain (vLLM's block hashes): k_i =
sha256(k_{i-1}, the block's token ids), k_0 the seed, which holds what else
makes the KV the same: the model's digest (not its name), the slab's
geometry (sink, window, spare slots), the kernel family (float32 copies
round otherwise) and the layout. The longest stored key is the longest
shared prefix. A prefix never ends on the opening's last token (the rest
must give the logits) and never past the smallest ring of the slab's
layers (sink + window, a sliding layer's own window): past it the ring has
wrapped, and the positions it overwrote cannot be taken back.

Exactness. In batch-invariant mode a block is the prefill chunk
(EXACT_BLOCK) and an opening's chunks never cross a block boundary
(Engine.prefill's `block`), so a session that takes k blocks prefills the
rest in the very chunks a cold one runs after them: on an idle worker its
tokens are the cold session's bit for bit. Otherwise blocks are finer
(FINE_BLOCK: less of the opening is prefilled again), the rest's chunks
start elsewhere than a cold session's, and the default mode's guarantee
holds: the same tokens, or a parting at a near tie (docs/design.md). Where
other sessions decode, chunks shrink (worker/pace.py) in a cold session
too, and that guarantee is what either mode gives.

When. Every opening of a block or more is kept here, in memory, as
a copy of its slab at its last block boundary (a candidate). An opening
that shares at least `min_tokens` with an earlier one (seen a second
time) takes the shared blocks from that copy, and they are written to the
store (kvmux/sessions/prefixes.py) for every worker that reads it and for
the next start. `OpenSession.prefix` "pin" writes the opening's prefix at
once, pinned; "off" neither takes nor keeps one (a cold reference).
A session's record never depends on a prefix: its first chunks are noted
as the cold prefill's (`replay`), so a restore without a snapshot of its
own runs them again.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import msgspec

from kvmux import logs
from kvmux import protocol as p
from kvmux.sessions import StoreError, snapshot
from kvmux.sessions.prefixes import PrefixStore

from .engine import PREFILL_CHUNK, Engine, LiveSession
from .slab import SlabCache, copy_slab, live_bytes

log = logs.get("worker.prefixes")

EXACT_BLOCK = PREFILL_CHUNK  # tokens per key in batch-invariant mode: prefixes end where cold chunks do
FINE_BLOCK = 16  # tokens per key otherwise: less of an opening left to prefill after its prefix
SEEN = 4096  # block keys of earlier openings remembered (a second sighting is a hit)


@dataclass
class Held:
    """A slab copy in memory holding an opening's first `tokens` tokens,
    never fed further: each of its block boundaries is a prefix."""

    slab: list[SlabCache]
    tokens: int
    bytes: int
    stored: set[str] = field(default_factory=set)  # its keys the store holds (indexed)


@dataclass
class Opening:
    """A fresh session's first prefill, as prefixes see it."""

    keys: list[str]  # a key per whole block that may be a prefix, shortest first
    block: int  # tokens per key
    taken: int = 0  # blocks restored from a prefix
    pin: bool = False

    @property
    def cached(self) -> int:
        """Tokens restored instead of prefilled."""
        return self.taken * self.block

    @property
    def end(self) -> int:
        """Where its prefill reaches the last block boundary (capture)."""
        return len(self.keys) * self.block


class Prefixes:
    def __init__(
        self,
        engine: Engine,
        store: PrefixStore | None,
        min_tokens: int,
        memory_bytes: int,
        digest: str,
        exact: bool = False,
    ):
        """`store`: where prefixes are shared (None: in memory only);
        `min_tokens`: the shortest shared prefix kept automatically (0:
        only pinned ones); `memory_bytes`: the budget of copies held here;
        `exact`: batch-invariant mode (a hit prefills the rest in a cold
        session's chunks: EXACT_BLOCK, aligned)."""
        self.engine = engine
        self.block = EXACT_BLOCK if exact else FINE_BLOCK
        self.aligned = self.block if exact else 0  # Engine.prefill's `block` for an opening
        self.store = store
        self.min_tokens = min_tokens
        self.memory_bytes = memory_bytes
        loaded = engine.loaded
        family = "kernel" if loaded.kernel.isa is not None else "float32"
        self.identity = f"kvmux-prefix-1|{digest}|{loaded.layout}|{family}|{self.block}"
        self.hot: OrderedDict[str, tuple[Held, int]] = OrderedDict()  # key -> copy, and its tokens there
        self.copies: dict[int, Held] = {}  # the copies `hot` names, by id
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.writes: list[tuple[list[str], Held, bool]] = []  # (keys, copy, pinned): written after the request
        self.counts = p.PrefixCounts()  # `bytes` is counted when reported

    # ------------------------------------------------------------ keys

    def keys(self, session: LiveSession, tokens: list[int]) -> list[str]:
        """The key of each whole block of `tokens` that may be a prefix."""
        ring = min(layer.keep + layer.window for layer in session.slab)
        block = self.block
        blocks = min(len(tokens) - 1, ring) // block
        seed = f"{self.identity}|{session.sink}|{session.window}|{self.engine.spare}"
        h, out = hashlib.sha256(seed.encode()).digest(), []
        for i in range(blocks):
            digest = hashlib.sha256(h)
            digest.update(b"".join(t.to_bytes(4, "little") for t in tokens[i * block : (i + 1) * block]))
            h = digest.digest()
            out.append(h.hex()[:32])
        return out

    # ------------------------------------------------------------ an opening

    def open(self, session: LiveSession, mode: str) -> Opening | None:
        """Before a fresh session's first prefill: restore the longest
        prefix of its pending tokens held here or stored, and say what its
        prefill should keep (None: nothing to do)."""
        if mode == p.PrefixMode.OFF or (self.store is None and not self.memory_bytes):
            return None
        keys = self.keys(session, session.pending)
        if not keys:
            return None
        opening = Opening(keys, self.block, pin=mode == p.PrefixMode.PIN)
        taken, held = self._hot(keys) or self._stored(session, keys) or (0, None)
        if not taken:
            if opening.end >= max(self.min_tokens, self.block):
                self.counts.misses += 1
            return opening
        opening.taken = taken
        tokens = opening.cached
        session.slab = trimmed(held.slab, tokens)
        session.history = session.pending[:tokens]
        del session.pending[:tokens]
        # A cold prefill's chunks: a restore without a snapshot of its own runs them again.
        session.replay = [PREFILL_CHUNK] * (tokens // PREFILL_CHUNK) + (
            [tokens % PREFILL_CHUNK] if tokens % PREFILL_CHUNK else []
        )
        self.counts.hits += 1
        self.counts.tokens += tokens
        shared = keys[:taken]
        if self.store is not None and (shared[-1] not in held.stored or (opening.pin and taken == len(keys))):
            self.writes.append((shared, held, opening.pin))  # seen a second time (or pinned): share it
        log.info("prefix_hit", session=session.session_id, tokens=tokens)
        return opening

    def _hot(self, keys: list[str]) -> tuple[int, Held] | None:
        """The longest prefix held here: (blocks, copy)."""
        for k in range(len(keys), 0, -1):
            found = self.hot.get(keys[k - 1])
            if found is None:
                continue
            held, _ = found
            if k * self.block < self.min_tokens and keys[k - 1] not in held.stored:
                return None  # shares too little with another opening to be kept: cold
            self.hot.move_to_end(keys[k - 1])
            return k, held
        return None

    def _stored(self, session: LiveSession, keys: list[str]) -> tuple[int, Held] | None:
        """The longest prefix in the store, held here from now on: (blocks,
        copy); None when none is, or the one found failed its checks (and
        was dropped)."""
        if self.store is None:
            return None
        found = self.store.find(keys)
        if found is None:
            return None
        k, blob = found
        read = self.store.get(blob)
        if read is None:
            return None
        tokens, payload = read
        try:
            if tokens < k * self.block or tokens % self.block:
                raise ValueError(f"holds {tokens} tokens, where {k * self.block} were asked for")
            empty = self.engine.make_slab(session.sink, session.window)
            slab, _ = snapshot.from_bytes(payload, f"{blob}.safetensors", empty)
            if any(layer.offset != tokens or layer._idx != tokens for layer in slab):
                raise ValueError("its slab holds other positions")
        except ValueError as exc:
            log.warning("prefix_dropped", key=blob, why=str(exc))
            self.store.drop(blob)
            return None
        held = Held(slab, tokens, live_bytes(slab), stored=set(keys[:k]))
        self._hold(held, keys[:k])
        return k, held

    def capture(self, session: LiveSession, opening: Opening) -> None:
        """The session's prefill reached its opening's last block boundary:
        keep a copy of the slab there; store what an earlier opening
        shares with it (seen a second time), or all of it (pinned)."""
        keys = opening.keys
        held = Held(copy_slab(session.slab), opening.end, live_bytes(session.slab))
        mx.eval([(layer.keys, layer.values) for layer in held.slab])
        if self.store is not None:
            if opening.pin:
                self.writes.append((keys, held, True))
            else:
                later = range(opening.taken + 1, len(keys) + 1)
                shared = max((k for k in later if keys[k - 1] in self.seen), default=0)
                if shared * self.block >= max(self.min_tokens, self.block):
                    self.writes.append((keys[:shared], held, False))
        for key in keys:
            self.seen[key] = None
            self.seen.move_to_end(key)
        while len(self.seen) > SEEN:
            self.seen.popitem(last=False)
        if opening.pin or self.min_tokens:
            self._hold(held, keys)

    def _hold(self, held: Held, keys: list[str]) -> None:
        """Keep `held` for `keys` (its first block boundaries), dropping the
        least recently used copies past the memory budget."""
        if held.bytes > self.memory_bytes:
            return
        for k, key in enumerate(keys, start=1):
            self.hot[key] = (held, k * self.block)
            self.hot.move_to_end(key)
        self.copies[id(held)] = held
        named = {id(h) for h, _ in self.hot.values()}  # a copy whose keys all went to newer ones is gone
        self.copies = {i: h for i, h in self.copies.items() if i in named}
        while self.held_bytes > self.memory_bytes:
            oldest, _ = self.hot[next(iter(self.hot))]
            for key in [key for key, (h, _) in self.hot.items() if h is oldest]:
                del self.hot[key]
            del self.copies[id(oldest)]

    def report(self) -> p.PrefixCounts:
        return msgspec.structs.replace(self.counts, bytes=self.held_bytes)

    @property
    def held_bytes(self) -> int:
        """Bytes of the copies held (reported every round of the loop: a sum over copies, not keys)."""
        return sum(h.bytes for h in self.copies.values())

    # ------------------------------------------------------------ the store

    def flush(self) -> None:
        """Write the prefixes shared since the last call (after a request's
        reply: its tokens do not wait for the store)."""
        writes, self.writes = self.writes, []
        for keys, held, pinned in writes:
            tokens = len(keys) * self.block
            started = time.perf_counter()
            try:
                if keys[-1] in held.stored:
                    if not pinned:
                        continue
                    found = self.store.find(keys)
                    if found is not None and found[0] == len(keys) and self.store.pin(found[1], True):
                        continue  # stored: pinned now
                payload = snapshot.to_bytes(trimmed(held.slab, tokens), None)
                self.store.put(keys, tokens, payload, pinned=pinned)
            except (OSError, ValueError, StoreError) as exc:
                log.warning("prefix_not_stored", key=keys[-1], tokens=tokens, error=str(exc))
                continue
            held.stored.update(keys)
            self.counts.stored += 1
            log.info(
                "prefix_stored",
                key=keys[-1],
                tokens=tokens,
                bytes=len(payload),
                pinned=pinned,
                seconds=round(time.perf_counter() - started, 4),
            )


def trimmed(slab: list[SlabCache], tokens: int) -> list[SlabCache]:
    """A copy of `slab` (not wrapped, holding `tokens` or more) as a cold
    prefill of its first `tokens` tokens leaves it: those positions, in
    arrays of the size its growth steps give them, sharing nothing with
    `slab` (a slab is written in place)."""
    out = []
    for layer in slab:
        twin = copy.copy(layer)
        size = min(layer.max_size, -(-tokens // layer.step) * layer.step)
        twin.keys, twin.values = mx.array(layer.keys[..., :size, :]), mx.array(layer.values[..., :size, :])
        twin.offset = twin._idx = tokens
        out.append(twin)
    mx.eval([(layer.keys, layer.values) for layer in out])
    return out
