/**
 * kvmux for Node: `new Client(endpoint)`, `await client.openSession()`,
 * `for await (const chunk of session.chat("Hi")) ...`. Byte-compatible with
 * the Python client through the golden vectors in protocol/vectors/.
 */

export { ChatStream, Client, DEFAULT_CREDIT, DEFAULT_TIMEOUT_MS, Session } from "./client.js";
export type {
  AppendOptions, CallOptions, ClientOptions, FormatType, GenerateOptions, OpenOptions, ResponseFormat, SamplingOptions, ToolChoice,
} from "./client.js";
export { camel, decode, decodeEnvelope, encodeStruct, envelope, MAP_FIELDS, snake } from "./codec.js";
export * from "./errors.js";
export { curvePublic, isZ85Key, keyPair, loadCertificate, publicKey, z85Decode, z85Encode } from "./keys.js";
export type { Certificate } from "./keys.js";
export { defaultFrontend, runtimeDir } from "./paths.js";
export * from "./schema.js";
