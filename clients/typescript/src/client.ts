/**
 * The Node client: one zeromq.js Dealer per Client, one read loop that
 * demultiplexes replies by request id, sends serialized (zeromq.js allows
 * one send in flight per socket). Streams use the protocol's credit flow
 * control, so a slow consumer holds at most `credit` chunks in memory.
 */

import { curveKeyPair, Dealer } from "zeromq";

import { camel, decode, decodeEnvelope, encodeStruct, envelope, REPLY_TAGS } from "./codec.js";
import { fromReply, Internal, InvalidArgument, KvmuxError, MalformedFrame, SessionNotFound, Timeout } from "./errors.js";
import { clientKeys } from "./keys.js";
import { defaultFrontend } from "./paths.js";
import { Queue } from "./queue.js";
import {
  Op,
  SCHEMAS,
  type Ack,
  type Appended,
  type BrokerStats,
  type ChatMessage,
  type Chunk,
  type Closed,
  type Drain,
  type ErrorReply,
  type Format,
  type FORMAT_TYPES,
  type GenerateResult,
  type NamedTool,
  type OpenSession,
  type Pong,
  type Reply,
  type Rewound,
  type Sampling,
  type SessionInfo,
  type Marked,
  type Found,
  type SessionList,
  type SessionOpened,
  type SessionSummary,
  type TOOL_CHOICES,
} from "./schema.js";

export const DEFAULT_TIMEOUT_MS = 30_000;
/** Chunks the worker may send ahead of the consumer; half is granted back at a time. */
export const DEFAULT_CREDIT = 32;

export interface CallOptions {
  /** Bounds this call (a stream: each frame). Defaults to the client's. */
  timeoutMs?: number;
}
export interface ClientOptions {
  timeoutMs?: number;
  /** The broker's CURVE public key (z85, 40 characters, or the path of its
   * `server.key` file): turns CURVE on (authenticated, encrypted). */
  serverKey?: string;
  /** This client's CURVE public key (z85 or a `NAME.key` path); optional:
   * `secretKey` supplies it. */
  publicKey?: string;
  /** This client's CURVE secret key (z85 or a `NAME.key_secret` path, which
   * holds both keys). Without it, a throwaway key pair: a broker that checks
   * client keys refuses it. */
  secretKey?: string;
}
/** Format.type: what structured output a reply must be. */
export type FormatType = (typeof FORMAT_TYPES)[number];
/** Sampling.format: `{ type: "json_schema", schema }`, `{ type: "json_object" }`,
 * `{ type: "lark" | "gbnf" | "regex", grammar }`. */
export interface ResponseFormat extends Format {
  type: FormatType;
}
/** Sampling.toolChoice: the model chooses (`auto`, the default), no calls
 * (`none`), at least one call (`required`), or that function (`{ name }`). */
export type ToolChoice = (typeof TOOL_CHOICES)[number] | NamedTool;
/** Sampling's fields, with `format` and `toolChoice` narrowed to their values. */
export interface SamplingOptions extends Omit<Sampling, "format" | "toolChoice"> {
  format?: ResponseFormat;
  toolChoice?: ToolChoice;
}
/** OpenSession's fields; `sampling` holds the session's defaults, and the flat
 * sampling keys (maxTokens, temperature, format, toolChoice, ...) are merged into it. */
export interface OpenOptions extends CallOptions, SamplingOptions, Omit<OpenSession, "sampling"> {
  sampling?: SamplingOptions;
}
export interface GenerateOptions extends CallOptions, SamplingOptions {
  messages?: ChatMessage[];
  /** 0 turns flow control off. */
  credit?: number;
  /** Aborting cancels the generation on the worker; the pending `next()` rejects with the signal's reason. */
  signal?: AbortSignal;
  /** The caller's span as a W3C traceparent: the daemon's spans for this generation join its trace. */
  traceparent?: string;
}
export interface AppendOptions extends CallOptions {
  messages?: ChatMessage[];
  tokenIds?: number[];
}

