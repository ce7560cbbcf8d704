"""Rewinding a session to the end of an earlier turn: a regenerate (the
conversation without its last reply) or an edit of the last message, without
prefilling the history again.

The slab takes the undone tokens back where it can (worker/slab.py,
`can_rewind`: until its ring wraps, any number). Then only the last kept
token is fed again, with the next request, for the logits the next reply
starts from. A slab whose ring has wrapped has overwritten what the undone
tokens replaced: it is rebuilt from the session's last snapshot when that
precedes the turn (the tokens after it are fed again), else from nothing.
The history, the conversation and the record go back exactly; the names
of points past the turn (Mark) are forgotten.
"""

from __future__ import annotations

from kvmux.protocol import ErrorCode, ProtocolError
from kvmux.sessions import SessionStore, Turn
from kvmux.sessions.durable import unmark_past

from .engine import Engine, LiveSession
from .lookup import Lookup
from .slab import rewind as take_back


def turn_at(session: LiveSession, messages: int) -> Turn:
    """The turn that ended where the conversation held `messages` messages;
    raises invalid_argument (naming where the last turns end) if none did."""
    turn = next((t for t in reversed(session.turns) if t.messages == messages), None)
    if turn is None:
        ends = ", ".join(str(t.messages) for t in session.turns[-8:]) or "none yet"
        raise ProtocolError(
            ErrorCode.INVALID_ARGUMENT,
            f"no turn of this session ends after {messages} messages (turns end after: {ends})",
        )
    return turn


def rewind_to(engine: Engine, store: SessionStore, session: LiveSession, turn: Turn) -> bool:
    """Take the session back to `turn`; returns whether its record needs a
    new snapshot (the last one holds tokens that are gone)."""
    tokens = [*session.history, *session.pending]
    fed = len(session.history)
    conversation = session.conversation
    conversation.rollback((turn.messages, conversation.rendered[: turn.rendered]))
    session.turns = [t for t in session.turns if t.tokens <= turn.tokens and t.messages <= turn.messages]
    unmark_past(session, turn.messages)
    if turn.tokens >= fed:  # only tokens not fed yet go
        session.pending = tokens[fed : turn.tokens]
        return False
    keep = max(0, turn.tokens - 1)  # fed again: the next reply starts from its logits
    back = fed - keep
    stale = False
    if all(layer.can_rewind(back) for layer in session.slab):
        take_back(session.slab, back)
        if keep >= session.snapshot_tokens:
            _drop_replay(session.replay, back)
        else:
            stale = True
    else:
        session.slab = engine.make_slab(session.sink, session.window)
        keep, target = 0, keep
        if session.snapshot is not None and session.snapshot_tokens <= target:
            session.slab, _ = store.load_snapshot(session.session_id, session.snapshot, session.slab)
            keep = session.snapshot_tokens
        else:
            session.snapshot, session.snapshot_tokens = None, 0
        session.replay = []
    session.history = tokens[:keep]
    session.pending = tokens[keep : turn.tokens]
    session.logits = None
    session.lookup = Lookup()  # it follows the history, which went back
    if engine.drafter:
        session.draft = engine.drafter.new_cache(session.sink, session.window)
    return stale


def _drop_replay(replay: list[int], n: int) -> None:
    """Take the newest `n` tokens out of the chunk sizes fed since the snapshot."""
    while n:
        last = replay.pop()
        if last > n:
            replay.append(last - n)
        n -= min(last, n)
