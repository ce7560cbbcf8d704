// The Node client against a real kvmux stack (broker + worker + model) at
// KVMUX_ENDPOINT. tests/test_node_client.py starts one and runs this suite;
// by hand: `kvmux serve --slabs 3` then `KVMUX_ENDPOINT=ipc://... npm test`.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import {
  Busy, Cancelled, Client, InvalidArgument, KvmuxError, MalformedFrame, Op, Overloaded, Session,
  SessionNotFound, Timeout, UnknownOp, type Chunk,
} from "../src/index.js";

const endpoint = process.env.KVMUX_ENDPOINT;

async function collect(stream: AsyncIterable<Chunk>): Promise<Chunk[]> {
  const chunks: Chunk[] = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

describe("Node client on a real stack", { skip: endpoint ? false : "KVMUX_ENDPOINT not set" }, () => {
  let client: Client;
  before(() => { client = new Client(endpoint, { timeoutMs: 60_000 }); });
  after(() => client.close());

  test("with several endpoints, requests go to the one that serves", async () => {
    // A standby's endpoint where nothing listens (port 1), then the broker's.
    const both = new Client(`tcp://127.0.0.1:1,${endpoint}`, { timeoutMs: 60_000 });
    try {
      const session = await both.openSession({ system: "You are terse.", maxTokens: 2 });
      const chunks = await collect(session.chat("Name a fruit."));
      assert.equal(chunks.reduce((n, c) => n + c.tokenIds.length, 0), 2);
      await session.close();
    } finally {
      await both.close();
    }
  });

  test("a session resumes by id from another client", async () => {
    const session = await client.openSession({ system: "You are terse.", maxTokens: 4 });
    await collect(session.chat("Name a fruit."));
    const before = await session.info({ tokenIds: true });
    const other = new Client(endpoint, { timeoutMs: 60_000 });
    try {
      const resumed = await other.resumeSession(session.id);
      assert.equal(resumed.id, session.id);
      assert.deepEqual((await resumed.info({ tokenIds: true })).tokenIds, before.tokenIds);
      assert.ok((await other.listSessions()).some((s) => s.sessionId === session.id));
      await assert.rejects(other.resumeSession("0".repeat(32)), SessionNotFound);
      await resumed.close();
    } finally {
      await other.close();
    }
  });

  test("multi-turn chat", async () => {
    const session = await client.openSession({ system: "You are terse.", maxTokens: 6, chatTemplateKwargs: { enable_thinking: false } });
    const first = session.chat("Name a colour.");
    const chunks = await collect(first);
    assert.ok(chunks.length > 0 && first.result);
    assert.equal(first.result.completionTokens, chunks.reduce((n, c) => n + c.tokenIds.length, 0));
    const second = session.chat("And another?");
    assert.ok((await second.text()).length > 0 && second.result);
    assert.ok(second.result.promptTokens > 0 && second.result.promptTokens < first.result.historyTokens);
    const info = await session.info({ tokenIds: true });
    assert.equal(info.historyTokens, second.result.historyTokens);
    assert.equal(info.tokenIds?.length, info.historyTokens);
    assert.ok(info.kvLiveBytes > 0);
    await session.close();
  });

  test("priority and traceparent travel with a request; a priority out of bounds is refused", async () => {
    await assert.rejects(client.openSession({ priority: 101 }), InvalidArgument);
    const session = await client.openSession({ system: "You are terse.", maxTokens: 2, priority: 5 });
    const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const stream = session.chat("Name a colour.", { priority: -3, traceparent });
    assert.ok((await stream.text()).length > 0 && stream.result);
    await assert.rejects(collect(session.chat("Another?", { priority: -101 })), InvalidArgument);
    await session.close();
  });

  test("a pinned opening is taken by the next session that starts with it", async () => {
    const rules = Array.from({ length: 8 }, (_, i) => `Rule ${i}: answer questions about shelf ${i} in at most ${i + 3} words.`);
    const system = `You are the assistant of a hardware shop. ${rules.join(" ")}`;
    const pinned = await client.openSession({ system, prefix: "pin", maxTokens: 2 });
    const first = pinned.chat("Hello.");
    await collect(first);
    assert.equal(first.result?.cachedTokens ?? 0, 0);
    await pinned.close();
    const session = await client.openSession({ system, maxTokens: 2 });
    const second = session.chat("What is on shelf 3?");
    await collect(second);
    assert.ok((second.result?.cachedTokens ?? 0) >= 16, JSON.stringify(second.result));
    await session.close();
    await assert.rejects(client.openSession({ system, prefix: "sometimes" }), InvalidArgument);
  });

  test("speculative decoding: lookup drafts give the tokens `off` gives", async () => {
    const text = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.";
    const replies = [];
    for (const speculative of ["off", "lookup"]) {
      const session = await client.openSession({ temperature: 0, maxTokens: 24, speculative });
      const stream = session.chat(text);
      const tokens = (await collect(stream)).flatMap((c) => c.tokenIds);
      replies.push({ tokens, result: stream.result });
      await session.close();
    }
    assert.deepEqual(replies[1].tokens, replies[0].tokens);
    assert.equal(replies[0].result?.draftedTokens ?? 0, 0);
    assert.ok((replies[1].result?.draftedTokens ?? 0) > 0);
  });

  test("break cancels the generation, then the session continues", async () => {
    const session = await client.openSession();
    // Room for ~2 s of decoding: with speculative passes 16 tokens could end before the cancel got in.
    const stream = session.chat("Write a long story about a dragon.", { maxTokens: 256 });
    for await (const _ of stream) break;
    assert.equal(stream.result?.stopReason, "cancelled");
    assert.ok((stream.result?.completionTokens ?? 256) < 256);
    const next = session.chat("Shorter.", { maxTokens: 2 });
    assert.ok((await collect(next)).length > 0);
    assert.notEqual(next.result?.stopReason, "cancelled");
    await session.close();
  });

  test("an AbortSignal cancels mid-stream", async () => {
    const session = await client.openSession();
    const controller = new AbortController();
    const stream = session.chat("Tell me about the sea.", { maxTokens: 16, signal: controller.signal });
    await assert.rejects(async () => {
      for await (const _ of stream) controller.abort();
    }, { name: "AbortError" });
    const next = session.chat("Thanks.", { maxTokens: 2 });
    assert.ok((await collect(next)).length > 0);
    await session.close();
  });

  test("a slow consumer holds at most `credit` chunks", async () => {
    const session = await client.openSession();
    const stream = session.chat("List ten animals.", { maxTokens: 8, credit: 2 });
    await stream.next();
    await sleep(1500); // the worker could have produced ~15 tokens meanwhile
    const buffered = (stream as unknown as { feed: { queue: { items: unknown[] } } }).feed.queue.items.length;
    assert.ok(buffered <= 2, `${buffered} chunks buffered`);
    await collect(stream);
    assert.ok((stream.result?.completionTokens ?? 0) >= 3);
    await session.close();
  });

  test("concurrent sessions from one client", async () => {
    const turn = async (i: number) => {
      const session = await client.openSession();
      const stream = session.chat(`Say the number ${i}.`, { maxTokens: 3 });
      await collect(stream);
      await session.close();
      return stream.result;
    };
    const results = await Promise.all([turn(1), turn(2)]);
    assert.ok(results.every((r) => r && r.completionTokens >= 1));
  });

  test("server conditions raise their error classes", async () => {
    await assert.rejects(client.openSession({ sink: -1 }), InvalidArgument);
    await assert.rejects(client.openSession({ chatTemplateKwargs: { tokenize: true } }), /tokenize/); // apply_chat_template's own option
    await assert.rejects(client.openSession({ chatTemplateKwargs: ["no"] as unknown as Record<string, unknown> }), InvalidArgument);
    const session = await client.openSession();
    await assert.rejects(session.append({}), InvalidArgument);
    // credit holds the generation in flight however fast the worker decodes
    const stream = session.chat("Describe a forest.", { maxTokens: 64, credit: 2 });
    await stream.next();
    const ghost = new Session(client, session.opened); // a second handle on the same id
    await assert.rejects(ghost.append({ tokenIds: [28] }), Busy);
    await stream.return();
    await assert.rejects(client.call("teleport", "", "Ping", {}), UnknownOp);
    await assert.rejects(client.call(Op.STATS, "", "Envelope", [1, "x", 1, ""]), MalformedFrame);

    const appending = session.append({ tokenIds: Array.from({ length: 600 }, (_, i) => 1000 + i) });
    await sleep(300);
    await session.cancel();
    await assert.rejects(appending, Cancelled);

    await session.close();
    await assert.rejects(ghost.info(), (err: KvmuxError) => err instanceof SessionNotFound && err.code === "session_not_found");

    // Idle slabs are hibernated for newcomers: `no_slab` only once every slab
    // runs a generation (each paused here by credit 1, without computing).
    const held: Session[] = [];
    const running: AsyncIterator<Chunk>[] = [];
    await assert.rejects(async () => {
      for (let i = 0; i < 16; i++) {
        const busy = await client.openSession({ admission: "reject" });
        held.push(busy);
        const stream = busy.chat("Tell a very long story.", { maxTokens: 256, credit: 1 })[Symbol.asyncIterator]();
        await stream.next();
        running.push(stream);
      }
    }, (err: KvmuxError) => err instanceof Overloaded && err.reason === "no_slab");
    for (const stream of running) await stream.return?.();
    await Promise.all(held.map((s) => s.close()));

    const dead = new Client("ipc:///tmp/kvmux-nobody-here.ipc", { timeoutMs: 300 });
    await assert.rejects(dead.ping(), Timeout);
    await dead.close();
  });
});
