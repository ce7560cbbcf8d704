/**
 * msgpack frames byte-identical to the Python side (msgspec).
 *
 * A JS number cannot say whether it is 1 or 1.0, so bodies are encoded field
 * by field from the generated tables in schema.ts: float fields always as
 * float64, ints in their smallest form (bigint beyond 2**53), fields in
 * declaration order, and a field equal to its default omitted, as msgspec's
 * omit_defaults does. Scalars go through @msgpack/msgpack; only map and array
 * headers are written here. Wire names are snake_case; the objects this
 * module takes and returns use camelCase keys (a map field's keys are data,
 * as given).
 */

import { Decoder, Encoder } from "@msgpack/msgpack";
import { PROTOCOL_VERSION, SCHEMAS } from "./schema.js";

export type FieldType =
  | "int" | "float" | "str" | "bool" | "any"
  | { list: FieldType } | { map: FieldType } | { struct: string }
  /** One of several (`str | NamedTool`): the first whose JS kind fits the value. */
  | { union: FieldType[] };
/** [wire name, type] for a required field, [wire name, type, default] otherwise. */
export type Field = [string, FieldType] | [string, FieldType, unknown];
export interface StructTable {
  tag: string | null;
  array: boolean;
  fields: Field[];
}

const plain = new Encoder();
const big = new Encoder({ useBigInt64: true });
const float = new Encoder({ forceIntegerToFloat: true });
const decoder = new Decoder({ useBigInt64: true });

export const camel = (name: string): string => name.replace(/_([a-z0-9])/g, (_m, c: string) => c.toUpperCase());
export const snake = (name: string): string => name.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);

/** A map/array header for `n` entries, its width chosen by `most` (msgspec
 * sizes a Struct's header by its field count, not by the fields present). */
function header(n: number, small: number, h16: number, h32: number, most = n): Uint8Array {
  if (most < 16) return Uint8Array.of(small | n);
  if (most < 0x10000) return Uint8Array.of(h16, n >> 8, n & 0xff);
  const out = new Uint8Array(5);
  out[0] = h32;
  new DataView(out.buffer).setUint32(1, n);
  return out;
}
const mapHeader = (n: number, most: number) => header(n, 0x80, 0xde, 0xdf, most);
const arrayHeader = (n: number) => header(n, 0x90, 0xdc, 0xdd);

