"""A worker group (`kvmux serve --pipeline 2`): one worker made of two MLX
processes over mx.distributed's ring backend on localhost, each holding half
of the model's layers. Its greedy tokens are a single-process worker's; a
session hibernated on it resumes on it; a rank killed takes the group down,
the daemon restarts it and the session is served again from the store; a
single-process worker refuses the group's snapshot by its layout.

Both daemons run with one BLAS thread per process and --batch-invariant, so
that both pad their passes alike (the padding decision is otherwise timed,
and a group's passes are timed with the hop between its ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import Daemon, kvmux_command

from kvmux.client import Client, errors

pytestmark = pytest.mark.stack  # each test starts processes of its own (the whole suite only)

SAME_KERNELS = {"OPENBLAS_NUM_THREADS": "1"}
ARGS = ("--batch-invariant",)
PROMPTS = ("Name three colors.", "Why is the sky blue?", "Write a haiku about the sea.")
CHAT = ("Tell me about cats.", "And dogs?", "Which is easier to keep?", "Why?")
SLABS = len(PROMPTS)  # the prompts run at once too
WINDOW = 48  # the chat's session: its turns go past it
REPEAT = "Repeat these words twice: red green blue red green blue red green blue."


def greedy(session, text: str, max_tokens: int) -> list[int]:
    stream = session.chat(text, max_tokens=max_tokens, temperature=0, speculative="off")
    return [token for chunk in stream for token in chunk.token_ids]


def answers(client: Client, between_turns=lambda session, turn: None) -> dict:
    """Three prompts of 32 tokens each in fresh sessions; the three at once
    (shared passes: a group's split in a pass per rank, in flight
    together); one verified speculatively; then a chat past its window
    (`between_turns` runs before each of its turns), and a fork of it."""
    out = {"prompts": []}
    for prompt in PROMPTS:
        session = client.open_session()
        out["prompts"].append(greedy(session, prompt, 32))
        session.close()
    sessions = [client.open_session() for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        out["together"] = list(pool.map(lambda s, text: greedy(s, text, 32), sessions, PROMPTS))
    for session in sessions:
        session.close()
    with client.open_session() as session:
        stream = session.chat(REPEAT, max_tokens=32, temperature=0, speculative="lookup")
        out["lookup"] = [token for chunk in stream for token in chunk.token_ids]
        out["drafted"] = stream.result.drafted_tokens
    chat = client.open_session(system="Be brief.", window=WINDOW)
    out["chat"] = []
    for turn, text in enumerate(CHAT):
        between_turns(chat, turn)
        out["chat"].append(greedy(chat, text, 16))
    out["dropped"] = chat.info().truncated_tokens
    with chat.fork(3) as branch:  # a copy of its slab on every rank, taken back to the first reply
        out["branch"] = greedy(branch, "And birds?", 16)
    out["session"] = chat
    return out


def rank_pids(daemon: Daemon) -> list[int]:
    return daemon.events("local_worker_started")[-1]["pids"]


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("group")
    daemon = Daemon(tmp, slabs=SLABS, args=("--pipeline", "2", *ARGS), env=SAME_KERNELS)
    yield tmp, daemon
    daemon.stop()


def test_a_group_serves_as_one_process_and_survives_a_lost_rank(group):
    tmp, daemon = group
    with Client(daemon.frontend, timeout=180) as client:
        [worker] = client.stats().workers
        assert worker.compute.layout == "pipeline 2: layers 0-14 | 15-29"
        assert len(rank_pids(daemon)) == 2

        def churn(chat, turn):
            if turn == 2:  # every slab taken by others: the chat hibernates, then resumes on the group
                others = [client.open_session() for _ in range(SLABS)]
                assert chat.info().state == "hibernated"
                for other in others:
                    other.close()
            if turn == 3:  # rank 1 killed: the group goes down, the daemon starts it again
                os.kill(rank_pids(daemon)[1], signal.SIGKILL)
                deadline = time.monotonic() + 120
                while len(daemon.events("local_worker_started")) < 2 or not client.stats().workers:
                    assert time.monotonic() < deadline, daemon.logs()
                    time.sleep(0.5)

        got = answers(client, churn)
        info = got["session"].info()
        assert info.restores == 2 and info.state == "live"  # once from hibernation, once after the rank was lost
        assert got["dropped"] > 0
        assert len(daemon.events("local_worker_exited")) == 1
        got["session"].close()
        held = client.open_session(system="Be brief.", window=WINDOW)
        greedy(held, CHAT[0], 8)
        daemon.stop()  # while the client holds the session: the drain snapshots it, rank 0's part and rank 1's
    names = {p.name for p in (tmp / "state" / "sessions" / held.id).glob("slab-*")}
    [whole] = [name for name in names if "-rank" not in name]
    assert names == {whole, whole.replace(".safetensors", "-rank1.safetensors")}, names

    # The same conversations on one process, on the same store.
    with (
        Daemon(tmp, slabs=SLABS, args=ARGS, env=SAME_KERNELS) as single,
        Client(single.frontend, timeout=180) as client,
    ):
        want = answers(client)
        assert got["prompts"] == want["prompts"] == got["together"] == want["together"]
        assert got["lookup"] == want["lookup"] and got["drafted"] > 0  # verify passes through both ranks
        assert got["chat"] == want["chat"]
        assert got["branch"] == want["branch"]
        with pytest.raises(errors.SessionCorrupt, match="layout"):
            greedy(client.resume_session(held.id), CHAT[1], 4)


def test_a_rank_without_a_group_to_join_is_refused():
    """`kvmux worker --pipeline 2` started alone (not by mlx.launch or kvmux
    serve): a clear refusal, exit 2, not a hang."""
    done = subprocess.run(
        kvmux_command("worker", "--pipeline", "2", "--connect", "ipc:///tmp/kvmux-no-broker.ipc"),
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLX_")},
    )
    assert done.returncode == 2
    assert "--pipeline 2: no ring group to join" in done.stderr and "mlx.launch" in done.stderr