const SAMPLING_KEYS = [
  "maxTokens", "temperature", "topP", "topK", "seed", "stop", "speculative",
  "format", "toolChoice", "parallelToolCalls", "logprobs", "priority",
] as const satisfies readonly (keyof Sampling)[];

const fieldNames = (schema: string): string[] => SCHEMAS[schema].fields.map((f) => camel(f[0]));
const OPEN_KEYS = new Set([...fieldNames("OpenSession"), ...SAMPLING_KEYS, "timeoutMs"]);
const GENERATE_KEYS = new Set([...SAMPLING_KEYS, "messages", "credit", "signal", "timeoutMs", "traceparent"]);
const APPEND_KEYS = new Set(["messages", "tokenIds", "timeoutMs"]);
const CALL_KEYS = new Set(["timeoutMs"]);
const MARK_KEYS = new Set(["timeoutMs", "notes", "drop", "fromEnd"]);
const INFO_KEYS = new Set(["timeoutMs", "tokenIds", "marks"]);

/** Refuse, by name, an option the call does not take (a typo, a snake_case
 * name): dropping it silently would send a different request. */
function checkOptions(options: object, known: ReadonlySet<string>, call: string): void {
  for (const [key, value] of Object.entries(options)) {
    if (value === undefined || known.has(key)) continue;
    const meant = [...known].find((k) => k === camel(key) || k.toLowerCase() === key.toLowerCase());
    throw new InvalidArgument(`${call}: unknown option ${JSON.stringify(key)}${meant ? ` (did you mean ${meant}?)` : ""}`);
  }
}

interface Frame {
  op: string;
  requestId: number;
  sessionId: string;
  body: Reply | KvmuxError;
}

function unwrap<T>(frame: Frame): T {
  const body = frame.body;
  if (body instanceof KvmuxError) throw body;
  if (body.type === "error") throw fromReply(body as ErrorReply, frame.requestId, frame.sessionId);
  return body as T;
}

function pickSampling(options: SamplingOptions): Sampling {
  const out: Record<string, unknown> = {};
  for (const key of SAMPLING_KEYS) if (options[key] !== undefined) out[key] = options[key];
  return out as Sampling;
}

export class Client {
  readonly endpoint: string;
  readonly timeoutMs: number;
  /** Whether the connection uses CURVE (`serverKey` was given). */
  readonly curve: boolean;
  private readonly socket: Dealer;
  private readonly calls = new Map<number, Queue<Frame>>();
  private readonly sessions = new Set<Session>();
  private readonly reader: Promise<void>;
  private sending: Promise<unknown> = Promise.resolve();
  private nextId = 1;
  private closed = false;
  private heard = false; // any frame from the broker yet: a silent one may have refused our keys

  constructor(endpoint?: string, options: ClientOptions = {}) {
    this.endpoint = endpoint ?? defaultFrontend();
    this.timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    const keys = clientKeys(options, curveKeyPair); // throws InvalidArgument before any socket exists
    this.curve = keys !== undefined;
    // Several endpoints, comma-separated: a broker and its standbys on a
    // shared session store, one serving at a time; requests go to whichever
    // is connected (immediate) and wait, up to their timeout, while none is.
    const endpoints = this.endpoint.split(",").map((e) => e.trim()).filter((e) => e);
    this.socket = new Dealer({ linger: 0, sendTimeout: this.timeoutMs, immediate: endpoints.length > 1, ...keys });
    for (const endpoint of endpoints) this.socket.connect(endpoint);
    this.reader = this.read();
    this.heartbeat(); // we answer the broker's heartbeats: it may judge us by our silence
  }