function concat(parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

function encodeInt(value: unknown): Uint8Array {
  if (typeof value === "bigint") {
    const n = Number(value);
    return Number.isSafeInteger(n) ? plain.encode(n) : big.encode(value);
  }
  if (typeof value !== "number" || !Number.isInteger(value)) throw new TypeError(`expected an integer, got ${String(value)}`);
  if (!Number.isSafeInteger(value)) throw new TypeError(`${value} is beyond 2**53: pass it as a bigint`);
  return plain.encode(value);
}

/** A free-form value (a template variable): a non-integral number as
 * float64, an integral one as an int (JS cannot say 1.0), object keys as
 * given. */
function encodeAny(value: unknown): Uint8Array {
  if (typeof value === "number" && !Number.isInteger(value)) return float.encode(value);
  if (typeof value === "number" || typeof value === "bigint") return encodeInt(value);
  if (value === null || typeof value === "string" || typeof value === "boolean") return plain.encode(value);
  if (Array.isArray(value)) return concat([arrayHeader(value.length), ...value.map(encodeAny)]);
  if (typeof value === "object" && !(value instanceof Uint8Array)) return encodeMap("any", value as Record<string, unknown>);
  throw new TypeError(`cannot encode ${String(value)}`);
}

function encodeMap(type: FieldType, value: Record<string, unknown>): Uint8Array {
  const entries = Object.entries(value);
  return concat([mapHeader(entries.length, entries.length), ...entries.flatMap(([k, v]) => [plain.encode(k), encodeValue(type, v)])]);
}

/** Whether `value` is of the JS kind `type` takes (its shape is checked when encoded). */
function fits(type: FieldType, value: unknown): boolean {
  if (type === "any") return true;
  if (type === "int" || type === "float") return typeof value === "number" || typeof value === "bigint";
  if (type === "str") return typeof value === "string";
  if (type === "bool") return typeof value === "boolean";
  if ("list" in type) return Array.isArray(value);
  if ("union" in type) return type.union.some((t) => fits(t, value));
  if ("struct" in type && SCHEMAS[type.struct]?.array) return Array.isArray(value);
  return value !== null && typeof value === "object" && !Array.isArray(value) && !(value instanceof Uint8Array);
}

const describe = (type: FieldType): string =>
  typeof type === "string" ? type : "list" in type ? `${describe(type.list)}[]` : "map" in type ? "object"
    : "struct" in type ? type.struct : type.union.map(describe).join(" | ");

function encodeValue(type: FieldType, value: unknown): Uint8Array {
  if (type === "any") return encodeAny(value);
  if (type === "int") return encodeInt(value);
  if (type === "float") {
    if (typeof value !== "number") throw new TypeError(`expected a number, got ${String(value)}`);
    return float.encode(value);
  }
  if (type === "str") {
    if (typeof value !== "string") throw new TypeError(`expected a string, got ${String(value)}`);
    return plain.encode(value);
  }
  if (type === "bool") {
    if (typeof value !== "boolean") throw new TypeError(`expected a boolean, got ${String(value)}`);
    return plain.encode(value);
  }
  if ("list" in type) {
    if (!Array.isArray(value)) throw new TypeError(`expected an array, got ${String(value)}`);
    return concat([arrayHeader(value.length), ...value.map((v) => encodeValue(type.list, v))]);
  }
  if ("union" in type) {
    const member = type.union.find((t) => fits(t, value));
    if (member === undefined) throw new TypeError(`expected ${describe(type)}, got ${JSON.stringify(value) ?? String(value)}`);
    return encodeValue(member, value);
  }
  if ("map" in type) {
    if (value === null || typeof value !== "object" || Array.isArray(value)) throw new TypeError(`expected an object, got ${String(value)}`);
    return encodeMap(type.map, value as Record<string, unknown>);
  }
  if (!fits(type, value)) throw new TypeError(`expected a ${type.struct}, got ${String(value)}`);
  return encodeStruct(type.struct, value as Record<string, unknown>);
}

function isDefault(value: unknown, dflt: unknown): boolean {
  if (value === undefined) return true;
  if (Array.isArray(dflt)) return Array.isArray(value) && value.length === 0 && dflt.length === 0;
  if (dflt !== null && typeof dflt === "object") {
    return typeof value === "object" && value !== null && Object.keys(value).length === 0 && Object.keys(dflt).length === 0;
  }
  if (dflt === null) return value === null;
  return value === dflt || (typeof value === "bigint" && Number(value) === dflt);
}

/** Encode `obj` (camelCase keys) as the Struct `name` of protocol/messages.py;
 * a key that is none of its fields (a typo, a snake_case name) is refused by
 * name rather than dropped. */
export function encodeStruct(name: string, obj: Record<string, unknown> | unknown[]): Uint8Array {
  const table = SCHEMAS[name];
  if (!table) throw new TypeError(`unknown schema ${name}`);
  if (table.array) {
    const values = obj as unknown[];
    return concat([arrayHeader(table.fields.length), ...table.fields.map((f, i) => encodeValue(f[1], values[i] ?? f[2]))]);
  }
  const record = obj as Record<string, unknown>;
  for (const key of Object.keys(record)) {
    if (record[key] === undefined || (key === "type" && table.tag !== null) || table.fields.some((f) => camel(f[0]) === key)) continue;
    const known = table.fields.find((f) => f[0] === key || camel(f[0]).toLowerCase() === key.toLowerCase());
    throw new TypeError(`${name} has no field ${JSON.stringify(key)}${known ? ` (did you mean ${camel(known[0])}?)` : ""}`);
  }
  const parts: Uint8Array[] = [];
  let count = 0;
  if (table.tag !== null) {
    parts.push(plain.encode("type"), plain.encode(table.tag));
    count++;
  }
  for (const field of table.fields) {
    const [wire, type] = field;
    const value = record[camel(wire)];
    if (field.length === 2) {
      if (value === undefined || value === null) throw new TypeError(`${name}.${camel(wire)} is required`);
    } else if (isDefault(value, field[2])) {
      continue;
    }
    parts.push(plain.encode(wire), encodeValue(type, value));
    count++;
  }
  return concat([mapHeader(count, table.fields.length + (table.tag === null ? 0 : 1)), ...parts]);
}

/** Wire names of the fields that hold maps: their keys are data (template
 * variables), never camelCased. */
export const MAP_FIELDS: ReadonlySet<string> = new Set(
  Object.values(SCHEMAS).flatMap((t) => t.fields.filter((f) => typeof f[1] === "object" && "map" in f[1]).map((f) => f[0])),
);

/** Ints msgpack carried as 64-bit come back as bigint: numbers where exact. */
function normalize(value: unknown, verbatim = false): unknown {
  if (typeof value === "bigint") {
    const n = Number(value);
    return Number.isSafeInteger(n) ? n : value;
  }
  if (Array.isArray(value)) return value.map((v) => normalize(v, verbatim));
  if (value !== null && typeof value === "object" && !(value instanceof Uint8Array)) {
    return Object.fromEntries(
      Object.entries(value).map(([k, v]) => [verbatim ? k : camel(k), normalize(v, verbatim || MAP_FIELDS.has(k))]),
    );
  }
  return value;
}

/** Decode any kvmux body to plain JS (camelCase keys, safe ints as numbers). */
export function decode(raw: Uint8Array): unknown {
  return normalize(decoder.decode(raw));
}

/** The tagged reply Structs by their `type` tag. */
export const REPLY_TAGS: Record<string, string> = Object.fromEntries(
  Object.entries(SCHEMAS)
    .filter(([, t]) => t.tag !== null)
    .map(([name, t]) => [t.tag as string, name]),
);

export type EnvelopeTuple = [version: number, op: string, requestId: number, sessionId: string];

export function envelope(op: string, requestId: number, sessionId = ""): Uint8Array {
  return encodeStruct("Envelope", [PROTOCOL_VERSION, op, requestId, sessionId]);
}

export function decodeEnvelope(raw: Uint8Array): EnvelopeTuple {
  const env = decode(raw);
  if (!Array.isArray(env) || env.length < 3 || typeof env[1] !== "string") throw new TypeError("bad envelope");
  if (env[0] !== PROTOCOL_VERSION) throw new TypeError(`protocol version ${String(env[0])} not supported`);
  return [env[0], env[1], Number(env[2]), typeof env[3] === "string" ? env[3] : ""];
}
