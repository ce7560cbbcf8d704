"""`kvmux bench fuzz`: hostile frames at a running daemon's two sockets.

A seeded generator (`Hostile`) makes frames of every kind a peer could send:
random bytes, random msgpack, valid envelopes of every op (client ops and
worker ops, from either side, DRAIN included) with random, mutated or
another op's bodies, wrong part counts, oversized frames, and valid calls on
real sessions with hostile values. Frontend frames come from several DEALERs
(and some that send and vanish), backend frames from DEALERs with routing
ids of their own, as a worker's would, paced by a well-behaved client's
PING every BARRIER_EVERY frames. Replies are read as they come and counted
by error code. The report gives frames per side and kind, frames/s,
errors by code and the broker's RSS before and after; `tests/test_fuzz.py`
runs a short campaign and then checks the daemon still serves.
"""

from __future__ import annotations

import collections
import random
import time
from pathlib import Path

import msgspec
import zmq
from tqdm import tqdm

from kvmux import protocol as p
from kvmux.protocol import Op

from .report import machine, now_iso, write_json_atomic

CLIENT_OPS = sorted(p.REQUEST_BODIES)
WORKER_OPS = sorted({*p.WORKER_BODIES, *p.REPLY_OPS})
ALL_OPS = sorted({*CLIENT_OPS, *WORKER_OPS, Op.HIBERNATE, "frobnicate", ""})
FIELDS = (
    "system",
    "sink",
    "window",
    "sampling",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "messages",
    "token_ids",
    "credit",
    "request_id",
    "n",
    "keep",
    "grace_s",
    "admission",
    "queue_wait_s",
    "client_name",
    "role",
    "content",
    "model",
    "slabs",
    "slab_bytes",
    "free_slabs",
    "sessions",
    "version",
    "running",
    "draining",
    "reason",
    "session_id",
    "seconds",
    "replayed_tokens",
    "type",
    "code",
    "message",
)
KINDS = (
    "random_bytes",
    "random_msgpack",
    "envelope_random_body",
    "envelope_mutated_body",
    "wrong_parts",
    "session_call",
)
BARRIER_EVERY = 512  # frames between waits for the broker to answer a PING: it keeps up, queues stay shallow
OVERSIZED_EVERY = 5000  # one frame past max_frame_bytes in this many (each is megabytes)
VANISHING = 0.002  # the share of frontend frames sent by a client that then vanishes


