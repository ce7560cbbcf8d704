"""Rewinding a session to the end of an earlier turn (regenerate, edit the
last message) from the Python client, on a real broker and worker."""

from __future__ import annotations

import pytest
from conftest import Stack

from kvmux import protocol as p
from kvmux.client import Client, errors

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)


@pytest.fixture(scope="module")
def stack():
    stack = Stack(workers=1, slabs=2)
    yield stack
    stack.stop()


def reply(session, **options) -> tuple[str, p.GenerateResult]:
    stream = session.generate(max_tokens=12, temperature=0, **options)
    return "".join(chunk.text for chunk in stream), stream.result


def test_a_regenerate_and_an_edit_reuse_the_slab(stack):
    with Client(stack.frontend, timeout=120) as client, client.open_session(system="Be brief.") as session:
        reply(session, messages=[("user", "Name a colour.")])
        before = session.info(token_ids=True)  # system, user, assistant: 3 messages
        second, result = reply(session, messages=[("user", "Name a fruit.")])

        rewound = session.rewind(4)  # back to before the last reply: a regenerate
        assert rewound.messages == 4 and rewound.pending_tokens == 1  # the slab took the reply back
        assert rewound.kept_tokens + 1 == rewound.history_tokens < result.history_tokens - result.completion_tokens
        again, regenerated = reply(session)
        assert regenerated.prompt_tokens < 10  # the kept token and the generation prompt, not the history
        assert again == second  # greedy, from the same tokens
        assert session.info().messages == 5

        rewound = session.rewind(3)  # back to before the last message: an edit of it
        assert session.info(token_ids=True).token_ids[: before.history_tokens] == before.token_ids
        _, edited = reply(session, messages=[("user", "Name an animal.")])
        assert edited.prompt_tokens < 20 and session.info().messages == 5

        with pytest.raises(errors.InvalidArgument, match="no turn"):
            session.rewind(1)  # the system prompt and the first message went in together: no turn ends there
        assert session.info().messages == 5


def test_a_rewind_past_a_wrapped_window_rebuilds_and_survives_hibernation(stack):
    with Client(stack.frontend, timeout=120) as client:
        session = client.open_session(window=48, sink=4)
        for word in ("colour", "fruit", "animal", "city", "river", "planet"):
            reply(session, messages=[("user", f"Name a {word}.")])
        assert session.info().truncated_tokens > 0  # the ring has wrapped
        full = session.info(token_ids=True).token_ids
        rewound = session.rewind(10)  # before the last message: further back than the spare slots reach
        assert rewound.history_tokens < len(full) and rewound.pending_tokens > 1
        assert session.info(token_ids=True).token_ids == full[: rewound.history_tokens]
        text, result = reply(session, messages=[("user", "Name a star.")])
        assert result.prompt_tokens >= rewound.pending_tokens and text
        others = [client.open_session() for _ in range(stack.slabs)]  # takes every slab: ours hibernates
        assert session.info().state == "hibernated"
        for other in others:
            other.close()
        rewound = session.rewind(11)  # restored from the store, then back before the reply just made
        assert rewound.messages == 11 and session.info().restores == 1
        again, result = reply(session)
        assert again and session.info().messages == 12
        session.close()
