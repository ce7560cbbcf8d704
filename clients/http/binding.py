"""Conversations -> sessions. OpenAI clients send the whole conversation on
every request; the gateway keeps, for each of its sessions, a hash chain
over the messages the session holds (ending with the reply it generated).
A request whose messages extend one of those chains is appended to that
session: only its new messages are prefilled. Anything else (a new
conversation, or an edited earlier message: a fork) opens a new session,
and the session the old chain belongs to is left as it was. A session's
chat_template_kwargs seed its chain: a request with other template options
is another conversation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


def chain(messages: list[dict[str, str]], template_kwargs: dict | None = None) -> list[str]:
    """The hash after each message: h_i = sha256(h_{i-1}, role, content),
    h_0 the template options (nothing without any)."""
    out, h = [], json.dumps(template_kwargs, sort_keys=True).encode() if template_kwargs else b""
    for m in messages:
        digest = hashlib.sha256(h)
        digest.update(m["role"].encode() + b"\0" + m["content"].encode() + b"\0")
        h = digest.digest()
        out.append(h.hex())
    return out


@dataclass
class Bound:
    session_id: str
    held: int  # tokens the session's slab holds (prompts and replies so far): reused by the next turn


class Bindings:
    """Chain hash -> the session whose conversation ends there. A session
    is claimed by the request that continues it (so two requests never
    share one), and bound again, under its new chain, once it replies."""

    def __init__(self, most: int = 10_000):
        self.ends: dict[str, Bound] = {}
        self.most = most

    def claim(self, messages: list[dict[str, str]], template_kwargs: dict | None = None) -> tuple[Bound | None, int]:
        """The session holding the longest prefix of `messages` (not all of
        them: the last is new), and how many messages it holds."""
        hashes = chain(messages, template_kwargs)
        for held in range(len(messages) - 1, 0, -1):
            bound = self.ends.pop(hashes[held - 1], None)
            if bound is not None:
                return bound, held
        return None, 0

    def bind(self, messages: list[dict[str, str]], bound: Bound, template_kwargs: dict | None = None) -> None:
        self.ends[chain(messages, template_kwargs)[-1]] = bound
        while len(self.ends) > self.most:  # the oldest ends go first (dicts keep insertion order)
            del self.ends[next(iter(self.ends))]
