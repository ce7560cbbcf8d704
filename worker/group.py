"""A worker group: one worker made of N MLX processes (ranks) over
`mx.distributed`, the model's layers split into N consecutive ranges
(pipeline stages), so that a model larger than one machine's memory is
served by several.

Rank 0 is the worker the broker sees: its socket, heartbeats, scheduler,
sampling, the embedding, the first layers, the final norm and the head.
The other ranks hold the later layers and their part of every session's
slab, and follow rank 0's plan for each pass (`follow`): a pass's residual
stream goes from rank to rank and its last rank sends the wanted rows back.

Rank 0 keeps the later layers' caches as `RemoteCache`s: their positions
without arrays. Every pass carries them, so a rank's slab follows whatever
rank 0 did (a rewind, a verify pass taken back) without being told; only
what moves arrays is a plan of its own: a fork's copy, a snapshot saved or
loaded, a slab freed. Plans and arrays go over `mx.distributed`'s send and
recv, each rank passing a plan on to the next; a plan that needs an answer
(a snapshot) is answered by the last rank, with every rank's errors.

Launch: `mlx.launch` (or `kvmux serve --pipeline N`, which sets the same
environment: MLX_RANK and MLX_HOSTFILE for the ring backend) runs
`kvmux worker --pipeline N` once per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref

import mlx.core as mx
import msgspec
import numpy as np

from kvmux import logs
from kvmux.sessions import SessionStore, StoreError, open_store
from kvmux.sessions.snapshot import part_name

from .forward import Floors, Segment, run_layers, supported
from .layout import Layout, Part
from .model import load
from .slab import SlabCache, copy_slab, make_slab

log = logs.get("worker.group")


def join(ranks: int) -> mx.distributed.Group:
    """This process's group (MLX_RANK and MLX_HOSTFILE from mlx.launch or
    kvmux serve); raises ValueError when it is not a group of `ranks`."""
    try:
        group = mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as exc:
        raise ValueError(f"--pipeline {ranks}: no ring group to join ({exc}); launch with mlx.launch") from None
    if group.size() != ranks:
        raise ValueError(f"--pipeline {ranks}: the group launched has {group.size()} ranks")
    return group


# ---------------------------------------------------------------- plans


class _Plan(msgspec.Struct, tag=True, kw_only=True):
    freed: list[int] = []  # slabs rank 0 let go of since its last plan


class Pass(_Plan, kw_only=True):
    """Run the stream through your layers. Per segment: its slab (handle,
    sink, window, spare), tokens, whether its rows are all wanted, and the
    positions (offset, idx) of every later rank's layer cache before the
    pass."""

    segments: list[tuple[int, int, int, int, int, bool, list[tuple[int, int]]]]
    floors: dict[str, int | bool]
    wanted: list[int]


class _SlabPlan(_Plan, kw_only=True):
    handle: int
    shape: tuple[int, int, int]  # the session's sink, window and spare slots


class Copy(_SlabPlan, kw_only=True):
    source: int


class Save(_SlabPlan, kw_only=True):
    session_id: str
    name: str  # rank 0's snapshot: each rank writes its part beside it


class Load(_SlabPlan, kw_only=True):
    session_id: str
    name: str


class Stop(_Plan, kw_only=True):
    pass


class Answer(msgspec.Struct):
    errors: list[str]


_plans = msgspec.msgpack.Decoder(Pass | Copy | Save | Load | Stop)
_answers = msgspec.msgpack.Decoder(Answer)
_encode = msgspec.msgpack.Encoder().encode


class _Link:
    """Messages and arrays to and from the group's other ranks, counting
    the bytes this rank sends and receives."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.sent = self.received = 0

    @property
    def bytes(self) -> int:
        return self.sent + self.received

    def send(self, array: mx.array, to: int) -> None:
        mx.eval(mx.distributed.send(array, to, group=self.group))
        self.sent += array.nbytes

    def recv(self, shape: tuple[int, ...], dtype: mx.Dtype, source: int) -> mx.array:
        array = mx.distributed.recv(shape, dtype, source, group=self.group)
        mx.eval(array)
        self.received += array.nbytes
        return array

    def send_bytes(self, data: bytes, to: int) -> None:
        array = np.frombuffer(data, np.uint8)
        self.send(mx.array([array.size], mx.int32), to)
        self.send(mx.array(array), to)

    def send_message(self, message: msgspec.Struct, to: int) -> None:
        self.send_bytes(_encode(message), to)

    def recv_message(self, source: int) -> bytes:
        size = self.recv((1,), mx.int32, source).item()
        return bytes(np.array(self.recv((size,), mx.uint8, source)))


# ---------------------------------------------------------------- rank 0


class _Held:
    """The handle of a slab's part on the other ranks: freed there once no
    cache of rank 0 refers to it."""

    def __init__(self, stages: Stages, sink: int, window: int, spare: int):
        self.id = stages.next_handle
        stages.next_handle += 1
        self.shape = (sink, window, spare)  # the session's slab: its part there is made alike
        weakref.finalize(self, stages.freed.append, self.id)


