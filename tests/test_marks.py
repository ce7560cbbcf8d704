"""Named points of a session's conversation (Mark, Find) from the Python
client, on a real broker and worker: kept in the session's record, found by
the broker across hibernation and its own restart, forgotten by a rewind."""

from __future__ import annotations

import pytest
from conftest import Stack

from kvmux.client import Client, errors

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)


@pytest.fixture(scope="module")
def stack():
    stack = Stack(workers=1, slabs=2)
    yield stack
    stack.stop()


def turn(session, text: str) -> None:
    for _ in session.generate(messages=[("user", text)], max_tokens=6, temperature=0):
        pass


def test_marks_point_into_the_conversation_and_find_their_session(stack):
    with Client(stack.frontend, timeout=120) as client, client.open_session(system="Be brief.") as session:
        turn(session, "Name a colour.")  # system, user, assistant
        turn(session, "Name a fruit.")  # 5 messages
        marked = session.mark({"first": 3, "second": 5}, notes={"second": '{"any": "data"}'})
        assert marked.marks == 2
        info = session.info(marks=["second", "first", "unknown"])
        assert info.marks == {"second": 5, "first": 3} and info.notes == {"second": '{"any": "data"}'}
        found = client.find(["unknown", "second", "first"])
        assert found.name == "second" and found.session_id == session.id
        assert client.find(["unknown"]) is None

        with pytest.raises(errors.InvalidArgument, match="holds 5"):
            session.mark({"later": 6})  # a point the conversation has not reached
        with pytest.raises(errors.InvalidArgument, match="does not name"):
            session.mark({}, notes={"first": "x"})
        with pytest.raises(errors.InvalidArgument, match="characters"):
            session.mark({"x" * 300: 1})
        assert session.info(marks=["later"]).marks == {}  # a refused mark changed nothing

        session.rewind(3)  # back before the second turn: its point is gone, the first stays
        assert session.info(marks=["first", "second"]).marks == {"first": 3}
        assert client.find(["second"]) is None or session.info(marks=["second"]).marks == {}
        assert session.mark({}, drop=["first"]).marks == 0
        assert client.find(["first"]) is None


def test_marks_outlive_hibernation_and_a_broker_restart(stack):
    with Client(stack.frontend, timeout=120) as client:
        session = client.open_session()
        turn(session, "Name a river.")
        session.mark({"river": 2}, notes={"river": "note"})
        session.detach()
        others = [client.open_session() for _ in range(stack.slabs)]  # takes every slab: ours hibernates
        probe = client.resume_session(session.id)
        assert probe.info().state == "hibernated"
        probe.detach()  # else this client closes it on the way out
        for other in others:
            other.close()
    stack.restart_broker()
    stack.wait_workers(1)
    with Client(stack.frontend, timeout=120) as client:
        found = client.find(["river"])  # the new broker read the name from the record
        assert found is not None and found.session_id == session.id
        resumed = client.resume_session(found.session_id)
        info = resumed.info(marks=["river"])
        assert info.state == "hibernated" and info.marks == {"river": 2} and info.notes == {"river": "note"}
        turn(resumed, "And a lake?")  # restored, and goes on
        assert resumed.info(marks=["river"]).marks == {"river": 2}
        resumed.close()
        assert client.find(["river"]) is None  # closing forgets its names
