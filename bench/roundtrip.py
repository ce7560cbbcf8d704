"""`broker_overhead`: round trips of small frames and pipelined frames/s on
raw DEALER sockets, through the broker and against a direct DEALER-ROUTER
echo pair in another process (the least a hop can cost on this machine).

Through the broker two paths are timed: PING, which the broker answers
itself (one hop, like the direct pair), and INFO on a session, which the
broker forwards to the worker and back (the path every session frame takes).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import zmq

from kvmux import keys
from kvmux import protocol as p

from .report import percentile

Frames = Callable[[int], list[bytes]]
Curve = tuple[str, str]  # the broker's public key and our secret key (files or z85)


def _dealer(endpoint: str, curve: Curve | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a lost reply is an error, not a hang
    if curve is not None:
        keys.secure_client(sock, *curve)
    sock.connect(endpoint)
    return sock


def round_trips(endpoint: str, frames: Frames, n: int = 2000, warmup: int = 200, curve: Curve | None = None) -> dict:
    """p50/p99 of one-at-a-time round trips (microseconds)."""
    sock = _dealer(endpoint, curve)
    try:
        samples = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            sock.send_multipart(frames(i + 1))
            sock.recv_multipart()
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
    finally:
        sock.close()
    us = [s * 1e6 for s in samples]
    return {"n": n, "p50_us": percentile(us, 50), "p99_us": percentile(us, 99), "mean_us": sum(us) / n}


def pipelined(endpoint: str, frames: Frames, total: int = 20000, outstanding: int = 256) -> dict:
    """Replies per second with `outstanding` requests kept in flight."""
    sock = _dealer(endpoint)
    try:
        sent = received = 0
        t0 = time.perf_counter()
        while sent < min(outstanding, total):
            sent += 1
            sock.send_multipart(frames(sent))
        while received < total:
            sock.recv_multipart()
            received += 1
            if sent < total:
                sent += 1
                sock.send_multipart(frames(sent))
        elapsed = time.perf_counter() - t0
    finally:
        sock.close()
    return {"total": total, "outstanding": outstanding, "frames_per_s": total / elapsed}


def ping_frames(rid: int) -> list[bytes]:
    return [p.envelope(p.Op.PING, rid), p.encode(p.Ping())]


def open_raw_session(endpoint: str, window: int = 64, curve: Curve | None = None) -> str:
    """Open a session on a raw socket and return its id (to INFO it)."""
    sock = _dealer(endpoint, curve)
    try:
        sock.send_multipart([p.envelope(p.Op.OPEN, 1), p.encode(p.OpenSession(window=window))])
        _env, body = sock.recv_multipart()
    finally:
        sock.close()
    reply = p.decode_reply(body)
    if not isinstance(reply, p.SessionOpened):
        raise RuntimeError(f"open failed: {reply}")
    return reply.session_id


def close_raw_session(endpoint: str, session_id: str, curve: Curve | None = None) -> None:
    sock = _dealer(endpoint, curve)
    try:
        sock.send_multipart([p.envelope(p.Op.CLOSE, 1, session_id), p.encode(p.Close())])
        sock.recv_multipart()
    finally:
        sock.close()


def info_frames(session_id: str) -> Frames:
    body = p.encode(p.Info())
    return lambda rid: [p.envelope(p.Op.INFO, rid, session_id), body]


class EchoPeer:
    """A ROUTER in its own process that sends every frame straight back."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.proc = subprocess.Popen([sys.executable, "-m", "kvmux.bench.roundtrip", endpoint], stdout=subprocess.PIPE)
        self.proc.stdout.readline()  # "ready" once bound

    def __enter__(self) -> EchoPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _echo(endpoint: str) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart())


def measure(frontend: str, direct_endpoint: str, with_worker: bool = True, n: int = 2000, total: int = 20000) -> dict:
    """All broker_overhead numbers for one transport."""
    out: dict = {}
    with EchoPeer(direct_endpoint):
        out["direct"] = {
            "round_trip": round_trips(direct_endpoint, ping_frames, n),
            "pipelined": pipelined(direct_endpoint, ping_frames, total),
        }
    out["broker_ping"] = {
        "round_trip": round_trips(frontend, ping_frames, n),
        "pipelined": pipelined(frontend, ping_frames, total),
    }
    if with_worker:
        sid = open_raw_session(frontend)
        try:
            frames = info_frames(sid)
            out["forwarded_info"] = {
                "round_trip": round_trips(frontend, frames, n // 4),
                "pipelined": pipelined(frontend, frames, total // 4),
            }
        finally:
            close_raw_session(frontend, sid)
    return out


if __name__ == "__main__":
    _echo(sys.argv[1])
