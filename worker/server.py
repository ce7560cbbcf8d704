"""The worker's I/O thread: a DEALER to the broker's backend, heartbeats both
ways, and the inproc pipe to the compute thread (worker/control.py says what
flows on it, each way). Socket I/O never waits on MLX (which releases the GIL
while it computes), so heartbeats flow and cancel frames arrive during a long
prefill or decode. Everything this thread knows of the compute thread's state
came over the pipe; it never touches the scheduler or an MLX object.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import threading
import time
from typing import Annotated

import msgspec
import zmq

from kvmux import keys, logs, paths
from kvmux import protocol as p
from kvmux.protocol import Op
from kvmux.sessions import LocalStore, StoreError
from kvmux.settings import AtLeastOne, Count, NonNegative, WorkerSettings, doc

from . import control

log = logs.get("worker")

# Replies are small and the broker drains them at once; a deep send queue
# only hides a stuck broker, which the heartbeat already catches.
SEND_HWM = 10_000


class WorkerConfig(WorkerSettings, kw_only=True, forbid_unknown_fields=True):
    """`kvmux worker`'s settings: WorkerSettings, which `kvmux serve` gives
    its local workers too, then this worker's own."""

    connect: Annotated[
        str,
        doc(
            "Broker backend endpoint (ipc:// or tcp://); several, comma-separated, are tried in turn each time"
            " the broker goes silent (a standby broker on a shared store).",
            "the local daemon's: $KVMUX_BACKEND, else backend.ipc in the runtime dir",
        ),
    ] = ""
    sink: Annotated[Count, doc("Largest attention-sink size a session may ask for (and the default).")] = 4
    window: Annotated[AtLeastOne, doc("Largest sliding window a session may ask for (and the default).")] = 2048
    worker_id: Annotated[str | None, doc("Routing id shown in stats.", "HOST-PID")] = None
    grace_s: Annotated[
        NonNegative, doc("On SIGTERM, how long running generations may finish before they are cancelled.")
    ] = 30.0
    server_key: Annotated[
        str,
        doc("The broker's CURVE public key (z85, or its .key file): connect with CURVE.", envvar="KVMUX_SERVER_KEY"),
    ] = ""
    curve_secret: Annotated[
        str,
        doc(
            "This worker's CURVE secret key: its NAME.key_secret file (the broker's --worker-keys holds NAME.key),"
            " or the z85 key.",
            envvar="KVMUX_CURVE_SECRET",
        ),
    ] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.connect = self.connect or paths.default_backend()


