"""Protocol v1 message bodies.

Requests are plain Structs chosen by the envelope's op (the broker never
decodes them); replies are one tagged union (field ``type``) so a client can
decode any reply with one decoder. Optional fields left at their default are
omitted on the wire.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import ErrorCode, StopReason


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


# ---------------------------------------------------------------- requests


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A call the model made: `arguments` is the JSON text it generated."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """A message of the conversation. An assistant message may carry the
    tool calls it made, a `tool` message answers one (`tool_call_id`)."""

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None
    name: str | None = None  # a tool message: the function it answers


class Tool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A function the model may call: `parameters` is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {}


class NamedTool(msgspec.Struct, kw_only=True):
    """`tool_choice`: call this function."""

    name: str


class Format(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a reply must be, enforced while it is generated (worker/constraint.py):
    `type` json_object (any JSON object), json_schema (`schema`), lark or gbnf
    (`grammar`), or regex (`grammar`)."""

    type: str
    schema: dict[str, Any] | None = None
    grammar: str | None = None


class TokenLogprob(msgspec.Struct, array_like=True):
    """A token and its log-probability under the model (before sampling's changes)."""

    token: int
    logprob: float
    text: str


class Logprobs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A generated token's log-probability and the `top` most likely at its place."""

    token: int
    logprob: float
    text: str
    top: list[TokenLogprob] = []


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of tool call `index`: its id and name come first, once;
    `arguments` is the next piece of its JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Sampling(_Body):
    """Generation options; any field left unset falls back to the session's
    defaults (given at open), then to the worker's (greedy, 256 tokens)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    speculative: str | None = None  # a SpeculativeMode value: auto (the default) | off | lookup | draft
    format: Format | None = None  # the reply must match this (structured output)
    # The session's tools: auto (the model chooses; the default), none (no calls),
    # required (at least one call) or a NamedTool (that function).
    tool_choice: str | NamedTool | None = None
    parallel_tool_calls: bool | None = None  # more than one call in a reply (default true)
    logprobs: int | None = None  # each token's log-probability, and this many most likely (0..20)
    # Higher first (-100..100, default 0): the broker's admission queue and the worker's
    # shared passes serve a request before those of lower priority (docs/operations.md, "Priority").
    priority: int | None = None


class Fork(msgspec.Struct, kw_only=True, omit_defaults=True):
    """OpenSession.fork: open a copy of the caller's session `session_id`,
    taken back to the end of the turn where its conversation held `messages`
    messages (None: as it is now). The copy shares nothing with the original
    afterwards; its slab is the original's, so nothing is prefilled again."""

    session_id: str
    messages: int | None = None


class OpenSession(_Body):
    system: str | None = None
    tools: list[Tool] = []  # functions the model may call, rendered by its chat template
    # Template variables for the model's chat template, on every rendering
    # of this session (vLLM's chat_template_kwargs: {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    sink: int | None = None
    window: int | None = None
    sampling: Sampling | None = None
    # Admission overrides, honoured only where the daemon allows them.
    admission: str | None = None
    queue_wait_s: float | None = None
    client_name: str | None = None
    # A copy of an existing session (its system prompt, tools, template
    # options, window and sampling defaults; the fields above are then unset).
    fork: Fork | None = None
    traceparent: str | None = None  # the caller's span, W3C trace context: traces follow the request (kvmux/tracing.py)
    # Shared prefixes (a PrefixMode value): auto (the default: the opening takes the longest
    # prefix another session computed, and is kept for the next), pin (its prefix is stored
    # at once and kept past the budget's evictions) or off (neither: prefilled cold).
    prefix: str | None = None
    # The model the session runs on: a worker's model id or an alias it declares; None: the
    # daemon's default (its first worker's model). One it does not have: `model_not_found`.
    model: str | None = None


class Append(_Body):
    """Exactly one of ``messages`` (rendered with the chat template) or
    ``token_ids`` (raw, no template) must be non-empty."""

    messages: list[ChatMessage] = []
    token_ids: list[int] = []
    traceparent: str | None = None  # the caller's span, W3C trace context: traces follow the request (kvmux/tracing.py)


