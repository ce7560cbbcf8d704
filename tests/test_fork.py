"""Forking a session (OpenSession.fork) from the Python client, on a real
broker and worker: a copy taken back to an earlier turn that prefills
nothing again, shares nothing with its original, and is durable on its own."""

from __future__ import annotations

import pytest
from conftest import Stack

from kvmux.client import Client, errors

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)


@pytest.fixture(scope="module")
def stack():
    stack = Stack(workers=1, slabs=3)
    yield stack
    stack.stop()


def reply(session, text: str) -> tuple[str, object]:
    stream = session.generate(messages=[("user", text)], max_tokens=10, temperature=0)
    return "".join(chunk.text for chunk in stream), stream.result


def test_a_fork_branches_from_an_earlier_turn_without_prefilling_it(stack):
    with Client(stack.frontend, timeout=120) as client:
        original = client.open_session(system="Be brief.")
        for question in ("Name a colour.", "Name a fruit.", "Name an animal."):
            reply(original, question)
        before = original.info(token_ids=True)  # system + 3 turns: 7 messages
        original.mark({"end": 0}, from_end=True)

        branch = original.fork(3)  # after the first reply
        assert original.info(marks=["end"]).marks == {"end": 7}  # the copy's rewind took no name of the original's
        assert branch.info(marks=["end"]).marks == {}
        info = branch.info(token_ids=True)
        assert branch.id != original.id and info.messages == 3
        assert info.token_ids == before.token_ids[: info.history_tokens]
        text, result = reply(branch, "Name a city.")
        assert result.prompt_tokens < 20  # the kept token and the new turn, not the history
        whole = branch.fork()  # as it is now
        assert whole.info().messages == 5

        after = original.info(token_ids=True)
        assert after.messages == 7 and after.token_ids == before.token_ids  # the original is as it was
        original.rewind(3)
        again, _ = reply(original, "Name a city.")
        assert again == text  # greedy from the same tokens: the copy is the original at that turn

        with pytest.raises(errors.InvalidArgument, match="no turn"):
            original.fork(1)  # the system prompt and the first message went in together
        with pytest.raises(errors.InvalidArgument, match="system"):
            client.open_session("Other.", fork={"session_id": original.id})
        with pytest.raises(errors.SessionNotFound):
            client.open_session(fork={"session_id": "0" * 32})
        for session in (original, branch, whole):
            session.close()


def test_a_fork_of_a_hibernated_session_outlives_its_original(stack):
    with Client(stack.frontend, timeout=120) as client:
        original = client.open_session()
        for question in ("Name a river.", "Name a lake."):
            reply(original, question)
        tokens = original.info(token_ids=True).token_ids
        others = [client.open_session() for _ in range(stack.slabs)]  # every slab: the original hibernates
        assert original.info().state == "hibernated"
        others.pop().close()

        branch = original.fork(2)  # rebuilt from the original's record and snapshot
        assert original.info().state == "hibernated"  # the original stays where it was
        info = branch.info(token_ids=True)
        assert info.messages == 2 and info.token_ids == tokens[: info.history_tokens]
        original.close()  # the copy shares no file with it
        others.pop().close()
        text, result = reply(branch, "Name a sea.")
        assert text and result.prompt_tokens < 20
        for other in others:
            other.close()
        hog = [client.open_session() for _ in range(stack.slabs)]  # the copy hibernates in turn
        assert branch.info().state == "hibernated"
        hog.pop().close()
        _, result = reply(branch, "Name an ocean.")  # restored from its own snapshot
        assert branch.info().restores == 1 and result.prompt_tokens < 20
        for session in (*hog, branch):
            session.close()
