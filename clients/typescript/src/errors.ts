/** One error class per protocol error code (the same set as the Python client), all under `KvmuxError`. */

import type { ErrorReply } from "./schema.js";

export interface ErrorDetails {
  reason?: string;
  retryAfterS?: number;
  queueDepth?: number;
  requestId?: number;
  sessionId?: string;
}

export class KvmuxError extends Error {
  static readonly code: string = "internal";
  readonly code: string;
  readonly reason?: string; // OverloadReason value for Overloaded
  readonly retryAfterS?: number;
  readonly queueDepth?: number;
  readonly requestId?: number;
  readonly sessionId?: string;

  constructor(message: string, details: ErrorDetails = {}) {
    super(message);
    this.name = new.target.name;
    this.code = (new.target as typeof KvmuxError).code;
    Object.assign(this, details);
  }
}

export class SessionNotFound extends KvmuxError { static override readonly code = "session_not_found"; }
export class SessionExpired extends KvmuxError { static override readonly code = "session_expired"; }
export class SessionCorrupt extends KvmuxError { static override readonly code = "session_corrupt"; }
/** An op that changes the daemon (drain) from an identity that is not admin. */
export class Forbidden extends KvmuxError { static override readonly code = "forbidden"; }
export class InvalidArgument extends KvmuxError { static override readonly code = "invalid_argument"; }
export class MalformedFrame extends KvmuxError { static override readonly code = "malformed_frame"; }
export class UnknownOp extends KvmuxError { static override readonly code = "unknown_op"; }
export class Busy extends KvmuxError { static override readonly code = "busy"; }
export class Overloaded extends KvmuxError { static override readonly code = "overloaded"; }
export class WorkerLost extends KvmuxError { static override readonly code = "worker_lost"; }
export class Cancelled extends KvmuxError { static override readonly code = "cancelled"; }
export class VersionMismatch extends KvmuxError { static override readonly code = "version_mismatch"; }
export class FrameTooLarge extends KvmuxError { static override readonly code = "frame_too_large"; }
/** An openSession named a model the daemon does not run (the message names those it does). */
export class ModelNotFound extends KvmuxError { static override readonly code = "model_not_found"; }
/** No reply within the call's timeout (a stream's: per frame); from a broker
 * never heard from, the message says why it may be silent (CURVE keys). */
export class Timeout extends KvmuxError { static override readonly code = "timeout"; }
export class Internal extends KvmuxError { static override readonly code = "internal"; }

export const ERRORS: Record<string, typeof KvmuxError> = Object.fromEntries(
  [SessionNotFound, SessionExpired, SessionCorrupt, Forbidden, InvalidArgument, MalformedFrame, UnknownOp, Busy, Overloaded, WorkerLost,
    Cancelled, VersionMismatch, FrameTooLarge, ModelNotFound, Timeout, Internal].map((cls) => [cls.code, cls]),
);

/** The exception an ERROR reply stands for. */
export function fromReply(reply: ErrorReply, requestId?: number, sessionId?: string): KvmuxError {
  const cls = ERRORS[reply.code] ?? Internal;
  return new cls(reply.message, {
    reason: reply.reason, retryAfterS: reply.retryAfterS, queueDepth: reply.queueDepth,
    requestId, sessionId: sessionId || undefined,
  });
}