  async openSession(options: OpenOptions = {}): Promise<Session> {
    checkOptions(options, OPEN_KEYS, "openSession");
    const { system, tools, chatTemplateKwargs, sink, window, admission, queueWaitS, clientName, fork, prefix, traceparent, model } = options;
    if (chatTemplateKwargs !== undefined && (chatTemplateKwargs === null || typeof chatTemplateKwargs !== "object" || Array.isArray(chatTemplateKwargs))) {
      throw new InvalidArgument("chatTemplateKwargs must be an object: template variable -> value");
    }
    const sampling = { ...options.sampling, ...pickSampling(options) };
    const body = {
      system, tools, chatTemplateKwargs, sink, window, admission, queueWaitS, clientName, fork, prefix, traceparent, model,
      sampling: Object.keys(sampling).length ? sampling : undefined,
    };
    // A queued open may legitimately wait queueWaitS before its answer.
    const timeoutMs = (options.timeoutMs ?? this.timeoutMs) + (queueWaitS ?? 0) * 1000;
    const opened = await this.call<SessionOpened>(Op.OPEN, "", "OpenSession", body, timeoutMs);
    const session = new Session(this, opened);
    this.sessions.add(session);
    return session;
  }

  /** A session object for an existing session id, opened by any connection;
   * rejects with SessionNotFound, SessionExpired or SessionCorrupt. */
  async resumeSession(sessionId: string, options: CallOptions = {}): Promise<Session> {
    const opened = await this.call<SessionOpened>(Op.RESUME, sessionId, "Resume", {}, options.timeoutMs);
    const session = new Session(this, opened);
    this.sessions.add(session);
    return session;
  }

  /** Every session the daemon keeps, live (in a slab) and hibernated (in its store). */
  /** Your session that has one of `names` (Session.mark), the first of them
   * any has: {name, sessionId}; null when none has any. */
  async find(names: string[], options: CallOptions = {}): Promise<Found | null> {
    checkOptions(options, CALL_KEYS, "find");
    try {
      return await this.call<Found>(Op.FIND, "", "Find", { names }, options.timeoutMs);
    } catch (err) {
      if (err instanceof SessionNotFound) return null;
      throw err;
    }
  }

  async listSessions(options: CallOptions = {}): Promise<SessionSummary[]> {
    const list = await this.call<SessionList>(Op.SESSIONS, "", "ListSessions", {}, options.timeoutMs);
    return list.sessions;
  }

  stats(options: CallOptions = {}): Promise<BrokerStats> {
    return this.call(Op.STATS, "", "Stats", {}, options.timeoutMs);
  }

  ping(options: CallOptions = {}): Promise<Pong> {
    return this.call(Op.PING, "", "Ping", {}, options.timeoutMs);
  }

  /** Ask the broker to stop admitting sessions and shut down gracefully
   * (an admin op: an ordinary key is refused with Forbidden). */
  drain(options: CallOptions & Drain = {}): Promise<Ack> {
    return this.call(Op.DRAIN, "", "Drain", { graceS: options.graceS }, options.timeoutMs);
  }

  /** Close this client's open sessions (best effort), then the socket. */
  async close(): Promise<void> {
    if (this.closed) return;
    for (const session of [...this.sessions]) {
      await session.close({ timeoutMs: Math.min(this.timeoutMs, 2000) }).catch(() => undefined);
    }
    this.closed = true;
    for (const [requestId, queue] of this.calls) {
      queue.push({ op: Op.ERROR, requestId, sessionId: "", body: new KvmuxError("client is closed") });
    }
    this.calls.clear();
    this.socket.close();
    await this.reader;
  }

  // ------------------------------------------------------------ internals

  /** @internal */
  forget(session: Session): void {
    this.sessions.delete(session);
  }

  /** Our heartbeat: the answer to each of the broker's (its probes whether
   * we are still here), and our first frame, saying that we answer them. */
  private heartbeat(): void {
    this.post([envelope(Op.HEARTBEAT, 0), encodeStruct("Ping", {})]).catch(() => undefined);
  }

  private post(frames: Uint8Array[]): Promise<unknown> {
    const sent = this.sending.then(() => this.socket.send(frames));
    this.sending = sent.catch(() => undefined);
    return sent;
  }

