"""The client's pure wire helpers: request bodies built from keyword options,
replies parsed and unwrapped, and the bookkeeping of one generate stream
(chunks, final result, credit). No sockets, no waiting: see core.py."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import msgspec

from kvmux import protocol as p
from kvmux import tracing

from . import errors

log = logging.getLogger("kvmux.client")

DEFAULT_TIMEOUT_S = 30.0
# Chunks the worker may send ahead of the consumer; half of it is granted
# back at a time, so a slow reader holds at most CREDIT chunks in memory.
DEFAULT_CREDIT = 32

MessagesLike = Iterable["p.ChatMessage | dict[str, str] | tuple[str, str]"]

# Our heartbeat: the answer to each of the broker's (its probes whether we
# are still here), and our first frame, saying that we answer them
# (broker/liveness.py). A client that stops answering is judged gone.
HEARTBEAT = [p.envelope(p.Op.HEARTBEAT), p.encode({})]
PROBE = object()  # what `parse` makes of the broker's heartbeat


def typed(struct: type[msgspec.Struct], options: dict[str, Any]) -> dict[str, Any]:
    """Options as `struct`'s fields take them: dicts become the Structs they
    stand for (tools, format, tool_choice). A name that is not a field is
    left for the Struct to refuse by name."""
    types = {f.name: f.type for f in msgspec.structs.fields(struct)}
    out = {}
    for name, given in options.items():
        out[name] = given
        if name in types:
            try:
                out[name] = msgspec.convert(given, types[name])
            except msgspec.ValidationError as exc:
                raise errors.InvalidArgument(f"{name}: {exc}") from None
    return out


def chat_messages(messages: MessagesLike | None) -> list[p.ChatMessage]:
    """Accept ChatMessage, dicts of its fields ({"role", "content"}, a
    call's "tool_calls", a result's "tool_call_id") or (role, content) pairs."""
    out = []
    for m in messages or ():
        if isinstance(m, p.ChatMessage):
            out.append(m)
        elif isinstance(m, dict):
            out.append(p.ChatMessage(**typed(p.ChatMessage, m)))
        else:
            role, content = m
            out.append(p.ChatMessage(role=role, content=content))
    return out


def open_body(system: str | None, sampling: p.Sampling | dict | None = None, **options: Any) -> p.OpenSession:
    """OpenSession from keyword options; sampling fields (max_tokens,
    temperature, ...) may be given flat or as `sampling=`."""
    kwargs = options.get("chat_template_kwargs")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise errors.InvalidArgument("chat_template_kwargs must be a dict: template variable -> value")
    flat = {k: options.pop(k) for k in list(options) if k in p.Sampling.__struct_fields__}
    if isinstance(sampling, p.Sampling):
        sampling = {f: getattr(sampling, f) for f in p.Sampling.__struct_fields__}
    merged = {**(sampling or {}), **flat}
    sampling = p.Sampling(**typed(p.Sampling, merged)) if merged else None
    options.setdefault("traceparent", tracing.current())
    return p.OpenSession(system=system, sampling=sampling, **typed(p.OpenSession, options))


def generate_body(messages: MessagesLike | None = None, credit: int = DEFAULT_CREDIT, **sampling: Any) -> p.Generate:
    sampling.setdefault("traceparent", tracing.current())
    return p.Generate(messages=chat_messages(messages), credit=credit, **typed(p.Generate, sampling))


def append_body(messages: MessagesLike | None = None, token_ids: list[int] | None = None) -> p.Append:
    return p.Append(messages=chat_messages(messages), token_ids=list(token_ids or ()), traceparent=tracing.current())


def request_frames(op: str, request_id: int, session_id: str, body: msgspec.Struct) -> list[bytes]:
    return [p.envelope(op, request_id, session_id), p.encode(body)]


class Reply(NamedTuple):
    op: str
    request_id: int
    session_id: str
    body: p.ReplyBody | errors.KvmuxError  # the error when the body did not decode

    @property
    def last(self) -> bool:
        return self.op != p.Op.PARTIAL


def parse(frames: list[bytes]) -> Reply | object | None:
    """A reply; PROBE for the broker's heartbeat; None (logged) when not
    even the envelope decodes."""
    if len(frames) != 2:
        log.warning("dropping reply with %d frames", len(frames))
        return None
    try:
        env = p.decode_envelope(frames[0])
    except p.ProtocolError as exc:
        log.warning("dropping reply: %s", exc.message)
        return None
    if env.op == p.Op.HEARTBEAT:
        return PROBE
    try:
        body: p.ReplyBody | errors.KvmuxError = p.decode_reply(frames[1])
    except p.ProtocolError as exc:
        body = errors.ERRORS[exc.code](exc.message, request_id=env.request_id, session_id=env.session_id)
    return Reply(env.op, env.request_id, env.session_id, body)


def unwrap(reply: Reply) -> p.ReplyBody:
    """The reply's body, or raise the exception its ERROR carries."""
    body = reply.body
    if isinstance(body, errors.KvmuxError):
        raise body
    if isinstance(body, p.Error):
        raise errors.from_reply(body, reply.request_id, reply.session_id)
    return body


def timeout_error(what: str, timeout: float, request_id: int, session_id: str = "", hint: str = "") -> errors.Timeout:
    message = f"no reply to {what} within {timeout:g}s" + (f": {hint}" if hint else "")
    return errors.Timeout(message, request_id=request_id, session_id=session_id or None)


class StreamState:
    """One generate stream as the replies arrive: hands out chunks, keeps the
    final result, and says when to grant the worker more credit."""

    def __init__(self, request_id: int, session_id: str, credit: int):
        self.request_id = request_id
        self.session_id = session_id
        self.credit = credit
        self.result: p.GenerateResult | None = None
        self.done = False
        self.cancel_sent = False
        self._unacked = 0

    def take(self, reply: Reply) -> p.Chunk | None:
        """The next chunk, or None once the final result is in; raises the
        ERROR it ends with."""
        if reply.last:
            self.done = True
        body = unwrap(reply)
        if isinstance(body, p.Chunk):
            self._unacked += 1
            return body
        if isinstance(body, p.GenerateResult):
            self.result = body
            return None
        self.done = True
        raise errors.Internal(f"unexpected {type(body).__name__} in a generate stream", request_id=reply.request_id)

    def grant(self) -> int:
        """Chunks to grant back now (0: not yet, or no flow control)."""
        if self.credit <= 0 or self.done or self._unacked < max(1, self.credit // 2):
            return 0
        n, self._unacked = self._unacked, 0
        return n

    def credit_frames(self, n: int, request_id: int) -> list[bytes]:
        return request_frames(p.Op.CREDIT, request_id, self.session_id, p.Credit(request_id=self.request_id, n=n))

    def cancel_frames(self, request_id: int) -> list[bytes]:
        self.cancel_sent = True
        return request_frames(p.Op.CANCEL, request_id, self.session_id, p.Cancel(request_id=self.request_id))
