"""The worker's I/O thread: a DEALER to the broker's backend, heartbeats both
ways, and an inproc PAIR to the compute thread. Socket I/O never waits on
MLX (which releases the GIL while it computes), so heartbeats flow and cancel
frames arrive during a long prefill or decode.

Inproc messages: 3 frames [route, envelope, body] are requests (to compute)
or replies (to the broker); 1 frame is control: to compute b"drop",
b"drain", b"cancel_all"; from compute b"loaded" then b"idle" whenever it has
no running job.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import zmq

from kvmux import logs
from kvmux import protocol as p
from kvmux.protocol import Op

log = logs.get("worker")

PIPE = "inproc://kvmux-compute"
# Replies are small and the broker drains them at once; a deep send queue
# only hides a stuck broker, which the heartbeat already catches.
SEND_HWM = 10_000


@dataclass
class WorkerConfig:
    connect: str
    slabs: int = 4
    model: str | None = None
    sink: int = 4
    window: int = 2048
    worker_id: str | None = None
    heartbeat_s: float = p.HEARTBEAT_INTERVAL_S
    grace_s: float = 30.0  # drain: how long running generations may finish


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.ctx = zmq.Context.instance()
        self.stop = threading.Event()
        self.drain_requested = threading.Event()
        self.scheduler = None
        self.ready_body: bytes | None = None

    # ------------------------------------------------------------ compute

    def _compute(self) -> None:
        pipe = self.ctx.socket(zmq.PAIR)
        pipe.connect(PIPE)
        try:
            import mlx.core as mx

            from .engine import Engine
            from .model import load
            from .scheduler import Scheduler
            from .slab import SlabPool

            # MLX streams belong to the thread that made them.
            mx.set_default_stream(mx.new_stream(mx.default_device()))
            loaded = load(self.config.model)
            engine = Engine(loaded, max_sink=self.config.sink, max_window=self.config.window)
            self.scheduler = Scheduler(engine=engine, pool=SlabPool(self.config.slabs), worker_id=self.id, pipe=pipe)
            self.ready_body = p.encode(
                p.WorkerReady(
                    model=loaded.model_id,
                    slabs=self.config.slabs,
                    slab_bytes=engine.slab_bytes(self.config.sink, self.config.window),
                    sink=self.config.sink,
                    max_window=self.config.window,
                    version=p.PROTOCOL_VERSION,
                    pid=os.getpid(),
                    host=socket.gethostname(),
                    free_slabs=self.config.slabs,
                )
            )
            pipe.send(b"loaded")
            self.scheduler.run(self.stop)
        except BaseException:
            log.exception("compute_failed")
            pipe.send(b"failed")
        finally:
            pipe.close(linger=0)

    # ------------------------------------------------------------ broker link

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.id.encode())
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.config.connect)
        sock.send_multipart([b"", p.envelope(Op.READY), self.ready_body])
        log.info("worker_registering", broker=self.config.connect, worker=self.id)
        return sock

    def _heartbeat(self, broker: zmq.Socket) -> None:
        sched = self.scheduler
        body = p.WorkerHeartbeat(
            free_slabs=sched.pool.free, running=len(sched.jobs), draining=self.drain_requested.is_set()
        )
        broker.send_multipart([b"", p.envelope(Op.HEARTBEAT), p.encode(body)])

    def run(self) -> int:
        pipe = self.ctx.socket(zmq.PAIR)
        pipe.bind(PIPE)
        compute = threading.Thread(target=self._compute, name="kvmux-compute", daemon=True)
        compute.start()
        if pipe.recv() != b"loaded":
            return 1
        signal.signal(signal.SIGTERM, lambda *_: self.drain_requested.set())
        signal.signal(signal.SIGINT, lambda *_: self.drain_requested.set())

        broker = self._connect()
        interval = self.config.heartbeat_s
        liveness_s = p.HEARTBEAT_LIVENESS * interval
        last_heard = time.monotonic()
        next_beat = time.monotonic() + interval
        drain_deadline = None
        poller = zmq.Poller()
        poller.register(pipe, zmq.POLLIN)
        poller.register(broker, zmq.POLLIN)
        while True:
            if self.drain_requested.is_set() and drain_deadline is None:
                drain_deadline = time.monotonic() + self.config.grace_s
                pipe.send(b"drain")
                self._heartbeat(broker)  # tell the broker at once: no new sessions here
                log.info("worker_draining", grace_s=self.config.grace_s)
            if drain_deadline is not None:
                if not self.scheduler.jobs:
                    break
                if time.monotonic() > drain_deadline:
                    pipe.send(b"cancel_all")
                    drain_deadline = float("inf")  # cancelled jobs end at their next token
            events = dict(
                poller.poll(
                    timeout=max(0, int((next_beat - time.monotonic()) * 1000)) if drain_deadline is None else 50
                )
            )
            now = time.monotonic()
            if pipe in events:
                while pipe.poll(0):
                    frames = pipe.recv_multipart()
                    if len(frames) == 3:
                        broker.send_multipart(frames)
                    elif frames == [b"failed"]:
                        return 1
            if broker in events:
                last_heard = now
                while broker.poll(0):
                    frames = broker.recv_multipart()
                    if len(frames) != 3:
                        log.warning("bad_frame_from_broker", parts=len(frames))
                        continue
                    op = _peek_op(frames[1])
                    if op == Op.HEARTBEAT:
                        continue
                    if op == Op.DISCONNECT:
                        log.warning("broker_disconnected_us")
                        broker = self._reregister(poller, broker, pipe)
                        continue
                    pipe.send_multipart(frames)
            if now - last_heard > liveness_s:
                log.warning("broker_silent", seconds=round(now - last_heard, 1))
                broker = self._reregister(poller, broker, pipe)
                last_heard = now
            if now >= next_beat:
                self._heartbeat(broker)
                next_beat = now + interval
        broker.send_multipart([b"", p.envelope(Op.DISCONNECT), p.encode(p.Disconnect(reason="drained"))])
        log.info("worker_drained")
        self.stop.set()
        compute.join(timeout=5)
        broker.close()
        pipe.close(linger=0)
        return 0

    def _reregister(self, poller: zmq.Poller, broker: zmq.Socket, pipe: zmq.Socket) -> zmq.Socket:
        """A broker that lost us knows none of our sessions: drop them all and
        register anew on a fresh socket."""
        pipe.send(b"drop")
        poller.unregister(broker)
        broker.close(linger=0)
        broker = self._connect()
        poller.register(broker, zmq.POLLIN)
        return broker


def _peek_op(raw_env: bytes) -> str | None:
    try:
        return p.decode_envelope(raw_env).op
    except p.ProtocolError:
        return None  # the compute thread answers it with the typed error
