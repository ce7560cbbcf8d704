"""The protocol's enumerations: typed error codes, overload reasons and stop
reasons, shared by the broker, the workers and both clients."""

from __future__ import annotations

import enum


class _Code(str, enum.Enum):
    """A wire string: prints as its value (`f"{code}"` is "busy", as on the wire)."""

    def __str__(self) -> str:
        return self.value


class ErrorCode(_Code):
    """Every error a kvmux peer can answer with; the wire carries the value."""

    SESSION_NOT_FOUND = "session_not_found"
    SESSION_EXPIRED = "session_expired"  # closed by the idle timeout or past the session TTL
    SESSION_CORRUPT = "session_corrupt"  # its stored record or slab cannot be read
    FORBIDDEN = "forbidden"  # an op that changes the daemon (DRAIN), from an identity that is not admin
    INVALID_ARGUMENT = "invalid_argument"
    MALFORMED_FRAME = "malformed_frame"  # undecodable envelope or body
    UNKNOWN_OP = "unknown_op"
    BUSY = "busy"  # an append/generate already runs on the session
    OVERLOADED = "overloaded"  # admission said no (see Error.reason)
    WORKER_LOST = "worker_lost"
    CANCELLED = "cancelled"
    VERSION_MISMATCH = "version_mismatch"
    FRAME_TOO_LARGE = "frame_too_large"
    MODEL_NOT_FOUND = "model_not_found"  # an OPEN named a model no worker of the daemon runs
    TIMEOUT = "timeout"  # client side: no answer within the call's timeout
    INTERNAL = "internal"


class OverloadReason(_Code):
    """Why an `overloaded` error was given (Error.reason)."""

    NO_SLAB = "no_slab"  # `reject` policy and every slab busy with running work
    NO_WORKER = "no_worker"  # no worker registered at all
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    QUOTA = "quota"
    DRAINING = "draining"
    WORKER_STALLED = "worker_stalled"  # the worker's socket is full: it is not reading
    STORE_FULL = "store_full"  # the session store had no room for the session's record (a full disk, Redis OOM)


class StopReason(_Code):
    """Why a generation ended (GenerateResult.stop_reason)."""

    EOS = "eos"  # the model's end-of-sequence token
    MAX_TOKENS = "max_tokens"
    STOP = "stop"  # a stop string matched (it is not sent)
    CANCELLED = "cancelled"
    TOOL_CALLS = "tool_calls"  # the reply called tools (GenerateResult.tool_calls)


class ToolChoice(_Code):
    """Sampling.tool_choice, when it is not a NamedTool."""

    AUTO = "auto"  # the model chooses: its calls are parsed
    NONE = "none"  # no calls: the reply is text
    REQUIRED = "required"  # at least one call, enforced by a grammar


class FormatType(_Code):
    """Format.type: what structured output a reply must be."""

    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    LARK = "lark"
    GBNF = "gbnf"
    REGEX = "regex"


class SpeculativeMode(_Code):
    """Generate's `speculative` option: where drafts for the verifier come from."""

    AUTO = "auto"  # the history's lookup where it matches, else the draft model if the worker has one
    OFF = "off"  # a token per pass
    LOOKUP = "lookup"  # the session's history (and, greedy, other sessions' recent replies)
    DRAFT = "draft"  # the worker's draft model (kvmux serve --draft-model)


class PrefixMode(_Code):
    """OpenSession's `prefix` option: what a new session does with shared prefixes."""

    AUTO = "auto"  # take the longest one stored or held; keep the opening for the next session
    PIN = "pin"  # take one, and store the opening's own prefix at once, kept past evictions
    OFF = "off"  # neither: the opening is prefilled cold and kept nowhere


class ModelState(_Code):
    """ModelStats.state: where a model the daemon serves is."""

    RESIDENT = "resident"  # a worker of it is registered
    LOADING = "loading"  # its local workers are starting
    UNLOADED = "unloaded"  # declared, no worker of it runs
