"""Conversations -> sessions. OpenAI and Anthropic clients send the whole
conversation on every request; a session is named by hashes of its own
conversation, so that the request that resends it finds it again.

A hash chain over a conversation's messages (`chain`) names each of its
points. After every reply the session is marked (protocol Mark: the names
live in its record, and the broker finds a session by them) at its last
three points: before its last message, before its last reply, and its end.
A request whose messages extend the end is appended to that session: only
its new messages are prefilled. A request that matches one of the two
points before (another conversation that opened as this one did, a
regenerate, the last message changed) gets a copy of the session taken
back there (OpenSession.fork: nothing prefilled again), and the session
stays its own conversation's: two conversations are never answered from
one session. Anything else (a new conversation, or an edited earlier
message) opens a new session, which takes what it shares with other
openings from the worker's shared prefixes (worker/prefixes.py).

The names are the daemon's, not the gateway's: a gateway restarted, or
another one in front of the same daemon, finds the same sessions. A
session's context (the caller's identity, template options, tools) seeds its
chain: another key, or other tools, is another conversation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from kvmux import protocol as p
from kvmux.client import AsyncClient, errors

POINTS = 3  # a session's chain is named at its last POINTS points


def chain(messages: list[dict], context: dict | None = None) -> list[str]:
    """The hash after each message: h_i = sha256(h_{i-1}, message) (its
    role, content, tool calls or the call it answers), h_0 the session's
    context (nothing without any)."""
    out, h = [], json.dumps(context, sort_keys=True).encode() if context else b""
    for m in messages:
        digest = hashlib.sha256(h)
        digest.update(json.dumps(m, sort_keys=True).encode())
        h = digest.digest()
        out.append(h.hex())
    return out


@dataclass
class Bound:
    session_id: str
    held: int  # tokens the session's slab holds (prompts and replies so far): reused by the next turn
    names: list[str] = field(default_factory=list)  # the chain names the session has: replaced after its reply
    pinned: bool = False  # named by the request (X-Kvmux-Session): its client keeps it, no names


_STALE = (p.ErrorCode.SESSION_NOT_FOUND, p.ErrorCode.SESSION_EXPIRED, p.ErrorCode.SESSION_CORRUPT)


async def claim(client: AsyncClient, messages: list[dict], context: dict | None, owner: str = ""):
    """The session that holds the longest prefix of `messages` (a copy of
    it, for `owner`, where the prefix ends before its last reply or
    message), with the messages it still needs: (session, Bound, new
    messages); None when no session holds any, or the one that did is gone,
    busy or cannot go back."""
    hashes = chain(messages, context)
    found = await client.find(reversed(hashes))  # the longest first
    if found is None:
        return None
    held = hashes.index(found.name) + 1  # the request's messages the session holds
    try:
        session = await client.resume_session(found.session_id)
        session.detach()  # a handle only: the session outlives the gateway
        info = await session.info(marks=hashes)
        at = info.marks.get(found.name)
        if at is None or info.busy:  # the name went with a rewind; or another request is on it now
            return None
        bound = Bound(session.id, info.history_tokens - info.pending_tokens, names=list(info.marks))
        if at < info.messages:  # an earlier point of its conversation: a copy from there
            session = await client.open_session(
                None, client_name=owner, fork=p.Fork(session_id=session.id, messages=at)
            )
            forked = await session.info()
            bound = Bound(session.id, forked.history_tokens - forked.pending_tokens)
        elif held == len(messages):
            return None  # nothing new to reply to
        return session, bound, messages[held:]
    except errors.KvmuxError as exc:  # closed, expired or lost, or no turn ends there: afresh
        if exc.code in _STALE or exc.code in (p.ErrorCode.INVALID_ARGUMENT, p.ErrorCode.BUSY):
            return None
        raise


async def bind(session, bound: Bound, messages: list[dict], context: dict | None) -> None:
    """The session now holds `messages` (the conversation and its reply):
    name its last points, in place of the names it had."""
    hashes = chain(messages, context)
    # Counted back from the end: the session may hold a message the request
    # does not (the tools' system prompt, for a template that renders none).
    names = {hashes[-back - 1]: back for back in range(min(POINTS, len(hashes)))}
    await session.mark(names, drop=[name for name in bound.names if name not in names], from_end=True)
    bound.names = list(names)