  /** @internal Send a request and return its id and reply queue. */
  async request(op: string, sessionId: string, schema: string, body: object): Promise<[number, Queue<Frame>]> {
    if (this.closed) throw new KvmuxError("client is closed");
    const requestId = this.nextId++;
    const frames = [envelope(op, requestId, sessionId), encodeStruct(schema, body as Record<string, unknown>)];
    const queue = new Queue<Frame>();
    this.calls.set(requestId, queue);
    try {
      await this.post(frames);
    } catch (err) {
      this.calls.delete(requestId);
      const hint = this.silence();
      throw new Timeout(`could not send ${op} to ${this.endpoint}: ${String(err)}${hint ? `: ${hint}` : ""}`, {
        requestId,
        sessionId,
      });
    }
    return [requestId, queue];
  }

  /** @internal A frame no reply is awaited for (cancel, credit). */
  fire(op: string, sessionId: string, schema: string, body: object): void {
    if (this.closed) return;
    const frames = [envelope(op, this.nextId++, sessionId), encodeStruct(schema, body as Record<string, unknown>)];
    this.post(frames).catch(() => undefined);
  }

  /** @internal */
  wait(requestId: number, queue: Queue<Frame>, timeoutMs: number | undefined, what: string, sessionId = "", signal?: AbortSignal): Promise<Frame> {
    const ms = timeoutMs ?? this.timeoutMs;
    return queue.shift(ms, () => {
      this.calls.delete(requestId);
      const hint = this.silence();
      const message = hint ? `no answer from ${this.endpoint} within ${ms / 1000}s: ${hint}` : `no reply to ${what} within ${ms} ms`;
      return new Timeout(message, { requestId, sessionId: sessionId || undefined });
    }, signal);
  }

  /** Why a broker never heard from may be silent: a failed CURVE handshake
   * looks, from here, just like a broker that is not there. */
  private silence(): string {
    if (this.heard) return "";
    if (this.curve) return "is the server key right, and is our key allowed?";
    if (this.endpoint.startsWith("tcp://")) return "is it running, and does the server require CURVE keys (serverKey)?";
    return "";
  }

  /** @internal */
  async call<T>(op: string, sessionId: string, schema: string, body: object, timeoutMs?: number): Promise<T> {
    const [requestId, queue] = await this.request(op, sessionId, schema, body);
    return unwrap<T>(await this.wait(requestId, queue, timeoutMs, op, sessionId));
  }

  private async read(): Promise<void> {
    try {
      for await (const [env, body] of this.socket) this.dispatch(env, body);
    } catch (err) {
      if (!this.closed) throw err;
    }
  }

  private dispatch(env: Uint8Array, raw: Uint8Array | undefined): void {
    this.heard = true;
    let op: string, requestId: number, sessionId: string;
    try {
      [, op, requestId, sessionId] = decodeEnvelope(env);
    } catch {
      return; // not even an envelope: nobody to tell
    }
    if (op === Op.HEARTBEAT) return this.heartbeat(); // the broker's probe whether we are still here
    const queue = this.calls.get(requestId);
    if (!queue) return; // timed out or cancelled meanwhile
    if (op !== Op.PARTIAL) this.calls.delete(requestId);
    let body: Reply | KvmuxError;
    try {
      body = decode(raw ?? new Uint8Array()) as Reply;
      if (typeof body !== "object" || body === null || !(body.type in REPLY_TAGS)) throw new TypeError("unknown reply type");
    } catch (err) {
      body = new MalformedFrame(`bad reply body: ${String(err)}`, { requestId, sessionId });
    }
    queue.push({ op, requestId, sessionId, body });
  }
}

export class Session {
  readonly id: string;
  private feed?: Feed;
  private closed = false;

  constructor(readonly client: Client, readonly opened: SessionOpened) {
    this.id = opened.sessionId;
  }

