"""`kvmux bench fuzz`: hostile frames at a running daemon's two sockets.

A seeded generator (`Hostile`) makes frames of every kind a peer could send:
random bytes, random msgpack, valid envelopes of every op (client ops and
worker ops, from either side, DRAIN included) with random, mutated or
another op's bodies, invalid UTF-8 inside msgpack strings, negative and
huge request ids, wrong part counts, oversized frames (at either socket),
and valid calls on real sessions with hostile values. Frontend frames come
from several DEALERs (and some that send and vanish), backend frames from
DEALERs with routing ids of their own, as a worker's would, paced by a
well-behaved client's PING every BARRIER_EVERY frames. Replies are read as
they come and counted by error code. The stream of frames depends on the
seed alone (a campaign repeats exactly); the sessions that fuzzed OPENs
opened are closed at the end, so campaigns in a row start from one state.
The report gives frames per side and kind, frames/s, errors by code and the
broker's RSS before and after; `tests/test_fuzz.py` runs short campaigns and
then checks the daemon still serves. With `server_key`, every socket speaks
CURVE (clients with `client_secret`, fake workers with `worker_secret`).
"""

from __future__ import annotations

import collections
import random
import time
from pathlib import Path

import msgspec
import zmq
from tqdm import tqdm

from kvmux import keys
from kvmux import protocol as p
from kvmux.protocol import Op

from .report import machine, now_iso, rss_kb, write_json_atomic

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
# msgpack strings whose bytes are not UTF-8 (msgspec raises UnicodeDecodeError on them)
BAD_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82", b"\xf8\x88\x80\x80\x80", b"ok\xc0\xaf")


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
        if roll < 0.55:  # one field, its name or its value not UTF-8
            name = p.encode(rng.choice(FIELDS))
            if rng.random() < 0.5:
                return b"\x81" + name + self.bad_str()
            return b"\x81" + self.bad_str() + p.encode(self.value(1))
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
        op = op or rng.choice(ALL_OPS)
        if roll < 0.25:  # invalid UTF-8 where the op or the session id goes
            bad = self.bad_str()
            fields = [p.encode(version), bad, p.encode(self.request_id()), p.encode(session)]
            if rng.random() < 0.5:
                fields[1], fields[3] = p.encode(op), bad
            return b"\x94" + b"".join(fields)
        return msgspec.msgpack.encode([version, op, self.request_id(), session])

    def request_id(self) -> int:
        rng = self.rng
        hostile = [0, -1, -(2**63), 2**64 - 1, rng.randrange(-(2**31), 0)]
        return rng.choice([rng.randrange(1, 2**32), rng.randrange(1, 2**32), rng.randrange(1, 64), *hostile])

    def bad_str(self) -> bytes:
        """A msgpack string (fixstr) whose bytes are not UTF-8."""
        raw = self.rng.choice(BAD_UTF8)
        return bytes([0xA0 | len(raw)]) + raw

    def frontend_frame(self) -> tuple[str, list[bytes]]:
        rng = self.rng
        kind = rng.choice(KINDS)
        if kind == "random_bytes":
            return kind, [rng.randbytes(rng.randrange(64)) for _ in range(rng.choice([1, 2, 2, 3]))]
        if kind == "random_msgpack":
            return kind, [msgspec.msgpack.encode(self.value()), msgspec.msgpack.encode(self.value())]
        if kind == "wrong_parts":  # 0 (one empty part: ZeroMQ sends no empty message) to 6 parts, never 2
            count = rng.choice([0, 1, 3, 4, 5, 6])
            return kind, [self.envelope(), *(self.body() for _ in range(5))][:count] or [b""]
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
        if kind == "random_bytes":
            return kind, [rng.randbytes(rng.randrange(32)) for _ in range(rng.choice([1, 2, 3, 4, 5]))]
        if kind == "wrong_parts":  # [route, envelope, body] is right: 1, 2, 4, 5 or 6 parts
            parts = [route, self.envelope(rng.choice([*WORKER_OPS, *CLIENT_OPS])), *(self.body() for _ in range(4))]
            return kind, parts[: rng.choice([1, 2, 4, 5, 6])]
        if kind == "random_msgpack":
            return kind, [route, msgspec.msgpack.encode(self.value()), msgspec.msgpack.encode(self.value())]
        body = self._other_body() if kind == "envelope_mutated_body" else self.body()
        return kind, [route, self.envelope(rng.choice([*WORKER_OPS, *CLIENT_OPS])), body]

    def oversized(self) -> list[bytes]:
        """A client's APPEND past max_frame_bytes."""
        return [p.envelope(Op.APPEND, 1, self.rng.choice(self.sessions or [""])), b"\x00" * (self.max_frame_bytes + 1)]

    def oversized_reply(self) -> list[bytes]:
        """A worker's FINAL past max_frame_bytes, to some route."""
        route = self.rng.choice([b"", self.rng.randbytes(5), b"\x00" + self.rng.randbytes(4)])
        return [route, p.envelope(Op.FINAL, self.rng.randrange(1, 64)), b"\x00" * (self.max_frame_bytes + 1)]


class _Sockets:
    """The campaign's sockets, CURVE clients of `server_key` when it is given."""

    def __init__(self, server_key: str | None, client_secret: str | None, worker_secret: str | None) -> None:
        self.ctx = zmq.Context.instance()
        self.server_key, self.client_secret, self.worker_secret = server_key, client_secret, worker_secret

    def dealer(self, endpoint: str, *, worker: bool = False, routing_id: bytes | None = None) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # the campaign paces itself (BARRIER_EVERY)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if self.server_key:
            keys.secure_client(sock, self.server_key, self.worker_secret if worker else self.client_secret)
        sock.connect(endpoint)
        return sock