class Worker:
    def __init__(self, config: WorkerConfig, group=None):
        """`group`: the mx.distributed group this worker is rank 0 of
        (`--pipeline N`, worker/group.py), or None."""
        self.config = config
        self.group = group
        self.id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.ctx = zmq.Context.instance()
        self.drain_requested = False  # set by SIGTERM/SIGINT
        self.ready_body = b""  # from the compute thread's LOADED
        self.status = control.Status(free_slabs=config.slabs, running=0, sessions={})  # its last STATUS
        self.broker: zmq.Socket | None = None
        self.pipe: zmq.Socket | None = None
        self.signals: tuple[socket.socket, socket.socket] | None = None  # a signal's wakeup (run)
        self.poller = zmq.Poller()
        self.last_heard = self.next_beat = 0.0
        self.endpoints = [e.strip() for e in config.connect.split(",") if e.strip()]
        self.attempts = 0  # registrations so far: the next one tries the next endpoint
        self.drain_deadline: float | None = None  # set when the drain starts

    # ------------------------------------------------------------ compute

    def _compute(self) -> None:
        """The compute thread's body: load the model, say LOADED (or FAILED),
        serve until STOP. Of `self` it reads only the config and the id."""
        pipe = self.ctx.socket(zmq.PAIR)
        pipe.connect(control.PIPE)
        try:
            import mlx.core as mx

            from kvmux.sessions import open_store

            from .drafter import check_tokenizers
            from .engine import PREFILL_CHUNK, Engine
            from .group import GroupStore, Stages, check_supported
            from .layout import Part
            from .model import load
            from .padding import compute_info
            from .prefixes import Prefixes
            from .scheduler import Scheduler
            from .slab import SlabPool
            from .speculative import MAX_DRAFT

            # MLX streams belong to the thread that made them.
            mx.set_default_stream(mx.new_stream(mx.default_device()))
            part = Part(0, self.group.size()) if self.group else None
            loaded = load(
                self.config.model,
                chat_template=self.config.chat_template,
                part=part,
                kernel=self.config.cpu_kernel,
                products=self.config.cpu_products,
            )
            if part is not None:
                check_supported(loaded.model)
                slot_bytes = loaded.kv_bytes_per_token // len(loaded.windows)
                loaded.stages = Stages(self.group, part.layout, loaded.windows, slot_bytes)
            draft = None
            if self.config.draft_model:
                draft = load(
                    self.config.draft_model,
                    keep_quantized=self.config.draft_quantized or None,
                    kernel=self.config.cpu_kernel,
                    products=self.config.cpu_products,
                )
                check_tokenizers(loaded, draft)
            engine = Engine(
                loaded,
                max_sink=self.config.sink,
                max_window=self.config.window,
                max_tokens_limit=self.config.max_tokens_limit,
                max_append_tokens=self.config.max_append_tokens,
                draft=draft,
                most_rows=self.config.slabs * (MAX_DRAFT + 1) + PREFILL_CHUNK,
                batch_invariant=self.config.batch_invariant,
            )
            store = open_store(self.config.store, self.config.state_dir)
            if loaded.stages:
                store = GroupStore(store, loaded.stages)
            prefixes = None
            if not loaded.stages:  # a group's slabs are split between its ranks: no shared prefixes
                prefixes = Prefixes(
                    engine,
                    store.prefixes(self.config.prefix_store_bytes),
                    self.config.prefix_min_tokens,
                    self.config.prefix_memory_bytes,
                    loaded.digest,
                    exact=self.config.batch_invariant,
                )
            scheduler = Scheduler(
                engine=engine,
                pool=SlabPool(self.config.slabs),
                worker_id=self.id,
                pipe=pipe,
                store=store,
                prefixes=prefixes,
            )
            ready = p.WorkerReady(
                model=loaded.model_id,
                slabs=self.config.slabs,
                slab_bytes=engine.slab_bytes(self.config.sink, self.config.window),
                sink=self.config.sink,
                max_window=self.config.window,
                version=p.PROTOCOL_VERSION,
                pid=os.getpid(),
                host=socket.gethostname(),
                free_slabs=self.config.slabs,
                store=store.store_id,
                compute=compute_info(str(mx.default_device()), engine.padding, str(loaded.layout), loaded.kernel),
            )
            # What loading made lives as long as the process: frozen, the
            # collector never scans it again (~0.1 s a full collection of
            # ~230k objects while serving, ~0.5 s at exit).
            gc.freeze()
            gc.enable()
            pipe.send_multipart([control.LOADED, p.encode(ready)])
            scheduler.run()
            scheduler.save_all()
            if loaded.stages:
                loaded.stages.stop()
        except (OSError, ValueError) as exc:  # a model that cannot be served: the config's to fix
            log.error("model_refused", error=str(exc))
            pipe.send_multipart([control.FAILED, control.REFUSED])
        except BaseException:
            log.exception("compute_failed")
            pipe.send(control.FAILED)
        finally:
            pipe.close(linger=0)

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """Start the compute thread, register once the model is loaded, then
        relay frames until a drain is done: 0; 1 when the compute thread
        failed; 2 when the model (or draft model) was refused at load."""
        self.pipe = self.ctx.socket(zmq.PAIR)
        self.pipe.bind(control.PIPE)
        gc.disable()  # until the model is loaded (_compute): imports run ~15 % faster without collections
        compute = threading.Thread(target=self._compute, name="kvmux-compute", daemon=True)
        compute.start()
        first = self.pipe.recv_multipart()
        if first[0] != control.LOADED:
            compute.join(timeout=10)  # let it let go of MLX: exiting under it aborts the process
            return 2 if first[1:] == [control.REFUSED] else 1
        self.ready_body = first[1]
        signal.signal(signal.SIGTERM, self._request_drain)
        signal.signal(signal.SIGINT, self._request_drain)
        # A signal wakes the poll: pyzmq runs the handler, then resumes a
        # poll that would otherwise see it only at the next heartbeat.
        self.signals = socket.socketpair()  # Python writes a signal's number to [1]
        for end in self.signals:
            end.setblocking(False)
        signal.set_wakeup_fd(self.signals[1].fileno(), warn_on_full_buffer=False)

        self.poller.register(self.pipe, zmq.POLLIN)
        self.poller.register(self.signals[0], zmq.POLLIN)
        self._connect()
        while True:
            events = dict(self.poller.poll(self._poll_ms()))
            now = time.monotonic()
            if self.signals[0] in events:
                with contextlib.suppress(BlockingIOError):
                    self.signals[0].recv(64)  # the handler ran: _tick sees what it asked
            if self.pipe in events and not self._pump_compute():
                return 1
            if self.broker in events:
                self.last_heard = now
                self._pump_broker()
            if self._tick(now):
                break
        self._send_broker(Op.DISCONNECT, p.Disconnect(reason="drained"))
        log.info("worker_drained")
        self.pipe.send(control.STOP)
        compute.join(timeout=120)  # it snapshots the sessions a restart would replay
        self.broker.close()
        self.pipe.close(linger=0)
        return 0

    def _tick(self, now: float) -> bool:
        """Timers: broker liveness, our heartbeat, the drain. True once the
        drain is done."""
        self._check_broker_alive(now)
        self._beat(now)
        if self.drain_requested and self.drain_deadline is None:
            self._start_drain(now)
        return self.drain_deadline is not None and self._drain_done(now)

    def _poll_ms(self) -> int:
        """Until the next timer; a frame from either side wakes the poll sooner."""
        wake = self.next_beat if self.drain_deadline is None else min(self.next_beat, self.drain_deadline)
        return max(0, int((wake - time.monotonic()) * 1000))

    def _pump_compute(self) -> bool:
        """Replies go to the broker; control frames update what we know.
        False when the compute thread failed."""
        while self.pipe.poll(0):
            frames = self.pipe.recv_multipart()
            if len(frames) == 3:
                self.broker.send_multipart(frames)
            elif frames[0] == control.STATUS:
                self.status = control.decode_status(frames[1])
            elif frames[0] == control.FAILED:
                return False
        return True

    def _pump_broker(self) -> None:
        """Requests go to the compute thread; heartbeats only prove the
        broker alive; DISCONNECT means it forgot us."""
        while self.broker.poll(0):
            frames = self.broker.recv_multipart()
            if len(frames) != 3:
                log.warning("bad_frame_from_broker", parts=len(frames))
                continue
            op = _peek_op(frames[1])
            if op == Op.HEARTBEAT:
                continue
            if op == Op.DISCONNECT:
                log.warning("broker_disconnected_us")
                self._reregister()
                return
            self.pipe.send_multipart(frames)

    def _check_broker_alive(self, now: float) -> None:
        silent = now - self.last_heard
        if silent > p.HEARTBEAT_LIVENESS * self.config.heartbeat_s:
            log.warning("broker_silent", seconds=round(silent, 1))
            self._reregister()

    def _beat(self, now: float) -> None:
        if now >= self.next_beat:
            self._heartbeat()

    def _heartbeat(self) -> None:
        status = self.status
        draining = self.drain_requested
        self._send_broker(
            Op.HEARTBEAT,
            p.WorkerHeartbeat(
                free_slabs=status.free_slabs,
                running=status.running,
                draining=draining,
                drafted=status.drafted,
                accepted=status.accepted,
                link_bytes=status.link_bytes,
                kv_bytes=status.kv_bytes,
                prefixes=status.prefixes,
            ),
        )
        self.next_beat = time.monotonic() + self.config.heartbeat_s

    # ------------------------------------------------------------ drain

    def _request_drain(self, *_) -> None:
        """SIGTERM/SIGINT: the loop starts the drain at its next tick."""
        self.drain_requested = True

    def _start_drain(self, now: float) -> None:
        """The compute thread takes no new work; running jobs get `grace_s`."""
        self.drain_deadline = now + self.config.grace_s
        self.pipe.send(control.DRAIN)
        self._heartbeat()  # it says draining: the broker sends no new sessions here
        log.info("worker_draining", grace_s=self.config.grace_s)

    def _drain_done(self, now: float) -> bool:
        """True once no job runs, as the compute thread reports after it saw
        DRAIN (no request can start one later). Past the grace, running jobs
        are cancelled: they end at their next token."""
        if self.status.draining and self.status.running == 0:
            return True
        if now > self.drain_deadline:
            self.pipe.send(control.CANCEL_ALL)
            self.drain_deadline = float("inf")
        return False

    # ------------------------------------------------------------ broker link

    def _connect(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.id.encode())
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 1000)
        if self.config.server_key:
            keys.secure_client(sock, self.config.server_key, self.config.curve_secret or None)
        endpoint = self.endpoints[self.attempts % len(self.endpoints)]
        self.attempts += 1
        sock.connect(endpoint)
        ready = msgspec.structs.replace(
            p.decode_body(Op.READY, self.ready_body),
            free_slabs=self.status.free_slabs,
            sessions=list(self.status.sessions),
            owners=self.status.sessions,
            stored=self._stored(endpoint),
        )
        sock.send_multipart([b"", p.envelope(Op.READY), p.encode(ready)])
        self.broker = sock
        self.poller.register(sock, zmq.POLLIN)
        self.last_heard = time.monotonic()
        self.next_beat = self.last_heard + self.config.heartbeat_s
        log.info("worker_registering", broker=endpoint, worker=self.id)

    def _stored(self, endpoint: str) -> list[p.StoredSession]:
        """The hibernated sessions in our store, for a broker over tcp (maybe
        on another host) when the store is a directory it may not read."""
        if self.config.store or not endpoint.startswith("tcp://"):
            return []  # a shared store the broker reads itself, or a broker on this host
        store, heads = LocalStore(self.config.state_dir), []
        for session_id in store.session_ids():
            if session_id not in self.status.sessions:
                with contextlib.suppress(StoreError):  # unreadable: restoring it will say so
                    heads.append(store.head(session_id))
        return heads

    def _reregister(self) -> None:
        """Register anew on a fresh socket; the sessions we hold stay ours
        (READY names them), whatever the broker forgot."""
        self.poller.unregister(self.broker)
        self.broker.close(linger=0)
        self._connect()

    def _send_broker(self, op: str, body) -> None:
        self.broker.send_multipart([b"", p.envelope(op), p.encode(body)])


def _peek_op(raw_env: bytes) -> str | None:
    try:
        return p.decode_envelope(raw_env).op
    except p.ProtocolError:
        return None  # the compute thread answers it with the typed error
