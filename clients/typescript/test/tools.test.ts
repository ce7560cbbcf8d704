// Tools, structured output, logprobs and rewind. The option checks run anywhere; the
// stack suite needs a real kvmux stack at KVMUX_ENDPOINT (the embedded model):
// tests/test_node_client.py starts one and runs this file on it.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  Client, decode, encodeStruct, InvalidArgument, Session,
  type Chunk, type GenerateOptions, type ResponseFormat, type Tool, type ToolCall,
} from "../src/index.js";

const endpoint = process.env.KVMUX_ENDPOINT;

async function collect(stream: AsyncIterable<Chunk>): Promise<Chunk[]> {
  const chunks: Chunk[] = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

const WEATHER: Tool = {
  name: "get_weather",
  description: "The current weather in a city.",
  parameters: {
    type: "object",
    properties: { city: { type: "string", maxLength: 24 } },
    required: ["city"],
    additionalProperties: false,
  },
};

const PERSON: ResponseFormat = {
  type: "json_schema",
  schema: {
    type: "object",
    properties: { name: { type: "string", maxLength: 24 }, age: { type: "integer", minimum: 0, maximum: 150 } },
    required: ["name", "age"],
    additionalProperties: false,
  },
};

describe("options, offline", () => {
  let client: Client;
  let session: Session;
  before(() => {
    client = new Client("ipc:///tmp/kvmux-nobody-here.ipc", { timeoutMs: 300 });
    session = new Session(client, { type: "opened", sessionId: "0".repeat(32), workerId: "w", model: "m", sink: 4, window: 64, slabBytes: 1 });
  });
  after(() => client.close());

  test("the new options go on the wire in snake_case, the tool choice as a string or {name}", () => {
    const body = {
      format: PERSON, toolChoice: { name: "get_weather" }, parallelToolCalls: false, logprobs: 2,
      messages: [{ role: "tool", toolCallId: "call_1", name: "get_weather", content: "{\"sky\": \"clear\"}" }],
    };
    const bytes = Buffer.from(encodeStruct("Generate", body));
    for (const wire of ["tool_choice", "parallel_tool_calls", "logprobs", "tool_call_id", "additionalProperties", "maxLength"]) {
      assert.ok(bytes.includes(Buffer.from(wire)), wire);
    }
    assert.deepEqual(decode(bytes), body); // a JSON schema's keys are data: as given
    assert.deepEqual(decode(encodeStruct("Sampling", { toolChoice: "required" })), { toolChoice: "required" });
    assert.throws(() => encodeStruct("Sampling", { toolChoice: 3 }), /expected str \| NamedTool/);
    const tools = decode(encodeStruct("OpenSession", { tools: [WEATHER, { name: "now" }] })) as { tools: Tool[] };
    assert.deepEqual(tools.tools, [WEATHER, { name: "now" }]);
  });

  test("an assistant message may carry tool calls and no content", () => {
    const call: ToolCall = { id: "call_1", name: "get_weather", arguments: "{\"city\": \"Paris\"}" };
    const message = { role: "assistant", toolCalls: [call] };
    assert.deepEqual(decode(encodeStruct("ChatMessage", message)), message);
  });

  test("unknown options are refused by name", async () => {
    await assert.rejects(client.openSession({ bogus: 1 } as never), (err: Error) => err instanceof InvalidArgument && /"bogus"/.test(err.message));
    await assert.rejects(
      client.openSession({ tool_choice: "required" } as never),
      (err: Error) => err instanceof InvalidArgument && /"tool_choice".*toolChoice/.test(err.message),
    );
    assert.throws(() => session.generate({ parallel_tool_calls: false } as never), /"parallel_tool_calls".*parallelToolCalls/);
    assert.throws(() => session.chat("Hi", { logprob: 2 } as never), InvalidArgument);
    await assert.rejects(session.append({ tools: [] } as never), InvalidArgument);
    // inside a message, a tool or a format: the codec refuses the key by name
    assert.throws(
      () => encodeStruct("ChatMessage", { role: "tool", tool_call_id: "call_1", content: "18C" }),
      /ChatMessage has no field "tool_call_id" \(did you mean toolCallId\?\)/,
    );
    assert.throws(() => encodeStruct("Format", { type: "regex", pattern: "a+" }), /Format has no field "pattern"/);
    // and the compiler refuses what it can
    // @ts-expect-error: not a tool choice
    const bad: GenerateOptions = { toolChoice: "sometimes", format: { type: "json_schema" } };
    // @ts-expect-error: not a format type
    const worse: GenerateOptions = { format: { type: "yaml" } };
    assert.ok(bad && worse);
  });
});

describe("tools, structured output and logprobs on a real stack", { skip: endpoint ? false : "KVMUX_ENDPOINT not set" }, () => {
  let client: Client;
  before(() => { client = new Client(endpoint, { timeoutMs: 60_000 }); });
  after(() => client.close());

  test("a json_schema format: the reply parses, with its fields' types", async () => {
    const session = await client.openSession();
    const stream = session.chat("Invent a person. Reply with their name and age as JSON.", { format: PERSON, maxTokens: 64 });
    const text = await stream.text();
    const reply = JSON.parse(text) as Record<string, unknown>;
    assert.deepEqual(Object.keys(reply).sort(), ["age", "name"], text);
    assert.equal(typeof reply.name, "string", text);
    assert.ok(Number.isInteger(reply.age), text);
    assert.notEqual(stream.result?.stopReason, "max_tokens", text);
    await session.close();
  });

  test("tool_choice required: one get_weather call, streamed as deltas; its result gets a text reply", async () => {
    const session = await client.openSession({ system: "You are a helpful assistant.", tools: [WEATHER] });
    const stream = session.chat("What is the weather like in Paris?", { toolChoice: "required", parallelToolCalls: false, maxTokens: 64 });
    const chunks = await collect(stream);
    const result = stream.result;
    assert.ok(result, "no result");
    assert.equal(result.stopReason, "tool_calls");
    assert.equal(result.toolCalls?.length, 1, JSON.stringify(result));
    const [call] = result.toolCalls ?? [];
    assert.equal(call.name, "get_weather");
    assert.ok(call.id.length > 0);
    const args = JSON.parse(call.arguments) as Record<string, unknown>;
    assert.equal(typeof args.city, "string", call.arguments);

    const deltas = chunks.flatMap((c) => c.toolCalls ?? []);
    assert.ok(deltas.length > 0, "no toolCalls deltas streamed");
    assert.ok(deltas.every((d) => d.index === 0));
    assert.equal(deltas.find((d) => d.id !== undefined)?.id, call.id);
    assert.equal(deltas.find((d) => d.name !== undefined)?.name, call.name);
    assert.equal(deltas.map((d) => d.arguments ?? "").join(""), call.arguments);
    // the call's text streamed as deltas, not as text
    assert.equal(chunks.map((c) => c.text).join("").trim(), (result.content ?? "").trim());

    const answer = session.generate({
      messages: [{ role: "tool", toolCallId: call.id, name: call.name, content: JSON.stringify({ temperature_c: 18, sky: "clear" }) }],
      toolChoice: "none",
      maxTokens: 32,
    });
    const chunks2 = await collect(answer);
    const text = chunks2.map((c) => c.text).join("");
    assert.ok(text.trim().length > 0, "no text reply");
    assert.notEqual(answer.result?.stopReason, "tool_calls");
    assert.equal(answer.result?.toolCalls?.length ?? 0, 0);
    assert.ok(chunks2.every((c) => (c.toolCalls ?? []).length === 0));
    await session.close();
  });

  test("logprobs 2: each token's logprob and its 2 most likely, greedy's choice on top", async () => {
    const session = await client.openSession({ temperature: 0 });
    const stream = session.chat("Name three colours.", { logprobs: 2, maxTokens: 12 });
    const chunks = await collect(stream);
    assert.ok(chunks.length > 0);
    for (const chunk of chunks) {
      const logprobs = chunk.logprobs ?? [];
      assert.equal(logprobs.length, chunk.tokenIds.length, JSON.stringify(chunk));
      logprobs.forEach((lp, i) => {
        assert.equal(lp.token, chunk.tokenIds[i]);
        assert.ok(lp.logprob <= 0, `${lp.logprob}`);
        assert.equal(typeof lp.text, "string");
        const top = lp.top ?? [];
        assert.equal(top.length, 2, JSON.stringify(lp));
        for (const [token, logprob, text] of top) {
          assert.ok(Number.isInteger(token) && logprob <= 0 && typeof text === "string", JSON.stringify(top));
        }
        assert.ok(top[0][1] >= top[1][1], JSON.stringify(top));
        assert.equal(top[0][0], lp.token, `greedy chose ${lp.token}, top-1 is ${top[0][0]}`);
        assert.ok(Math.abs(top[0][1] - lp.logprob) < 1e-4, JSON.stringify(lp));
      });
    }
    assert.equal(chunks.reduce((n, c) => n + (c.logprobs?.length ?? 0), 0), stream.result?.completionTokens);
    await session.close();
  });
  test("rewind: a regenerate takes the last reply back and prefills only the kept token and the prompt", async () => {
    const session = await client.openSession({ temperature: 0, maxTokens: 8 });
    await collect(session.chat("Name a colour."));
    const first = session.chat("Name a fruit.");
    const text = (await collect(first)).map((c) => c.text).join("");
    const rewound = await session.rewind(3); // user, assistant, user: before the last reply
    assert.equal(rewound.messages, 3);
    assert.equal(rewound.pendingTokens, 1);
    assert.equal(rewound.keptTokens + 1, rewound.historyTokens);
    const again = session.generate({});
    assert.equal((await collect(again)).map((c) => c.text).join(""), text);
    assert.ok((again.result?.promptTokens ?? 99) < 10, JSON.stringify(again.result));
    await assert.rejects(session.rewind(7), (err: Error) => err instanceof InvalidArgument && /no turn/.test(err.message));
    await session.close();
  });
  test("mark and find: named points live with the session; a rewind forgets those past it", async () => {
    const session = await client.openSession({ temperature: 0, maxTokens: 4 });
    await collect(session.chat("Name a colour."));
    await collect(session.chat("Name a fruit."));
    const marked = await session.mark({ resp_first: 2, end_here: 0 }, { notes: { resp_first: "{\"k\": 1}" }, fromEnd: true });
    assert.equal(marked.marks, 2);
    const info = await session.info({ marks: ["resp_first", "end_here", "unknown"] });
    assert.deepEqual(info.marks, { resp_first: 2, end_here: 4 });
    assert.deepEqual(info.notes, { resp_first: "{\"k\": 1}" });
    assert.deepEqual(await client.find(["unknown", "end_here"]), { type: "found", name: "end_here", sessionId: session.id });
    assert.equal(await client.find(["unknown"]), null);
    await session.rewind(2);
    assert.deepEqual((await session.info({ marks: ["resp_first", "end_here"] })).marks, { resp_first: 2 });
    await assert.rejects(session.mark({ later: 9 }), (err: Error) => err instanceof InvalidArgument && /holds 2/.test(err.message));
    await assert.rejects(session.mark({}, { note: {} } as never), /unknown option "note"/);
    await session.close();
  });
  test("fork: a copy taken back to an earlier turn, prefilling nothing again", async () => {
    const session = await client.openSession({ temperature: 0, maxTokens: 4 });
    await collect(session.chat("Name a colour."));
    await collect(session.chat("Name a fruit."));
    const branch = await session.fork(2);
    assert.notEqual(branch.id, session.id);
    assert.equal((await branch.info()).messages, 2);
    assert.equal((await session.info()).messages, 4);
    const stream = branch.chat("Name a city.");
    await collect(stream);
    assert.ok((stream.result?.promptTokens ?? 99) < 20, JSON.stringify(stream.result));
    await assert.rejects(session.fork(5), (err: Error) => err instanceof InvalidArgument && /no turn/.test(err.message));
    await branch.close();
    await session.close();
  });
});