class RemoteCache(SlabCache):
    """A layer cache another rank holds: its positions kept here as that
    rank's advance (the same walk through the ring), and the slots that
    rank's arrays have grown to, for `nbytes`; no arrays."""

    def __init__(self, sink: int, window: int, spare: int, held: _Held, stages: Stages, slot_bytes: int):
        super().__init__(sink, window, spare)
        self.held, self.stages = held, stages
        self.slot_bytes = slot_bytes  # keys and values of one slot
        self.stored = 0

    def _reserve(self, slots: int, like, dtype) -> None:
        if slots > self.stored:
            self.stored = min(self.max_size, self.stored + -(-(slots - self.stored) // self.step) * self.step)

    def advance(self, n: int) -> None:
        for _ in self._claim(n, None):
            pass

    @property
    def nbytes(self) -> int:
        return self.stored * self.slot_bytes


class Stages:
    """Rank 0's side: the later ranks' part of each slab, and the hop of a
    pass through them."""

    def __init__(self, group: mx.distributed.Group, layout: Layout, windows: list[int | None], slot_bytes: int):
        self.link = _Link(group)
        self.layout = layout
        self.windows = windows  # every layer's
        self.held_layers = layout.spans[0][1]
        self.slot_bytes = slot_bytes
        self.next_handle = 1
        self.freed: list[int] = []
        self.inflight: list[mx.array] = []  # rows of passes sent, not received yet (`overlapped`)
        self.overlapping = False

    def remote(self, sink: int, window: int, spare: int) -> list[RemoteCache]:
        """The later layers' caches of a new slab."""
        held = _Held(self, sink, window, spare)
        return [
            RemoteCache(cache.keep, cache.window, spare, held, self, self.slot_bytes)
            for cache in make_slab(self.windows[self.held_layers :], sink, window, spare)
        ]

    def _plan(self, plan: _Plan) -> None:
        plan.freed = list(self.freed)
        self.freed.clear()  # in place: the finalizers append to this list
        self.link.send_message(plan, 1)

    def _check(self, what: str, error: type[Exception]) -> None:
        """The last rank's answer to a slab plan: every rank's errors."""
        errors = _answers.decode(self.link.recv_message(self.link.size - 1)).errors
        if errors:
            raise error(f"{what}: {'; '.join(errors)}")

    def run(self, h: mx.array, segments: list[Segment], lengths: list[int], floors: Floors, wanted: list[int]):
        """The rows `wanted` of the stream after every layer: `h` (after
        rank 0's layers) sent on, the rows received from the last rank."""
        plan = Pass(
            segments=[
                (s.slab[-1].held.id, *s.slab[-1].held.shape, n, s.rows, [(c.offset, c._idx) for c in _later(s)])
                for s, n in zip(segments, lengths, strict=True)
            ],
            floors=dataclasses.asdict(floors),
            wanted=wanted,
        )
        self._plan(plan)
        self.link.send(h, 1)
        for s, n in zip(segments, lengths, strict=True):
            for cache in _later(s):
                cache.advance(n)
        rows = mx.distributed.recv((1, len(wanted), h.shape[-1]), h.dtype, self.link.size - 1, group=self.link.group)
        self.inflight.append(rows)
        if not self.overlapping:
            self.settle()
        return rows

    @contextlib.contextmanager
    def overlapped(self):
        """Passes run inside do not wait for the last rank's rows: rank 0
        runs the next pass's layers while the other ranks run this one's.
        Their rows are received on the way out."""
        self.overlapping = True
        try:
            yield
        finally:
            self.overlapping = False
            self.settle()

    def settle(self) -> None:
        """Receive the rows of the passes in flight in the order they were
        sent: a recv takes whatever the link holds next."""
        for rows in self.inflight:
            mx.eval(rows)
            self.link.received += rows.nbytes
        self.inflight = []

    def copy(self, slab: list[SlabCache]) -> list[RemoteCache]:
        """A copy of `slab`'s later layers (a fork's), made on their ranks."""
        source = slab[-1]
        twins = self.remote(*source.held.shape)
        for twin, cache in zip(twins, slab[self.held_layers :], strict=True):
            twin.offset, twin._idx, twin.stored = cache.offset, cache._idx, cache.stored
        self._plan(Copy(handle=twins[0].held.id, shape=source.held.shape, source=source.held.id))
        self._check(f"copying slab {source.held.id}", StoreError)
        return twins

    def save(self, slab: list[SlabCache], session_id: str, name: str) -> None:
        """Every later rank writes its part of the snapshot `name`."""
        held = slab[-1].held
        self._plan(Save(handle=held.id, shape=held.shape, session_id=session_id, name=name))
        self._check(f"slab snapshot {name}", StoreError)

    def load(self, slab: list[SlabCache], session_id: str, name: str) -> None:
        """Every later rank fills its part of `slab` from snapshot `name`;
        raises ValueError when one cannot."""
        held = slab[-1].held
        self._plan(Load(handle=held.id, shape=held.shape, session_id=session_id, name=name))
        self._check(f"slab snapshot {name}", ValueError)

    def stop(self) -> None:
        self._plan(Stop())


def _later(segment: Segment) -> list[RemoteCache]:
    held = segment.slab[-1].stages.held_layers
    return segment.slab[held:]


class GroupStore:
    """Rank 0's session store: snapshots written and read by every rank,
    each its own part of the slab; the rest is the store's."""

    def __init__(self, store: SessionStore, stages: Stages):
        self.store, self.stages = store, stages

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def save_snapshot(self, session_id: str, slab: list, logits) -> tuple[str, int]:
        name, size = self.store.save_snapshot(session_id, slab, logits)
        self.stages.save(slab, session_id, name)
        return name, size

    def load_snapshot(self, session_id: str, name: str, slab: list):
        slab, logits = self.store.load_snapshot(session_id, name, slab)
        self.stages.load(slab, session_id, name)
        return slab, logits


# ---------------------------------------------------------------- ranks 1..


def follower(config, group: mx.distributed.Group) -> int:
    """A later rank of `kvmux worker --pipeline N`: load its share of the
    model, then `follow`. Returns the exit code (2: the model refused)."""
    mx.set_default_stream(mx.new_stream(mx.default_device()))  # as rank 0's compute thread does
    part = Part(group.rank(), group.size())
    try:
        loaded = load(
            config.model,
            chat_template=config.chat_template,
            part=part,
            kernel=config.cpu_kernel,
            products=config.cpu_products,
        )
        check_supported(loaded.model)
    except (OSError, ValueError) as exc:
        log.error("model_refused", error=str(exc))
        return 2
    return follow(group, loaded.model, loaded.windows, part.layout, open_store(config.store, config.state_dir))


def check_supported(model) -> None:
    """A group runs shared passes (worker/forward.py): refuse a model they do not run."""
    if not supported(model):
        raise ValueError(f"{type(model).__module__}: a worker group runs llama, qwen2, qwen3 and gemma3 models only")


def follow(group: mx.distributed.Group, model, windows: list[int | None], layout: Layout, store: SessionStore) -> int:
    """A later rank's life: run its layers for every plan from rank 0 (each
    passed on to the next rank first), until Stop. Returns the exit code."""
    link = _Link(group)
    rank, last = link.rank, link.rank == link.size - 1
    start, stop = layout.spans[rank]
    first_remote = layout.spans[0][1]
    mine = slice(start - first_remote, stop - first_remote)  # this rank's layers among rank 0's RemoteCaches
    windows = windows[start:stop]
    slabs: dict[int, list[SlabCache]] = {}
    log.info("group_rank_ready", rank=rank, layers=f"{start}-{stop - 1}", pid=os.getpid())
    while True:
        data = link.recv_message(rank - 1)
        if not last:
            link.send_bytes(data, rank + 1)
        plan = _plans.decode(data)
        for handle in plan.freed:
            slabs.pop(handle, None)
        if isinstance(plan, Stop):
            log.info("group_rank_stopped", rank=rank)
            return 0
        if not isinstance(plan, Pass):
            errors = _slab_plan(plan, slabs, windows, store, rank)
            if rank > 1:  # the ranks before this one answered first, on the same link as the plan
                errors = _answers.decode(link.recv_message(rank - 1)).errors + errors
            link.send_message(Answer(errors), 0 if last else rank + 1)
            continue
        segments, lengths = [], []
        for handle, sink, window, spare, n, rows, positions in plan.segments:
            slab = slabs.get(handle)
            if slab is None:
                slab = slabs[handle] = make_slab(windows, sink, window, spare)
            for cache, (offset, idx) in zip(slab, positions[mine], strict=True):
                cache.offset, cache._idx = offset, idx
            segments.append(Segment(None, slab, rows))
            lengths.append(n)
        h = link.recv((1, sum(lengths), model.args.hidden_size), model.model.norm.weight.dtype, rank - 1)
        h = run_layers(model, h, segments, lengths, Floors(**plan.floors))
        link.send(h[:, mx.array(plan.wanted)] if last else h, 0 if last else rank + 1)


def _slab_plan(plan: Copy | Save | Load, slabs: dict[int, list[SlabCache]], windows, store: SessionStore, rank: int):
    """Carry out a plan that moves a slab's arrays; the errors, for rank 0.
    A slab no pass has reached yet is empty here (a pass makes it)."""

    def slab(handle: int) -> list[SlabCache]:
        return slabs.get(handle) or make_slab(windows, *plan.shape)

    try:
        if isinstance(plan, Copy):
            slabs[plan.handle] = copy_slab(slab(plan.source))
        elif isinstance(plan, Save):
            store.save_snapshot(plan.session_id, slab(plan.handle), None, name=part_name(plan.name, rank))
        else:
            empty = make_slab(windows, *plan.shape)
            slabs[plan.handle] = store.load_snapshot(plan.session_id, part_name(plan.name, rank), empty)[0]
    except (ValueError, OSError, StoreError) as exc:
        log.error("group_slab_plan_failed", rank=rank, plan=type(plan).__name__, error=str(exc))
        return [f"rank {rank}: {type(exc).__name__}: {exc}"]
    return []
