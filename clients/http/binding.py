"""Conversations -> sessions. OpenAI clients send the whole conversation on
every request; the gateway keeps, for each of its sessions, a hash chain
over the messages the session holds (ending with the reply it generated).
A request whose messages extend one of those chains is appended to that
session: only its new messages are prefilled. A request that resends the
conversation without its last reply (a regenerate), or with its last
message changed, rewinds that session to the turn before and goes on from
there. Anything else (a new conversation, or an edited earlier message: a
fork) opens a new session, and the session the old chain belongs to is
left as it was. A session's
chat_template_kwargs seed its chain: a request with other template options
is another conversation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field


def chain(messages: list[dict], context: dict | None = None) -> list[str]:
    """The hash after each message: h_i = sha256(h_{i-1}, message) (its
    role, content, tool calls or the call it answers), h_0 the session's
    context: template options and tools (nothing without any)."""
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
    keys: list[str] = field(default_factory=list)  # where Bindings indexes it
    pinned: bool = False  # named by the request (X-Kvmux-Session): its client keeps it, no binding


@dataclass
class Claim:
    """What a request continues: the session, how many of the request's
    messages it holds, and where to rewind it first (None: it continues as
    it is; else the number of messages its last turn goes back to)."""

    bound: Bound
    held: int
    rewind: int | None = None


class Bindings:
    """Chain hash -> the session whose conversation ends there, and the two
    points before its last reply and before its last message (a regenerate,
    an edit of the last message: the session is rewound there instead of
    prefilling the conversation again in a new one). A session is claimed
    by the request that continues it (so two requests never share one), and
    bound again, under its new chain, once it replies."""

    def __init__(self, most: int = 10_000):
        self.ends: dict[str, Bound] = {}
        self.rewinds: dict[str, tuple[Bound, int]] = {}  # chain hash -> (session, its messages there)
        self.most = most

    def claim(self, messages: list[dict], context: dict | None = None) -> Claim | None:
        """The session holding the longest prefix of `messages` (not all of
        them: the last is new); else one that holds `messages` up to its last
        reply, or up to all but the last message, once rewound."""
        hashes = chain(messages, context)
        for held in range(len(messages) - 1, 0, -1):
            bound = self.ends.get(hashes[held - 1])
            if bound is not None:
                self._forget(bound)
                return Claim(bound, held)
        for held in (len(messages), len(messages) - 1):
            found = self.rewinds.get(hashes[held - 1]) if held > 0 else None
            if found is not None:
                self._forget(found[0])
                return Claim(found[0], held, rewind=found[1])
        return None

    def bind(self, messages: list[dict], bound: Bound, context: dict | None = None) -> None:
        hashes = chain(messages, context)
        bound.keys = hashes[-3:]
        self.ends[hashes[-1]] = bound
        for at in range(max(1, len(hashes) - 2), len(hashes)):  # before its last reply, before its last message
            self.rewinds[hashes[at - 1]] = (bound, at)
        while len(self.ends) > self.most:  # the oldest ends go first (dicts keep insertion order)
            self._forget(next(iter(self.ends.values())))

    def _forget(self, bound: Bound) -> None:
        for key in bound.keys:
            if self.ends.get(key) is bound:
                del self.ends[key]
            if self.rewinds.get(key, (None,))[0] is bound:
                del self.rewinds[key]