  /** Keep the session in the daemon when this client closes (a client's
   * close() closes the sessions it opened or resumed); resume it later by id. */
  detach(): void {
    this.client.forget(this);
  }

  /** Append a user message and generate the reply, in one round trip. */
  chat(text: string, options: GenerateOptions = {}): ChatStream {
    return this.generate({ ...options, messages: [...(options.messages ?? []), { role: "user", content: text }] });
  }

  /** Stream a generation; the request goes out on the first `next()`. */
  generate(options: GenerateOptions = {}): ChatStream {
    checkOptions(options, GENERATE_KEYS, "generate");
    return new ChatStream(this, options);
  }

  async append(options: AppendOptions): Promise<Appended> {
    checkOptions(options, APPEND_KEYS, "append");
    await this.settle();
    const body = { messages: options.messages ?? [], tokenIds: options.tokenIds ?? [] };
    return this.client.call(Op.APPEND, this.id, "Append", body, options.timeoutMs);
  }

  /** Take the session back to the end of the turn where its conversation held
   * `messages` messages (regenerate: the count before the last reply; edit the
   * last message: before it). The slab keeps what it can: the next generate
   * prefills only `pendingTokens` and its new messages. */
  async rewind(messages: number, options: CallOptions = {}): Promise<Rewound> {
    checkOptions(options, CALL_KEYS, "rewind");
    await this.settle();
    return this.client.call(Op.REWIND, this.id, "Rewind", { messages }, options.timeoutMs);
  }

  /** Cancel the running append/generate; the stream ends with stopReason "cancelled". */
  cancel(options: CallOptions = {}): Promise<Ack> {
    return this.client.call(Op.CANCEL, this.id, "Cancel", {}, options.timeoutMs);
  }

  /** A new session: a copy of this one taken back to the end of the turn where
   * its conversation held `messages` messages (undefined: as it is now),
   * sharing nothing with it afterwards. A branch that prefills nothing again:
   * the copy starts from this session's slab. */
  async fork(messages?: number, options: Pick<OpenOptions, "admission" | "queueWaitS" | "clientName" | "timeoutMs"> = {}): Promise<Session> {
    await this.settle();
    return this.client.openSession({ ...options, fork: { sessionId: this.id, messages } });
  }

  /** Name points of the conversation: `marks` maps a name to the message count
   * where it points (one the conversation has reached); `notes` keeps your own
   * data beside a name, `drop` forgets names, and with `fromEnd` the counts go
   * back from the conversation's end. They live in the session's record;
   * `client.find` finds the session by them. A rewind forgets the names past
   * the point it goes back to. */
  async mark(
    marks: Record<string, number>,
    options: CallOptions & { notes?: Record<string, string>; drop?: string[]; fromEnd?: boolean } = {},
  ): Promise<Marked> {
    checkOptions(options, MARK_KEYS, "mark");
    await this.settle();
    const body = { marks, notes: options.notes ?? {}, drop: options.drop ?? [], fromEnd: options.fromEnd ?? false };
    return this.client.call(Op.MARK, this.id, "Mark", body, options.timeoutMs);
  }

  /** The session's state; `marks`: also these names' points and notes (those it has). */
  info(options: CallOptions & { tokenIds?: boolean; marks?: string[] } = {}): Promise<SessionInfo> {
    checkOptions(options, INFO_KEYS, "info");
    const body = { tokenIds: options.tokenIds ?? false, marks: options.marks ?? [] };
    return this.client.call(Op.INFO, this.id, "Info", body, options.timeoutMs);
  }

  /** Free the session's slab (undefined if it was already closed here). */
  async close(options: CallOptions = {}): Promise<Closed | undefined> {
    if (this.closed) return undefined;
    await this.settle();
    this.closed = true;
    this.client.forget(this);
    return this.client.call(Op.CLOSE, this.id, "Close", {}, options.timeoutMs);
  }