def _call(sock: zmq.Socket, op: str, request_id: int, body, session_id: str = "", timeout_s: float = 60.0):
    """One request on a well-behaved socket: its final reply (None in time out)."""
    sock.send_multipart([p.envelope(op, request_id, session_id), p.encode(body)])
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        env_raw, body_raw = sock.recv_multipart()[-2:]
        env = p.decode_envelope(env_raw)
        if env.request_id == request_id and env.op != Op.PARTIAL:
            return p.decode_reply(body_raw)
    return None


def _open_sessions(sock: zmq.Socket, count: int) -> list[str]:
    """Real sessions for the fuzzer to aim at (closed at the end)."""
    ids = []
    for rid in range(1, count + 1):
        reply = _call(sock, Op.OPEN, rid, p.OpenSession(system="fuzz"))
        if reply is None:
            raise TimeoutError("the daemon did not open a session for the fuzzer")
        if isinstance(reply, p.SessionOpened):
            ids.append(reply.session_id)
    return ids


def _close_sessions(sock: zmq.Socket, session_ids: set[str], timeout_s: float = 10.0) -> int:
    """CLOSE what the campaign opened (a session on a fake worker answers
    once the broker forgets that worker); how many closed."""
    pending = {}
    for rid, session_id in enumerate(sorted(session_ids), start=1_000_000):
        sock.send_multipart([p.envelope(Op.CLOSE, rid, session_id), p.encode(p.Close())])
        pending[rid] = session_id
    closed = 0
    deadline = time.monotonic() + timeout_s
    while pending and sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        env_raw, body_raw = sock.recv_multipart()[-2:]
        rid = p.decode_envelope(env_raw).request_id
        if pending.pop(rid, None) is not None:
            closed += isinstance(p.decode_reply(body_raw), p.Closed)
    return closed


def campaign(
    frontend: str,
    backend: str,
    *,
    frames: int,
    seed: int,
    broker_pid: int | None = None,
    progress: bool = True,
    server_key: str | None = None,
    client_secret: str | None = None,
    worker_secret: str | None = None,
) -> dict:
    """Send `frames` hostile frames, half at each socket; the figures."""
    socks = _Sockets(server_key, client_secret, worker_secret)
    barrier = socks.dealer(frontend)  # a well-behaved client among the hostile ones
    gen = Hostile(seed)
    gen.sessions = _open_sessions(barrier, 3)
    clients = [socks.dealer(frontend) for _ in range(4)]
    workers = [socks.dealer(backend, worker=True, routing_id=b"fuzz-%d-%d" % (seed, i)) for i in range(4)]
    barriers = 0
    sent: dict[str, collections.Counter] = {"frontend": collections.Counter(), "backend": collections.Counter()}
    errors: collections.Counter = collections.Counter()
    opened: set[str] = set(gen.sessions)  # by fuzzed OPENs too: closed at the end
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
                elif isinstance(reply, p.SessionOpened) and sock in clients:
                    opened.add(reply.session_id)

    rss_before = rss_peak = rss_kb(broker_pid) if broker_pid else 0
    started = time.perf_counter()
    for i in tqdm(range(frames), desc="fuzz", unit="frame", disable=not progress, mininterval=1.0):
        if i % OVERSIZED_EVERY == OVERSIZED_EVERY - 1:
            if i // OVERSIZED_EVERY % 2:
                gen.rng.choice(workers).send_multipart(gen.oversized_reply())
                sent["backend"]["oversized"] += 1
            else:
                gen.rng.choice(clients).send_multipart(gen.oversized())
                sent["frontend"]["oversized"] += 1
        elif i % 2:
            kind, parts = gen.frontend_frame()
            if gen.rng.random() < VANISHING:
                ghost = socks.dealer(frontend)
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
    for sock in clients + workers:
        sock.close()
    closed = _close_sessions(barrier, opened)
    barrier.close()
    rss_after = rss_kb(broker_pid) if broker_pid else 0
    if broker_pid:  # quiet for 2 s: the broker has handed its freed heap back (broker/heap.py)
        time.sleep(2.0)
    rss_settled = rss_kb(broker_pid) if broker_pid else 0
    return {
        "frames": frames,
        "seed": seed,
        "curve": bool(server_key),
        "seconds": round(seconds, 2),
        "frames_per_s": round(frames / seconds),
        "sent": {side: dict(sorted(c.items())) for side, c in sent.items()},
        "replies": replies,
        "errors_by_code": dict(errors.most_common()),
        "rss_kb_before": rss_before,
        "rss_kb_after": rss_after,
        "rss_kb_peak": max(rss_peak, rss_after),  # sampled while the frames flowed
        "rss_kb_settled": rss_settled,
        "rss_growth": round(rss_settled / rss_before - 1, 4) if rss_before else None,  # settled vs before
        "sessions_aimed_at": len(gen.sessions),
        "sessions_opened": len(opened),
        "sessions_closed": closed,
    }


def run(output: Path, *, frames: int, seed: int, frontend: str, backend: str, broker_pid: int | None, **curve) -> dict:
    doc = {"bench": "fuzz", "created": now_iso(), "machine": machine()}
    doc["results"] = campaign(frontend, backend, frames=frames, seed=seed, broker_pid=broker_pid, **curve)
    write_json_atomic(output, doc)
    return doc
