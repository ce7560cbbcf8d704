// Golden vectors shared with the Python suite (tests/test_vectors.py): each
// one decodes and re-encodes to the same bytes, and its JSON value encodes
// to them too. protocol/vectors/ lives two folders up in the repository.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { camel, decode, encodeStruct, ERROR_CODES, ERRORS, MAP_FIELDS, SCHEMAS } from "../src/index.js";

const here = dirname(fileURLToPath(import.meta.url));
const VECTORS = process.env.KVMUX_VECTORS ?? join(here, "..", "..", "..", "..", "protocol", "vectors");

interface Vector { name: string; file: string; schema: string; value: unknown }
const manifest = JSON.parse(readFileSync(join(VECTORS, "manifest.json"), "utf8")) as { vectors: Vector[] };

/** The manifest's JSON form -> the client's: camelCase keys (but a map
 * field's, which are data), {"$bigint"} -> bigint. */
function fromJson(value: unknown, verbatim = false): unknown {
  if (Array.isArray(value)) return value.map((v) => fromJson(v, verbatim));
  if (value !== null && typeof value === "object") {
    const record = value as Record<string, unknown>;
    if (Object.keys(record).length === 1 && typeof record.$bigint === "string") return BigInt(record.$bigint);
    return Object.fromEntries(
      Object.entries(record).map(([k, v]) => [verbatim ? k : camel(k), fromJson(v, verbatim || MAP_FIELDS.has(k))]),
    );
  }
  return value;
}

test("the manifest covers every schema with a wire form", () => {
  const covered = new Set(manifest.vectors.map((v) => v.schema));
  for (const name of Object.keys(SCHEMAS)) {
    // nested-only structs are covered inside the replies that carry them
    const nested = ["ChatMessage", "Sampling", "WorkerStats", "SessionSummary", "Refused", "Endpoint", "ModelStats",
      "ToolCall", "Tool", "NamedTool", "Format", "Fork", "TokenLogprob", "Logprobs", "ToolCallDelta", "PrefixCounts"];
    if (!nested.includes(name)) assert.ok(covered.has(name), name);
  }
  assert.deepEqual(Object.keys(ERRORS).sort(), [...ERROR_CODES].sort());
});

for (const vector of manifest.vectors) {
  test(`vector ${vector.name}`, () => {
    const raw = new Uint8Array(readFileSync(join(VECTORS, vector.file)));
    const decoded = decode(raw);
    const expected = fromJson(vector.value);
    assert.deepEqual(decoded, expected);
    assert.deepEqual(encodeStruct(vector.schema, decoded as Record<string, unknown>), raw, "decode -> encode");
    assert.deepEqual(encodeStruct(vector.schema, expected as Record<string, unknown>), raw, "JSON value -> encode");
  });
}

test("a map field's keys go on the wire as given", () => {
  const bytes = encodeStruct("OpenSession", { chatTemplateKwargs: { enable_thinking: false } });
  assert.deepEqual(decode(bytes), { chatTemplateKwargs: { enable_thinking: false } });
  assert.ok(Buffer.from(bytes).includes(Buffer.from("enable_thinking")));
});

test("an integral float stays a float64", () => {
  const bytes = encodeStruct("Generate", { temperature: 1 });
  assert.deepEqual([...bytes.subarray(-9)], [0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0]);
});