class Generate(Sampling):
    """Generate after optionally appending ``messages`` (one round trip for a
    chat turn). ``credit``: how many chunks may be unacknowledged before the
    worker pauses this stream (0 = no flow control)."""

    messages: list[ChatMessage] = []
    credit: int = 0
    traceparent: str | None = None  # the caller's span, W3C trace context: traces follow the request (kvmux/tracing.py)


class Cancel(_Body):
    """Cancels ``request_id`` (a queued open, say), or by default the running
    append/generate of the envelope's session."""

    request_id: int | None = None


class Credit(_Body):
    """Grants ``n`` more chunks to the running stream of the session."""

    request_id: int
    n: int


class Rewind(_Body):
    """Take the session back to where its conversation held its first
    `messages` messages (the end of an earlier turn: a regenerate, or an edit
    of the last message): what came after is gone from its history, its
    slab and its record."""

    messages: int


class Mark(_Body):
    """Name points of the session's conversation, each at a message count
    it has reached (a client's labels: a conversation's hash, a response
    id), with an optional note kept beside it (the client's own data), and
    forget the names in `drop`. A rewind forgets the names past the point it
    goes back to. The names live in the session's record; the broker finds
    a session by them (Find)."""

    marks: dict[str, int] = {}
    notes: dict[str, str] = {}  # name -> note, for names in `marks`
    drop: list[str] = []
    from_end: bool = False  # `marks` count back from the conversation's end (0: the end itself)


class Find(_Body):
    """The caller's session that has one of `names` (the first of them that
    one has); answered with Found, or session_not_found."""

    names: list[str]


class Info(_Body):
    token_ids: bool = False  # also return the whole history's token ids
    marks: list[str] = []  # also return these names' message counts and notes (Mark)


class Close(_Body):
    keep: bool = False  # broker only: free the slab, keep the stored record


class Resume(_Body):
    """A handle on the envelope's existing session; answered with SessionOpened."""


class ListSessions(_Body):
    pass


class Hibernate(_Body):
    """Broker -> worker: write the session's slab to the store and free it
    (`traceparent`: the request waiting for its slab, if that one is traced)."""

    traceparent: str | None = None  # the caller's span, W3C trace context: traces follow the request (kvmux/tracing.py)


class Stats(_Body):
    pass


class Ping(_Body):
    pass


class Drain(_Body):
    grace_s: float | None = None


# ------------------------------------------------------- worker <-> broker


