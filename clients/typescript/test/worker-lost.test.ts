// Kills the stack's worker (its pid from STATS) mid-generation: the stream
// fails with WorkerLost within three heartbeat intervals and the session
// hibernates. Destructive: it
// runs only where KVMUX_KILL_WORKER=1 (tests/test_node_client.py sets it).
import assert from "node:assert/strict";
import { test } from "node:test";

import { Client, HEARTBEAT_INTERVAL_S, WorkerLost } from "../src/index.js";

const endpoint = process.env.KVMUX_ENDPOINT;

test("a killed worker fails the stream with WorkerLost", { skip: endpoint && process.env.KVMUX_KILL_WORKER === "1" ? false : "needs KVMUX_ENDPOINT and KVMUX_KILL_WORKER=1" }, async () => {
  const client = new Client(endpoint, { timeoutMs: 30_000 });
  try {
    const session = await client.openSession();
    const stream = session.chat("Tell me a long story.", { maxTokens: 16, credit: 2 }); // held by its credit
    await stream.next();
    const { workers } = await client.stats();
    const worker = workers.find((w) => w.workerId === session.opened.workerId);
    assert.ok(worker, "the session's worker is in STATS");
    process.kill(worker.pid, "SIGKILL");
    const killed = Date.now();
    await assert.rejects(async () => {
      for await (const _ of stream);
    }, WorkerLost);
    assert.ok(Date.now() - killed < (3 * HEARTBEAT_INTERVAL_S + 1) * 1000);
    const info = await session.info(); // answered from the store: the session lives on
    assert.equal(info.state, "hibernated");
  } finally {
    await client.close();
  }
});
