"""The long-session soak: sessions walk through many chat turns over a
running daemon, sending text only (the client tokenizes nothing), and every
turn records latency, prefill and decode tokens and seconds, history length,
`kv_live_bytes` from session info and the worker's RSS.

`baseline="reprefill"` also runs the same conversation the way a stateless
HTTP server must: each (or every `baseline_every`-th) turn opens a fresh
session, re-sends the conversation so far (the session's own user and
assistant messages) and generates the same reply length. A stateless server
has a context limit too, so the re-sent history is the most recent
exchanges that fit `baseline_context` tokens, counted with the token numbers
the server reported for each exchange.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from kvmux import logs
from kvmux.client import Client, KvmuxError

from .report import ReportWriter
from .summary import SeriesError, summarize

log = logs.get("bench")

# User messages of near-equal token length, so every turn prefills about the
# same number of new tokens and prefill seconds are comparable across turns.
TOPICS = (
    "cats",
    "rain",
    "music",
    "bread",
    "rivers",
    "stars",
    "trees",
    "salt",
    "glass",
    "paper",
    "bees",
    "snow",
    "iron",
    "clocks",
    "maps",
    "tea",
)
MAX_CONSECUTIVE_ERRORS = 3


def message(turn: int) -> str:
    return f"Tell me one short fact about {TOPICS[(turn - 1) % len(TOPICS)]}."


@dataclass
class SoakConfig:
    endpoint: str
    turns: int | None = 100
    duration_s: float | None = None
    turn_spacing_s: float = 0.0
    sessions: int = 1
    max_tokens: int = 16
    window: int = 2048  # the serve default; --window 256 for a short one
    sink: int | None = None
    system: str | None = None
    baseline: str | None = None  # None | "reprefill"
    baseline_every: int = 1
    baseline_context: int | None = None  # default: sink + window
    timeout_s: float = 120.0


class _RssReader:
    """Worker RSS from /proc/PID/status, for workers on this host (the
    broker's stats carry each worker's pid and host)."""

    def __init__(self, client: Client):
        import platform

        self._pids = {w.worker_id: w.pid for w in client.stats().workers if w.host == platform.node()}

    def pid(self, worker_id: str) -> int | None:
        return self._pids.get(worker_id)

    def rss(self, worker_id: str) -> int | None:
        pid = self._pids.get(worker_id)
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


class Soak:
    def __init__(self, cfg: SoakConfig, output: Path, checkpoint_s: float = 10.0, progress: bool = True):
        self.cfg = cfg
        self.writer = ReportWriter(output, "soak", asdict(cfg), every_s=checkpoint_s, prepare=self._summarize)
        self.doc = self.writer.doc
        self.doc.update(turns=[], opened=[], summary=None, summary_error=None)
        if cfg.baseline:
            self.doc["baseline"] = {
                "mode": cfg.baseline,
                "every": cfg.baseline_every,
                "turns": [],
                "summary": None,
                "summary_error": None,
            }
        self._lock = threading.Lock()
        self._deadline = time.monotonic() + cfg.duration_s if cfg.duration_s else None
        total = cfg.turns * cfg.sessions if cfg.turns else None
        self._bar = tqdm(total=total, desc="soak", unit="turn", disable=not progress)

    # ---------------------------------------------------------------- running

    def run(self) -> dict:
        """Run all sessions to the end (or Ctrl-C) and write the final report."""
        status = "complete"
        with Client(self.cfg.endpoint, timeout=self.cfg.timeout_s) as client:
            self._rss = _RssReader(client)
            self.doc["stats_before"] = _stats_dict(client)
            threads = [
                threading.Thread(target=self._session, args=(client, i), daemon=True) for i in range(self.cfg.sessions)
            ]
            try:
                for t in threads:
                    t.start()
                # Polled, not joined: a join that Ctrl-C interrupts takes its
                # thread for ended (CPython 3.11), and the client would close under it.
                while any(t.is_alive() for t in threads):
                    time.sleep(0.5)
            except KeyboardInterrupt:  # Ctrl-C, or a SIGTERM (spawn.py)
                status = "interrupted"
                self._deadline = time.monotonic()  # sessions stop after their current turn
                for t in threads:
                    if t.ident is not None:  # started
                        t.join(self.cfg.timeout_s)
            self.doc["stats_after"] = _stats_dict(client)
        self._bar.close()
        self.writer.write(status)
        return self.doc

    def _more(self, turn: int) -> bool:
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return False
        return self.cfg.turns is None or turn <= self.cfg.turns

    def _session(self, client: Client, index: int) -> None:
        cfg = self.cfg
        options = {"window": cfg.window, **({"sink": cfg.sink} if cfg.sink is not None else {})}
        try:
            session = client.open_session(system=cfg.system, **options)
        except KvmuxError as exc:
            self._record("turns", {"session": index, "turn": 1, "error": f"open: {type(exc).__name__}: {exc}"})
            return
        with self._lock:
            self.doc["opened"].append({"session": index, **_struct_dict(session.opened)})
        history: list[dict] = []  # this session's conversation, for the baseline
        exchange_tokens: list[int] = []  # tokens each exchange added, as the server counted them
        errors, turn = 0, 1
        with session:
            while self._more(turn) and errors < MAX_CONSECUTIVE_ERRORS:
                text = message(turn)
                rec, reply = self._turn(session, index, turn, text)
                errors = errors + 1 if rec.get("error") else 0
                self._record("turns", rec)
                if not rec.get("error"):
                    history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
                    exchange_tokens.append(rec["prompt_tokens"] + rec["completion_tokens"])
                    if cfg.baseline and (turn - 1) % cfg.baseline_every == 0:
                        self._record("baseline", self._reprefill_turn(client, index, turn, history, exchange_tokens))
                turn += 1
                if cfg.turn_spacing_s:
                    time.sleep(cfg.turn_spacing_s)

    def _turn(self, session, index: int, turn: int, text: str) -> tuple[dict, str]:
        t0 = time.perf_counter()
        try:
            stream = session.chat(text, max_tokens=self.cfg.max_tokens)
            reply = "".join(chunk.text for chunk in stream)
            result = stream.result
            latency = time.perf_counter() - t0
            info = session.info()
        except KvmuxError as exc:
            return {
                "session": index,
                "turn": turn,
                "latency_s": time.perf_counter() - t0,
                "error": f"{type(exc).__name__}: {exc}",
            }, ""
        return self._measure(index, turn, latency, result, info, session.opened.worker_id), reply

    def _reprefill_turn(
        self, client: Client, index: int, turn: int, history: list[dict], exchange_tokens: list[int]
    ) -> dict:
        """The same turn as a stateless server serves it: a fresh session,
        the conversation re-sent (as much as fits the context), the same reply length."""
        cfg = self.cfg
        budget = cfg.baseline_context or (self.doc["opened"][0]["sink"] + cfg.window)
        # history ends with this turn's (user, assistant); re-send up to its user message.
        keep, used = 0, exchange_tokens[-1]
        for tokens in reversed(exchange_tokens[:-1]):
            if used + tokens > budget:
                break
            used += tokens
            keep += 1
        messages = history[-2 * (keep + 1) : -1]
        options = {"window": cfg.window, **({"sink": cfg.sink} if cfg.sink is not None else {})}
        t0 = time.perf_counter()
        try:
            with client.open_session(system=cfg.system, **options) as fresh:
                t1 = time.perf_counter()
                stream = fresh.generate(messages=messages, max_tokens=cfg.max_tokens)
                for _ in stream:
                    pass
                latency = time.perf_counter() - t1
                info = fresh.info()
                rec = self._measure(index, turn, latency, stream.result, info, fresh.opened.worker_id)
        except KvmuxError as exc:
            return {
                "session": index,
                "turn": turn,
                "latency_s": time.perf_counter() - t0,
                "error": f"{type(exc).__name__}: {exc}",
            }
        rec["resent_messages"] = len(messages)
        return rec

    def _measure(self, index: int, turn: int, latency: float, result, info, worker_id: str) -> dict:
        return {
            "session": index,
            "turn": turn,
            "t": round(self.writer.elapsed(), 3),
            "latency_s": latency,
            "stop_reason": result.stop_reason,
            "prompt_tokens": result.prompt_tokens,
            "prefill_s": result.prefill_s,
            "completion_tokens": result.completion_tokens,
            "decode_s": result.decode_s,
            "history_tokens": info.history_tokens,
            "cached_tokens": info.cached_tokens,
            "truncated_tokens": info.truncated_tokens,
            "kv_live_bytes": info.kv_live_bytes,
            "slab_bytes": info.slab_bytes,
            "worker_id": worker_id,
            "worker_pid": self._rss.pid(worker_id),
            "rss_bytes": self._rss.rss(worker_id),
            "error": None,
        }

    def _record(self, where: str, rec: dict) -> None:
        with self._lock:
            (self.doc["turns"] if where == "turns" else self.doc["baseline"]["turns"]).append(rec)
            if where == "turns":
                self._bar.update(1)
                if rec.get("error"):
                    log.warning("turn_failed", session=rec["session"], turn=rec["turn"], error=rec["error"])
            self.writer.checkpoint()

    def _summarize(self) -> None:
        for block in filter(None, (self.doc, self.doc.get("baseline"))):
            try:
                block["summary"], block["summary_error"] = summarize(block["turns"]), None
            except SeriesError as exc:
                block["summary"], block["summary_error"] = None, str(exc)


def _struct_dict(obj) -> dict:
    import msgspec

    return msgspec.to_builtins(obj)


def _stats_dict(client: Client) -> dict | None:
    try:
        return _struct_dict(client.stats())
    except KvmuxError:
        return None