class Compute(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What decides a worker's speed and exactness (worker/padding.py)."""

    device: str  # MLX's device, e.g. "Device(cpu, 0)"
    blas: str = ""  # the BLAS kernels in use, e.g. "OpenBLAS Haswell"
    mode: str = "default"  # or "batch-invariant" (always pad)
    exact: bool = True  # decode rows bit-identical whatever shares their pass
    floors: dict[str, int] = {}  # rows that make a projection row-invariant (those above 1); padded to if exact
    rows_alone: bool = False  # rows depend on where they sit: invariance runs decode rows one at a time
    pad_cost: float = 1.0  # invariant passes' time over plain ones', measured at start (worker/padding.py)
    calibrate_s: float = 0.0  # seconds that calibration and measuring took at start
    layout: str = ""  # a worker group's split of the model, e.g. "pipeline 2: layers 0-14 | 15-29" ("": one process)
    kernel: str = (
        ""  # what multiplies quantized weights on a CPU, e.g. "kvmux_native avx512, 2 threads", or "none (why)"
    )


class StoredSession(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A session in a store, hibernated: what the broker keeps of it (and
    reads first of every record: kvmux/sessions' RecordHead)."""

    session_id: str
    model: str
    owner: str = ""
    created: float = 0.0  # wall-clock seconds
    updated: float = 0.0
    sink: int
    window: int
    tokens: int = 0  # history and pending tokens
    marks: dict[str, int] = {}  # its named points (Mark): what Find looks for


class PrefixCounts(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A worker's shared prefixes since it started (worker/prefixes.py)."""

    hits: int = 0  # new sessions that restored a prefix
    misses: int = 0  # new sessions of a block or more that found none
    tokens: int = 0  # tokens restored instead of prefilled
    stored: int = 0  # prefixes it wrote to the store
    bytes: int = 0  # held in its memory now


class WorkerReady(_Body):
    model: str
    slabs: int
    slab_bytes: int
    sink: int
    max_window: int
    version: int
    pid: int
    host: str
    free_slabs: int
    sessions: list[str] = []  # live sessions it holds (kept across a broker restart)
    store: str = ""  # its session store ("host:state dir", or a Redis URL): who reads the same records
    # each live session's owner, from its record: for a broker that does not read this worker's store
    owners: dict[str, str] = {}
    # hibernated sessions in its store, when that is a directory and the broker is reached over tcp
    # (perhaps from another host, which cannot read it)
    stored: list[StoredSession] = []
    compute: Compute | None = None


class WorkerHeartbeat(_Body):
    free_slabs: int
    running: int  # requests being computed right now
    draining: bool = False  # the worker takes no new sessions
    drafted: int = 0  # speculative decoding since the worker started: tokens drafted
    accepted: int = 0  # and of them accepted by the verifier
    link_bytes: int = 0  # a worker group: bytes between rank 0 and its other ranks, since it started
    kv_bytes: int = 0  # KV cache its live sessions hold now (their kv_live_bytes summed)
    prefixes: PrefixCounts | None = None  # shared prefixes since it started


class Disconnect(_Body):
    reason: str = ""


class Restored(_Body):
    """Worker -> broker, unsolicited: a session was restored from the store."""

    session_id: str
    seconds: float
    replayed_tokens: int = 0  # fed again after the snapshot (a crash's cost)


# ---------------------------------------------------------------- replies


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="type"):
    pass


class SessionOpened(Reply, tag="opened"):
    """The reply to OPEN and to RESUME (worker_id is "" while hibernated)."""

    session_id: str
    worker_id: str
    model: str
    sink: int
    window: int
    slab_bytes: int


class Appended(Reply, tag="appended"):
    new_tokens: int
    history_tokens: int
    prefill_s: float
    truncated_tokens: int
    cached_tokens: int = 0  # of new_tokens, restored from a shared prefix instead of prefilled


class Chunk(Reply, tag="chunk"):
    """Generated tokens and their text; a tool call's text comes as `tool_calls` deltas instead."""

    token_ids: list[int]
    text: str
    logprobs: list[Logprobs] = []  # per token, when asked for (Sampling.logprobs)
    tool_calls: list[ToolCallDelta] = []


class GenerateResult(Reply, tag="result"):
    stop_reason: StopReason
    prompt_tokens: int  # tokens prefilled by this call
    completion_tokens: int
    prefill_s: float
    decode_s: float
    truncated_tokens: int  # history tokens the window has dropped so far
    history_tokens: int
    drafted_tokens: int = 0  # proposed to the verifier (speculative decoding)
    accepted_tokens: int = 0  # of them, the ones that stood
    reused_tokens: int = 0  # history the session held before this call (in its slab, or restored): not prefilled
    content: str = ""  # the reply's text less its tool calls (set when tools are enabled)
    tool_calls: list[ToolCall] = []  # the calls the reply made (stop_reason tool_calls)
    cached_tokens: int = 0  # tokens restored from a shared prefix instead of prefilled (not in prompt_tokens)


class Marked(Reply, tag="marked"):
    marks: int  # the names the session has now


class Found(Reply, tag="found"):
    name: str  # the first of Find's names that a session has
    session_id: str


class SessionInfo(Reply, tag="info"):
    session_id: str
    worker_id: str
    history_tokens: int
    cached_tokens: int
    kv_live_bytes: int
    slab_bytes: int
    truncated_tokens: int
    idle_s: float
    sink: int
    window: int
    busy: bool
    messages: int
    token_ids: list[int] | None = None
    state: str = "live"  # live (in a slab) | hibernated (in the store)
    restores: int = 0
    last_restore_s: float = 0.0
    pending_tokens: int = 0  # of history_tokens, those not fed yet: the next request prefills them
    marks: dict[str, int] = {}  # of the names Info asked for, those the session has
    notes: dict[str, str] = {}


class Rewound(Reply, tag="rewound"):
    messages: int  # the conversation's messages now
    history_tokens: int  # the session's tokens now
    kept_tokens: int  # of them, still in its slab: reused
    # the rest, fed again with the next append or generate (the last kept token, whose
    # logits the next reply starts from, or more where the slab could not take the turn back)
    pending_tokens: int


class Closed(Reply, tag="closed"):
    session_id: str


class Hibernated(Reply, tag="hibernated"):
    session_id: str
    bytes: int  # written to the store
    seconds: float


class SessionSummary(msgspec.Struct, kw_only=True, omit_defaults=True):
    session_id: str
    state: str  # live | hibernated
    owner: str
    worker_id: str = ""
    history_tokens: int
    idle_s: float
    bytes_on_disk: int
    created: float  # wall-clock seconds


class SessionList(Reply, tag="sessions"):
    sessions: list[SessionSummary]


class Ack(Reply, tag="ack"):
    pass


class Pong(Reply, tag="pong"):
    time: float


class WorkerStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    worker_id: str
    model: str
    host: str
    pid: int
    slabs_total: int
    slabs_used: int
    running: int
    in_flight: int
    sessions: int
    frames_forwarded: int
    last_seen_s: float
    drafted: int = 0  # speculative decoding since the worker started: tokens drafted
    accepted: int = 0  # of them, accepted by the verifier
    link_bytes: int = 0  # a worker group: bytes between rank 0 and its other ranks, since it started
    kv_bytes: int = 0  # KV cache its live sessions hold now
    compute: Compute | None = None
    prefixes: PrefixCounts | None = None  # shared prefixes since it started


class Refused(msgspec.Struct, kw_only=True):
    reason: str  # an OverloadReason value
    count: int


class ModelStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model the daemon serves: one it declares, or one a registered worker runs."""

    model: str  # its id, as its workers' READY says it (OpenSession.model)
    aliases: list[str] = []  # other names an open may give it
    state: str  # a ModelState value: resident, loading, unloaded
    workers: int = 0  # its registered workers
    default: bool = False  # an open that names no model runs on it
    pinned: bool = False  # never unloaded
    resident_bytes: int = 0  # its local workers' resident memory (0: none runs, or not the daemon's own)
    idle_s: float = 0.0  # since a request last used it (0: the daemon's own have not yet)


class Endpoint(msgspec.Struct, omit_defaults=True):
    """One of the broker's endpoints and who can reach it."""

    name: str  # frontend, backend, admin
    endpoint: str
    protection: str  # e.g. "CURVE: encrypted, keys checked", "ipc, this user only"
    curve: bool = False


class BrokerStats(Reply, tag="stats"):
    version: int
    uptime_s: float
    workers: list[WorkerStats]
    sessions: int
    in_flight: int
    frames_forwarded: int
    slabs_total: int
    slabs_used: int
    queue_depth: int = 0
    admitted: int = 0
    rejected: int = 0
    expired: int = 0
    queue_wait_p50_s: float = 0.0
    queue_wait_p99_s: float = 0.0
    draining: bool = False
    refused: list[Refused] = []  # overloaded answers by reason (`rejected` is their sum)
    sessions_live: int = 0  # in a slab
    sessions_hibernated: int = 0  # in the store only
    hibernations: int = 0
    restores: int = 0
    restore_p50_s: float = 0.0
    restore_p99_s: float = 0.0
    store_bytes: int = 0
    store_error: str = ""  # why the session store failed its last check ("" while it answers)
    endpoints: list[Endpoint] = []
    models: list[ModelStats] = []  # the default first
    max_resident_bytes: int = 0  # the memory budget its models load within (0: it loads none of its own)
    model_loads: int = 0
    model_unloads: int = 0


class Error(Reply, tag="error"):
    code: ErrorCode
    message: str
    reason: str | None = None  # OverloadReason value for `overloaded`
    retry_after_s: float | None = None
    queue_depth: int | None = None


ReplyBody = (
    SessionOpened
    | Appended
    | Chunk
    | GenerateResult
    | SessionInfo
    | Rewound
    | Marked
    | Found
    | Closed
    | Hibernated
    | SessionList
    | Ack
    | Pong
    | BrokerStats
    | Error
)
