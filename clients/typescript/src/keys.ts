/**
 * CURVE keys as kvmux takes them (the same rules as kvmux/keys.py): a z85
 * string of 40 characters, or the path of a pyzmq certificate file that
 * `kvmux keys new NAME` writes: NAME.key holds `public-key = "..."`,
 * NAME.key_secret holds `public-key` and `secret-key`.
 */

import { createPrivateKey, createPublicKey } from "node:crypto";
import { readFileSync } from "node:fs";
import { homedir } from "node:os";

import { InvalidArgument } from "./errors.js";

export const Z85_KEY_CHARS = 40;

const Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
const Z85_VALUE = new Map([...Z85].map((c, i) => [c, i]));

/** The bytes a z85 string stands for, or undefined if it is not z85 (length a multiple of 5). */
export function z85Decode(text: string): Uint8Array | undefined {
  if (text.length % 5 !== 0) return undefined;
  const out = new Uint8Array((text.length / 5) * 4);
  const view = new DataView(out.buffer);
  for (let i = 0; i < text.length; i += 5) {
    let value = 0;
    for (let j = i; j < i + 5; j++) {
      const digit = Z85_VALUE.get(text[j]);
      if (digit === undefined) return undefined;
      value = value * 85 + digit;
    }
    if (value > 0xffffffff) return undefined;
    view.setUint32((i / 5) * 4, value);
  }
  return out;
}

export function z85Encode(bytes: Uint8Array): string {
  if (bytes.length % 4 !== 0) throw new RangeError("z85 encodes a multiple of 4 bytes");
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let out = "";
  for (let i = 0; i < bytes.length; i += 4) {
    let value = view.getUint32(i);
    const block: string[] = [];
    for (let j = 0; j < 5; j++) {
      block.unshift(Z85[value % 85]);
      value = Math.floor(value / 85);
    }
    out += block.join("");
  }
  return out;
}

/** Whether `text` is a CURVE key in z85: 40 characters standing for 32 bytes. */
export function isZ85Key(text: unknown): text is string {
  return typeof text === "string" && text.length === Z85_KEY_CHARS && z85Decode(text) !== undefined;
}

// An X25519 private key in PKCS#8 DER is this prefix and the 32 secret bytes.
const X25519_PKCS8 = Buffer.from("302e020100300506032b656e04220420", "hex");

/** The public key (z85) of a CURVE secret key (z85), as zmq_curve_public computes it. */
export function curvePublic(secretKey: string): string {
  const secret = z85Decode(secretKey);
  if (secret?.length !== 32) throw new InvalidArgument("not a z85 CURVE secret key (40 characters)");
  const key = createPrivateKey({ key: Buffer.concat([X25519_PKCS8, secret]), format: "der", type: "pkcs8" });
  const x = createPublicKey(key).export({ format: "jwk" }).x as string;
  return z85Encode(Buffer.from(x, "base64url"));
}

export interface Certificate {
  publicKey?: string;
  secretKey?: string;
}

/** A pyzmq certificate file's keys, read the way zmq.auth.load_certificate does. */
export function loadCertificate(path: string): Certificate {
  const text = readFileSync(path.startsWith("~/") ? homedir() + path.slice(1) : path, "utf8");
  const cert: Certificate = {};
  for (const raw of text.split(/\r?\n/)) {
    const line = raw.trim();
    if (line.startsWith("#")) continue;
    const match = /^(public-key|secret-key)\s*=(.*)$/.exec(line);
    if (!match) continue;
    const value = match[2].trim().replace(/^["']|["']$/g, "");
    if (match[1] === "public-key") cert.publicKey = value;
    else cert.secretKey = value;
  }
  return cert;
}

function certificate(what: string, value: string): Certificate {
  let cert: Certificate;
  try {
    cert = loadCertificate(value);
  } catch (err) {
    const why = (err as NodeJS.ErrnoException).code ?? String(err);
    throw new InvalidArgument(
      `${what}: ${JSON.stringify(value)} is neither a z85 key (${Z85_KEY_CHARS} characters) nor a readable certificate file (${why})`,
    );
  }
  if (!isZ85Key(cert.publicKey)) {
    throw new InvalidArgument(`${what}: ${value} holds no valid public-key: is it a \`kvmux keys new\` certificate?`);
  }
  return cert;
}

function checkType(what: string, value: unknown): asserts value is string {
  if (typeof value !== "string" || value === "") {
    throw new InvalidArgument(`${what} must be a z85 key (${Z85_KEY_CHARS} characters) or the path of a certificate file`);
  }
}

/** A public key (z85) from a z85 string or a certificate file (NAME.key or NAME.key_secret). */
export function publicKey(value: unknown, what = "key"): string {
  checkType(what, value);
  if (isZ85Key(value)) return value;
  return certificate(what, value).publicKey as string;
}

/** [public, secret] (z85) from a secret key's z85 string or a NAME.key_secret file. */
export function keyPair(value: unknown, what = "secretKey"): [string, string] {
  checkType(what, value);
  if (isZ85Key(value)) return [curvePublic(value), value];
  const cert = certificate(what, value);
  if (!isZ85Key(cert.secretKey)) {
    throw new InvalidArgument(`${what}: ${value} holds no valid secret-key: give the NAME.key_secret file, not NAME.key`);
  }
  return [cert.publicKey as string, cert.secretKey];
}

export interface CurveKeys {
  curveServerKey: string;
  curvePublicKey: string;
  curveSecretKey: string;
}

/**
 * The Dealer's curve options from a client's key options; undefined without
 * `serverKey` (no CURVE). Without `secretKey`, a throwaway key pair from
 * `fresh()` (a broker that checks client keys refuses it). `publicKey`, if
 * given beside `secretKey`, must be the secret key's.
 */
export function clientKeys(
  options: { serverKey?: string; publicKey?: string; secretKey?: string },
  fresh: () => { publicKey: string; secretKey: string },
): CurveKeys | undefined {
  const { serverKey, publicKey: pub, secretKey } = options;
  if (serverKey === undefined) {
    if (pub !== undefined || secretKey !== undefined) {
      throw new InvalidArgument("publicKey/secretKey need serverKey (the broker's public key) to turn CURVE on");
    }
    return undefined;
  }
  const curveServerKey = publicKey(serverKey, "serverKey");
  if (secretKey === undefined) {
    if (pub !== undefined) throw new InvalidArgument("publicKey needs secretKey (or give secretKey alone: a NAME.key_secret file holds both)");
    const pair = fresh();
    return { curveServerKey, curvePublicKey: pair.publicKey, curveSecretKey: pair.secretKey };
  }
  const [derived, curveSecretKey] = keyPair(secretKey, "secretKey");
  if (pub !== undefined && publicKey(pub, "publicKey") !== derived) {
    throw new InvalidArgument("publicKey is not secretKey's public key");
  }
  return { curveServerKey, curvePublicKey: derived, curveSecretKey };
}
