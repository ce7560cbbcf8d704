"""A session opened as a copy of another (OpenSession.fork): a branch of a
conversation that keeps what the original's slab holds, so nothing is
prefilled again.

The copy is made from the original live here (its slab's arrays copied: a
slab is updated in place), or rebuilt from its record and snapshot when it
is live on another worker or hibernated (worker/restore.py's rebuild, which
does not take the original's placement). Then it is taken back to the turn
asked for (worker/rewind.py) and given its own id. It starts with no names
(Mark) and no snapshot: the caller writes one of its own at once, so the
copy shares no file with the original.
"""

from __future__ import annotations

import copy
import time

from kvmux.protocol import Fork
from kvmux.sessions import SessionStore, state_fields

from .engine import Engine, LiveSession
from .lookup import Lookup
from .restore import rebuild
from .rewind import rewind_to, turn_at


def fork(engine: Engine, store: SessionStore, live: dict[str, LiveSession], session_id: str, body: Fork) -> LiveSession:
    """The copy of `body.session_id` at `body.messages`, as `session_id`;
    raises ProtocolError (session_not_found, session_corrupt,
    invalid_argument for a count where no turn ends). The original, when
    live here, is idle (the caller checks)."""
    source = live.get(body.session_id)
    session = _copy(engine, source) if source is not None else rebuild(store, engine, body.session_id)[0]
    session.marks, session.notes = {}, {}
    if body.messages is not None and body.messages != len(session.conversation.messages):
        # Still under the original's id: a slab rebuilt from its snapshot is read from the original's files.
        rewind_to(engine, store, session, turn_at(session, body.messages))
    session.session_id, session.created = session_id, time.time()
    session.snapshot, session.snapshot_tokens, session.replay = None, 0, []
    session.restores, session.last_restore_s = 0, 0.0
    return session


def _copy(engine: Engine, source: LiveSession) -> LiveSession:
    conversation = copy.copy(source.conversation)
    conversation.messages = list(source.conversation.messages)
    conversation.kwargs, conversation.tools = dict(conversation.kwargs), list(conversation.tools)
    return LiveSession(
        **state_fields(source),
        slab=engine.loaded.copy_slab(source.slab),
        conversation=conversation,
        logits=source.logits,
        lookup=Lookup(),  # it follows the history from here
        draft=engine.drafter.new_cache(source.sink, source.window) if engine.drafter else None,
    )