class Hostile:
    """Seeded hostile frames; `sessions` holds real session ids to aim at."""

    def __init__(self, seed: int, max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES) -> None:
        self.rng = random.Random(seed)
        self.max_frame_bytes = max_frame_bytes
        self.sessions: list[str] = []

    def value(self, depth: int = 0):
        rng = self.rng
        kind = rng.randrange(10 if depth < 3 else 7)
        if kind == 0:
            return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-(2**63), 2**63)])
        if kind == 1:
            return rng.choice([0.0, -1.0, 1e308, float("inf"), float("nan"), rng.uniform(-1e6, 1e6)])
        if kind == 2:
            return "".join(
                chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x2FFF)])) for _ in range(rng.randrange(12))
            )
        if kind == 3:
            return rng.randbytes(rng.randrange(12))
        if kind == 4:
            return rng.choice([None, True, False])
        if kind == 5:
            return rng.choice(self.sessions or ["0" * 32]) if rng.random() < 0.5 else rng.randrange(-5, 300)
        if kind == 6:
            return rng.choice(ALL_OPS)
        if kind == 7:
            return [self.value(depth + 1) for _ in range(rng.randrange(5))]
        if kind == 8:
            return {rng.choice(FIELDS): self.value(depth + 1) for _ in range(rng.randrange(5))}
        return msgspec.msgpack.Ext(rng.randrange(-128, 128), rng.randbytes(rng.randrange(8)))

    def body(self) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.2:
            return rng.randbytes(rng.randrange(64))
        if roll < 0.5:
            return msgspec.msgpack.encode(self.value())
        fields = {rng.choice(FIELDS): self.value(1) for _ in range(rng.randrange(6))}
        raw = msgspec.msgpack.encode(fields)
        if roll < 0.6 and raw:  # a valid map with its bytes flipped or cut
            at = rng.randrange(len(raw))
            raw = raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1 : at + 1 + rng.randrange(len(raw))]
        return raw

    def envelope(self, op: str | None = None) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.1:
            return rng.randbytes(rng.randrange(24))
        if roll < 0.2:
            return msgspec.msgpack.encode([self.value(2) for _ in range(rng.randrange(7))])
        version = p.PROTOCOL_VERSION if roll < 0.95 else rng.choice([0, 2, -1, 2**40])
        session = rng.choice(["", *self.sessions[:8], "0" * 32, "x" * rng.randrange(200)])
        request_id = rng.choice([rng.randrange(1, 2**32), 0, rng.randrange(1, 64)])
        return msgspec.msgpack.encode([version, op or rng.choice(ALL_OPS), request_id, session])

    def frontend_frame(self) -> tuple[str, list[bytes]]:
        rng = self.rng
        kind = rng.choice(KINDS)
        if kind == "random_bytes":
            return kind, [rng.randbytes(rng.randrange(64)) for _ in range(rng.choice([1, 2, 2, 3]))]
        if kind == "random_msgpack":
            return kind, [msgspec.msgpack.encode(self.value()), msgspec.msgpack.encode(self.value())]
        if kind == "wrong_parts":
            return kind, [self.envelope(), self.body(), *(self.body() for _ in range(rng.choice([-2, -1, 1, 2, 3])))][
                : rng.choice([1, 3, 4, 5])
            ]
        if kind == "session_call" and self.sessions:
            op = rng.choice([Op.APPEND, Op.GENERATE, Op.INFO, Op.CANCEL, Op.CREDIT, Op.RESUME, Op.CLOSE])
            env = p.envelope(op, rng.randrange(1, 2**32), rng.choice(self.sessions))
            return kind, [env, self.body()]
        body = self.body() if kind != "envelope_mutated_body" else self._other_body()
        return kind, [self.envelope(), body]

    def _other_body(self) -> bytes:
        """A valid body of some op, sent under whatever op the envelope says."""
        samples = [
            p.OpenSession(window=self.rng.choice([-1, 0, 10**9])),
            p.Append(token_ids=[self.rng.randrange(-10, 10**6) for _ in range(self.rng.randrange(5))]),
            p.Generate(max_tokens=self.rng.choice([-1, 0, 10**9]), credit=-1),
            p.Drain(grace_s=self.rng.choice([None, -1.0, 0.0])),
            p.WorkerReady(
                model="fuzz",
                slabs=self.rng.randrange(-2, 10**6),
                slab_bytes=1,
                sink=0,
                max_window=1,
                version=p.PROTOCOL_VERSION,
                pid=0,
                host="fuzz",
                free_slabs=self.rng.randrange(-2, 8),
                sessions=[self.rng.choice([*self.sessions, "../../etc", "0" * 32])],
            ),
            p.WorkerHeartbeat(free_slabs=-1, running=10**9),
            p.Credit(request_id=-1, n=-(2**31)),
            p.Close(keep=True),
        ]
        return p.encode(self.rng.choice(samples))

    def backend_frame(self) -> tuple[str, list[bytes]]:
        """What a DEALER on the backend sends: [route, envelope, body] like a
        worker, or any other shape."""
        rng = self.rng
        kind = rng.choice(KINDS)
        route = rng.choice(
            [b"", rng.randbytes(5), b"\x00" + rng.randbytes(4), b"\x00kvmux-admin\x00" + rng.randbytes(5)]
        )
        if kind in ("random_bytes", "wrong_parts"):
            return kind, [rng.randbytes(rng.randrange(32)) for _ in range(rng.choice([1, 2, 4, 5]))]
        if kind == "random_msgpack":
            return kind, [route, msgspec.msgpack.encode(self.value()), msgspec.msgpack.encode(self.value())]
        body = self._other_body() if kind == "envelope_mutated_body" else self.body()
        return kind, [route, self.envelope(rng.choice([*WORKER_OPS, *CLIENT_OPS])), body]

    def oversized(self) -> list[bytes]:
        return [p.envelope(Op.APPEND, 1, self.rng.choice(self.sessions or [""])), b"\x00" * (self.max_frame_bytes + 1)]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _open_sessions(ctx: zmq.Context, frontend: str, count: int) -> list[str]:
    """Real sessions for the fuzzer to aim at (opened and left open)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(frontend)
    ids = []
    try:
        for rid in range(1, count + 1):
            sock.send_multipart([p.envelope(Op.OPEN, rid), p.encode(p.OpenSession(system="fuzz"))])
            if not sock.poll(60_000):
                raise TimeoutError("the daemon did not open a session for the fuzzer")
            reply = p.decode_reply(sock.recv_multipart()[-1])
            if isinstance(reply, p.SessionOpened):
                ids.append(reply.session_id)
    finally:
        sock.close()
    return ids


def campaign(
    frontend: str, backend: str, *, frames: int, seed: int, broker_pid: int | None = None, progress: bool = True
) -> dict:
    """Send `frames` hostile frames, half at each socket; the figures."""
    ctx = zmq.Context.instance()
    gen = Hostile(seed)
    gen.sessions = _open_sessions(ctx, frontend, 3)
    clients = [ctx.socket(zmq.DEALER) for _ in range(4)]
    workers = [ctx.socket(zmq.DEALER) for _ in range(4)]
    for i, sock in enumerate(workers):
        sock.setsockopt(zmq.ROUTING_ID, b"fuzz-%d-%d" % (seed, i))
    for sock, endpoint in [*((c, frontend) for c in clients), *((w, backend) for w in workers)]:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(endpoint)
    barrier = ctx.socket(zmq.DEALER)  # a well-behaved client among the hostile ones
    barrier.setsockopt(zmq.LINGER, 0)
    barrier.connect(frontend)
    barriers = 0
    sent: dict[str, collections.Counter] = {"frontend": collections.Counter(), "backend": collections.Counter()}
    errors: collections.Counter = collections.Counter()
    replies = 0

    def read_replies() -> None:
        nonlocal replies
        for sock in clients + workers:
            while sock.poll(0):
                parts = sock.recv_multipart()
                replies += 1
                try:
                    reply = p.decode_reply(parts[-1])
                except p.ProtocolError:
                    continue
                if isinstance(reply, p.Error):
                    errors[reply.code.value] += 1

    rss_before = rss_peak = rss_kb(broker_pid) if broker_pid else 0
    started = time.perf_counter()
    for i in tqdm(range(frames), desc="fuzz", unit="frame", disable=not progress, mininterval=1.0):
        if i % OVERSIZED_EVERY == OVERSIZED_EVERY - 1:
            gen.rng.choice(clients).send_multipart(gen.oversized())
            sent["frontend"]["oversized"] += 1
        elif i % 2:
            kind, parts = gen.frontend_frame()
            if gen.rng.random() < VANISHING:
                ghost = ctx.socket(zmq.DEALER)
                ghost.connect(frontend)
                ghost.send_multipart(parts)
                ghost.close(linger=100)
                kind = "vanishing_client"
            else:
                gen.rng.choice(clients).send_multipart(parts)
            sent["frontend"][kind] += 1
        else:
            kind, parts = gen.backend_frame()
            gen.rng.choice(workers).send_multipart(parts)
            sent["backend"][kind] += 1
        if i % 256 == 0:
            read_replies()
        if i % BARRIER_EVERY == BARRIER_EVERY - 1:
            # Paced at the broker's speed: frames/s is what it handled, and no
            # queue fills to its high-water mark (flooding is admission's and
            # the high-water marks' business, not this campaign's).
            barriers += 1
            barrier.send_multipart([p.envelope(Op.PING, barriers), p.encode(p.Ping())])
            waited = time.monotonic() + 30
            while not barrier.poll(10) and time.monotonic() < waited:
                read_replies()
            if barrier.poll(0):
                barrier.recv_multipart()
        if broker_pid and i % 2048 == 0:
            rss_peak = max(rss_peak, rss_kb(broker_pid))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the broker catches up: its answers stop coming
        before = replies
        time.sleep(0.5)
        read_replies()
        if replies == before:
            break
    seconds = time.perf_counter() - started
    for sock in [*clients, *workers, barrier]:
        sock.close()
    rss_after = rss_kb(broker_pid) if broker_pid else 0
    return {
        "frames": frames,
        "seed": seed,
        "seconds": round(seconds, 2),
        "frames_per_s": round(frames / seconds),
        "sent": {side: dict(sorted(c.items())) for side, c in sent.items()},
        "replies": replies,
        "errors_by_code": dict(errors.most_common()),
        "rss_kb_before": rss_before,
        "rss_kb_after": rss_after,
        "rss_kb_peak": max(rss_peak, rss_after),  # sampled while the frames flowed
        "rss_growth": round(rss_after / rss_before - 1, 4) if rss_before else None,
        "sessions_aimed_at": len(gen.sessions),
    }


def run(output: Path, *, frames: int, seed: int, frontend: str, backend: str, broker_pid: int | None) -> dict:
    doc = {"bench": "fuzz", "created": now_iso(), "machine": machine()}
    doc["results"] = campaign(frontend, backend, frames=frames, seed=seed, broker_pid=broker_pid)
    write_json_atomic(output, doc)
    return doc
