// The Node client over CURVE against a real stack whose tcp frontend checks
// client keys. tests/test_node_client.py starts one (`Stack(curve=True)`) and
// sets KVMUX_ENDPOINT, KVMUX_SERVER_KEY (z85), KVMUX_PUBLIC_KEY and
// KVMUX_SECRET_KEY (an allowed client key), KVMUX_OTHER_PUBLIC_KEY and
// KVMUX_OTHER_SECRET_KEY (a second allowed key). Skipped without KVMUX_SERVER_KEY.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { curveKeyPair } from "zeromq";

import { Client, Forbidden, InvalidArgument, SessionNotFound, Timeout, type Chunk } from "../src/index.js";

const env = process.env;
const endpoint = env.KVMUX_ENDPOINT;
const serverKey = env.KVMUX_SERVER_KEY;

async function collect(stream: AsyncIterable<Chunk>): Promise<Chunk[]> {
  const chunks: Chunk[] = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

/** A call on `client` fails with Timeout, within about its timeout, and the message matches `why`. */
async function silent(client: Client, why: RegExp): Promise<void> {
  const started = Date.now();
  try {
    await assert.rejects(client.ping(), (err: Error) => {
      assert.ok(err instanceof Timeout, `${err.name}: ${err.message}`);
      assert.match(err.message, why);
      assert.ok(err.message.includes(endpoint as string), err.message);
      return true;
    });
    assert.ok(Date.now() - started < client.timeoutMs + 1500, `${Date.now() - started} ms`);
  } finally {
    await client.close();
  }
}

describe("Node client over CURVE", { skip: serverKey ? false : "KVMUX_SERVER_KEY not set" }, () => {
  let client: Client;
  before(() => {
    client = new Client(endpoint, { serverKey, publicKey: env.KVMUX_PUBLIC_KEY, secretKey: env.KVMUX_SECRET_KEY, timeoutMs: 60_000 });
  });
  after(() => client.close());

  test("an allowed key chats: open, chat, info, close", async () => {
    assert.ok(client.curve);
    const session = await client.openSession({ system: "You are terse.", maxTokens: 4 });
    const stream = session.chat("Name a fruit.");
    assert.ok((await collect(stream)).length > 0 && stream.result);
    const info = await session.info({ tokenIds: true });
    assert.equal(info.historyTokens, stream.result.historyTokens);
    assert.equal(info.tokenIds?.length, info.historyTokens);
    assert.ok((await session.close())?.type === "closed");
  });

  test("another allowed key cannot resume the first key's session", async () => {
    const session = await client.openSession({ maxTokens: 2 });
    // secretKey alone: its public key is derived from it
    const other = new Client(endpoint, { serverKey, secretKey: env.KVMUX_OTHER_SECRET_KEY, timeoutMs: 60_000 });
    try {
      assert.ok((await other.ping()).type === "pong", "the other key is allowed");
      await assert.rejects(other.resumeSession(session.id), SessionNotFound);
      // the owner still can, from a second connection with the same key
      const again = new Client(endpoint, { serverKey, secretKey: env.KVMUX_SECRET_KEY, timeoutMs: 60_000 });
      try {
        const resumed = await again.resumeSession(session.id);
        assert.equal(resumed.id, session.id);
        resumed.detach();
      } finally {
        await again.close();
      }
      // and keys in any form: the other key's pair as given, z85 public beside secret
      const explicit = new Client(endpoint, {
        serverKey, publicKey: env.KVMUX_OTHER_PUBLIC_KEY, secretKey: env.KVMUX_OTHER_SECRET_KEY, timeoutMs: 60_000,
      });
      try {
        await assert.rejects(explicit.resumeSession(session.id), SessionNotFound);
      } finally {
        await explicit.close();
      }
    } finally {
      await other.close();
      await session.close();
    }
  });

  test("a wrong server key fails fast with Timeout naming the server key", async () => {
    const wrong = curveKeyPair().publicKey;
    await silent(new Client(endpoint, { serverKey: wrong, secretKey: env.KVMUX_SECRET_KEY, timeoutMs: 2000 }), /server key/);
  });

  test("a client key the broker does not allow gets no answer", async () => {
    const stranger = curveKeyPair();
    await silent(new Client(endpoint, { serverKey, ...stranger, timeoutMs: 2000 }), /server key right, and is our key allowed/);
  });

  test("no keys on a CURVE endpoint: Timeout asking for serverKey", async () => {
    await silent(new Client(endpoint, { timeoutMs: 2000 }), /CURVE keys \(serverKey\)/);
  });

  test("bad keys are refused before connecting", () => {
    assert.throws(() => new Client(endpoint, { serverKey: "not-a-key" }), InvalidArgument);
    assert.throws(() => new Client(endpoint, { serverKey: (serverKey as string).slice(1) }), InvalidArgument);
    assert.throws(() => new Client(endpoint, { serverKey, secretKey: "~".repeat(40) }), InvalidArgument);
    assert.throws(() => new Client(endpoint, { secretKey: env.KVMUX_SECRET_KEY }), /need serverKey/);
    assert.throws(
      () => new Client(endpoint, { serverKey, publicKey: env.KVMUX_OTHER_PUBLIC_KEY, secretKey: env.KVMUX_SECRET_KEY }),
      /not secretKey's public key/,
    );
  });

  test("drain from an ordinary key is Forbidden", async () => {
    await assert.rejects(client.drain({ graceS: 1 }), Forbidden);
    assert.ok((await client.ping()).type === "pong", "the daemon still serves");
  });
});