  /** @internal */
  async start(options: GenerateOptions): Promise<Feed> {
    await this.settle();
    const credit = options.credit ?? DEFAULT_CREDIT;
    const body = { ...pickSampling(options), messages: options.messages ?? [], credit, traceparent: options.traceparent };
    const [requestId, queue] = await this.client.request(Op.GENERATE, this.id, "Generate", body);
    this.feed = new Feed(this.client, this.id, requestId, queue, credit, options.timeoutMs);
    return this.feed;
  }

  /** Cancel and drain an unfinished earlier stream (one dropped or aborted). */
  private async settle(): Promise<void> {
    if (this.closed) throw new SessionNotFound(`session ${this.id} was closed`, { sessionId: this.id });
    const feed = this.feed;
    this.feed = undefined;
    // How an abandoned stream ended is nobody's concern now.
    if (feed) await feed.close().catch((err) => { if (!(err instanceof KvmuxError)) throw err; });
  }
}

/** @internal The consuming side of one stream, kept by the session so it can drain it. */
class Feed {
  result?: GenerateResult;
  done = false;
  private cancelSent = false;
  private unacked = 0;

  constructor(
    private readonly client: Client,
    private readonly sessionId: string,
    readonly requestId: number,
    private readonly queue: Queue<Frame>,
    private readonly credit: number,
    private readonly timeoutMs?: number,
  ) {}

  async next(signal?: AbortSignal): Promise<Chunk | undefined> {
    if (this.done) return undefined;
    let frame: Frame;
    try {
      frame = await this.client.wait(this.requestId, this.queue, this.timeoutMs, "generate", this.sessionId, signal);
    } catch (err) {
      if (err instanceof Timeout) this.done = true;
      this.cancel();
      throw err;
    }
    if (frame.op !== Op.PARTIAL) this.done = true;
    const body = unwrap<Reply>(frame);
    if (body.type === "chunk") {
      this.unacked++;
      if (this.credit > 0 && !this.done && this.unacked >= Math.max(1, this.credit >> 1)) {
        this.client.fire(Op.CREDIT, this.sessionId, "Credit", { requestId: this.requestId, n: this.unacked });
        this.unacked = 0;
      }
      return body;
    }
    if (body.type === "result") {
      this.result = body;
      return undefined;
    }
    this.done = true;
    throw new Internal(`unexpected ${body.type} in a generate stream`, { requestId: this.requestId });
  }

  cancel(): void {
    if (this.cancelSent || this.done) return;
    this.cancelSent = true;
    this.client.fire(Op.CANCEL, this.sessionId, "Cancel", { requestId: this.requestId });
  }

  async close(): Promise<void> {
    this.cancel();
    while ((await this.next()) !== undefined);
  }
}

/**
 * Async iterable of chunks; `result` holds the final GenerateResult once the
 * loop ends. `break` cancels the generation and waits for its end.
 */
export class ChatStream implements AsyncIterableIterator<Chunk> {
  private feed?: Feed;
  private starting?: Promise<Feed>;

  constructor(readonly session: Session, private readonly options: GenerateOptions) {
    options.signal?.addEventListener("abort", () => this.feed?.cancel(), { once: true });
  }

  get result(): GenerateResult | undefined {
    return this.feed?.result;
  }

  [Symbol.asyncIterator](): ChatStream {
    return this;
  }

  async next(): Promise<IteratorResult<Chunk, undefined>> {
    this.options.signal?.throwIfAborted();
    this.starting ??= this.session.start(this.options);
    this.feed ??= await this.starting;
    const chunk = await this.feed.next(this.options.signal);
    return chunk ? { value: chunk, done: false } : { value: undefined, done: true };
  }

  async return(): Promise<IteratorResult<Chunk, undefined>> {
    if (this.starting) await (await this.starting).close();
    return { value: undefined, done: true };
  }

  /** Consume the rest: the concatenated text and the final result. */
  async text(): Promise<string> {
    let text = "";
    for await (const chunk of this) text += chunk.text;
    return text;
  }
}
