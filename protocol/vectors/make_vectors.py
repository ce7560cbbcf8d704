"""Write the golden msgpack vectors both clients test against.

    python protocol/vectors/make_vectors.py          # (re)write vectors + TS schema
    python protocol/vectors/make_vectors.py --check  # exit 1 if any is stale

For every frame type (the envelope, each request, worker-control and reply
body) and its edge cases (unicode, empty lists, large and negative ints,
integral floats, optional fields absent), it writes `<name>.msgpack` as
msgspec encodes it and a `manifest.json` entry {name, file, schema, value},
where `value` is the JSON form (ints beyond 2**53 as {"$bigint": "..."}).
It also writes clients/typescript/src/schema.ts, the field tables the Node
client encodes with, generated from the same msgspec Structs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from kvmux import protocol as p

HERE = Path(__file__).resolve().parent
TS_SCHEMA = HERE.parent.parent / "clients" / "typescript" / "src" / "schema.ts"
MAX_SAFE = 2**53 - 1
SID = "3f2a9c1e5b7d4f60a1b2c3d4e5f60718"
U = "héllo wörld ✓ 日本語 🦙"  # 2-, 3- and 4-byte UTF-8

# Every Struct both clients must encode, by the name the manifest uses.
SCHEMAS: dict[str, type] = {
    "Envelope": p.Envelope,
    **{t.__name__: t for t in p.REQUEST_BODIES.values()},
    **{t.__name__: t for t in p.WORKER_BODIES.values()},
    "ChatMessage": p.ChatMessage,
    "Sampling": p.Sampling,
    "ToolCall": p.ToolCall,
    "Tool": p.Tool,
    "NamedTool": p.NamedTool,
    "Format": p.Format,
    "Fork": p.Fork,
    "TokenLogprob": p.TokenLogprob,
    "Logprobs": p.Logprobs,
    "ToolCallDelta": p.ToolCallDelta,
    "WorkerStats": p.WorkerStats,
    "SessionSummary": p.SessionSummary,
    "Refused": p.Refused,
    "Endpoint": p.Endpoint,
    "ModelStats": p.ModelStats,
    "Compute": p.Compute,
    "PrefixCounts": p.PrefixCounts,
    "StoredSession": p.StoredSession,
    **{t.__name__: t for t in p.ReplyBody.__args__},
}


def env(op: str, rid: int = 1, sid: str = "") -> p.Envelope:
    return p.Envelope(p.PROTOCOL_VERSION, op, rid, sid)


def worker_stats(**kw: Any) -> p.WorkerStats:
    base = {
        "worker_id": "w-1",
        "model": "smollm2-135m",
        "host": "mac.local",
        "pid": 4242,
        "slabs_total": 8,
        "slabs_used": 3,
        "running": 1,
        "in_flight": 2,
        "sessions": 3,
        "frames_forwarded": 123456,
        "last_seen_s": 0.25,
    }
    return p.WorkerStats(**{**base, **kw})


CASES: list[tuple[str, Any]] = [
    # envelopes: every op, empty and full session ids, request ids at each int width
    *[
        (f"envelope_{op}", env(op, 7, SID if op in p.SESSION_OPS else ""))
        for op in [
            p.Op.OPEN,
            p.Op.APPEND,
            p.Op.GENERATE,
            p.Op.CANCEL,
            p.Op.CREDIT,
            p.Op.INFO,
            p.Op.CLOSE,
            p.Op.STATS,
            p.Op.PING,
            p.Op.DRAIN,
            p.Op.RESUME,
            p.Op.SESSIONS,
            p.Op.REWIND,
            p.Op.MARK,
            p.Op.FIND,
            p.Op.READY,
            p.Op.HEARTBEAT,
            p.Op.DISCONNECT,
            p.Op.HIBERNATE,
            p.Op.RESTORED,
            p.Op.PARTIAL,
            p.Op.FINAL,
            p.Op.ERROR,
        ]
    ],
    ("envelope_rid_zero", env(p.Op.PING, 0)),
    ("envelope_rid_u16", env(p.Op.INFO, 65535, SID)),
    ("envelope_rid_u32", env(p.Op.INFO, 2**32 - 1, SID)),
    ("envelope_rid_u64_safe", env(p.Op.INFO, MAX_SAFE, SID)),
    ("envelope_rid_u64_max", env(p.Op.INFO, 2**64 - 1, SID)),
    # requests
    ("open_empty", p.OpenSession()),
    (
        "open_full",
        p.OpenSession(
            system=U,
            sink=4,
            window=2048,
            sampling=p.Sampling(max_tokens=256, temperature=1.0, top_p=0.95, top_k=40, seed=0, stop=["\n\n", "ü", ""]),
            admission="queue",
            queue_wait_s=2.0,
            client_name="node-example",
        ),
    ),
    ("open_sampling_empty", p.OpenSession(sampling=p.Sampling())),
    ("open_priority", p.OpenSession(sampling=p.Sampling(priority=7))),
    ("open_fork", p.OpenSession(fork=p.Fork(session_id="0123456789abcdef0123456789abcdef", messages=3))),
    (
        "open_chat_template_kwargs",
        p.OpenSession(
            system="Be brief.",
            chat_template_kwargs={
                "enable_thinking": False,
                "date_string": "26 Jul 2024",
                "reasoning": {"effort": 2, "budget": 0.5, "tags": ["<think>", U], "none": None},
                "BigInt": MAX_SAFE + 2,
            },
        ),
    ),
    (
        "append_messages",
        p.Append(
            messages=[p.ChatMessage("system", "Be brief."), p.ChatMessage("user", U), p.ChatMessage("assistant", "")]
        ),
    ),
    ("append_token_ids", p.Append(token_ids=[0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, MAX_SAFE])),
    ("append_token_ids_big", p.Append(token_ids=[MAX_SAFE + 2, 2**63, 2**64 - 1])),
    (
        "append_token_ids_negative",
        p.Append(token_ids=[-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -MAX_SAFE, -(2**63)]),
    ),
    ("append_empty", p.Append()),
    ("append_many", p.Append(token_ids=list(range(300)))),
    ("generate_default_credit", p.Generate(credit=32)),
    ("generate_empty", p.Generate()),
    (
        "generate_full",
        p.Generate(
            max_tokens=16,
            temperature=1.0,
            top_p=0.9,
            top_k=50,
            seed=2**63 - 1,
            stop=["</s>", "\n"],
            messages=[p.ChatMessage("user", U)],
            credit=32,
        ),
    ),
    ("generate_float_zero", p.Generate(temperature=0.0, top_p=1.0, max_tokens=0)),
    ("generate_priority", p.Generate(max_tokens=4, priority=-3)),
    ("generate_float_fraction", p.Generate(temperature=0.7, top_p=1e-9, seed=-5)),
    ("generate_long_strings", p.Generate(stop=["x" * 31, "y" * 32, "z" * 255, "w" * 256, "v" * 70000])),
    (
        "generate_structured",
        p.Generate(
            format=p.Format(
                type=p.FormatType.JSON_SCHEMA.value,
                schema={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]},
            ),
            tool_choice=p.ToolChoice.NONE.value,
            logprobs=2,
            credit=32,
        ),
    ),
    (
        "generate_tool_choice_named",
        p.Generate(
            format=p.Format(type=p.FormatType.REGEX.value, grammar="[0-9]+"),
            tool_choice=p.NamedTool(name="get_weather"),
            parallel_tool_calls=False,
            logprobs=0,
        ),
    ),
    (
        "generate_tool_messages",
        p.Generate(
            messages=[
                p.ChatMessage("user", "Weather in Paris?"),
                p.ChatMessage(
                    "assistant", tool_calls=[p.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]
                ),
                p.ChatMessage("tool", U, tool_call_id="call_1", name="get_weather"),
            ],
        ),
    ),
    (
        "open_tools",
        p.OpenSession(
            system="Use tools.",
            tools=[
                p.Tool(
                    name="get_weather",
                    description="The weather in a city.",
                    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                ),
                p.Tool(name="now"),
            ],
            sampling=p.Sampling(tool_choice=p.ToolChoice.REQUIRED.value, parallel_tool_calls=True),
        ),
    ),
    ("cancel_session", p.Cancel()),
    ("cancel_request", p.Cancel(request_id=42)),
    ("credit", p.Credit(request_id=7, n=16)),
    ("credit_big", p.Credit(request_id=2**64 - 1, n=2**31)),
    ("info", p.Info()),
    ("rewind", p.Rewind(messages=4)),
    ("mark", p.Mark(marks={"resp_a": 3, "c0ffee": 1}, notes={"resp_a": '{"id": "resp_a"}'}, drop=["old"])),
    ("mark_from_end", p.Mark(marks={"end": 0, "before": 2}, from_end=True)),
    ("find", p.Find(names=["c0ffee", "beef"])),
    ("info_marks", p.Info(marks=["resp_a"])),
    ("info_token_ids", p.Info(token_ids=True)),
    ("close", p.Close()),
    ("stats", p.Stats()),
    ("ping", p.Ping()),
    ("drain", p.Drain()),
    ("drain_grace", p.Drain(grace_s=5.0)),
    ("close_keep", p.Close(keep=True)),
    ("resume", p.Resume()),
    ("list_sessions", p.ListSessions()),
    ("hibernate", p.Hibernate()),
    # worker <-> broker
    (
        "worker_ready",
        p.WorkerReady(
            model="smollm2-135m",
            slabs=8,
            slab_bytes=47_448_064,
            sink=4,
            max_window=2048,
            version=1,
            pid=31337,
            host="büro-mac",
            free_slabs=8,
        ),
    ),
    (
        "worker_ready_big",
        p.WorkerReady(
            model="", slabs=0, slab_bytes=2**40, sink=0, max_window=2**31, version=1, pid=1, host="", free_slabs=0
        ),
    ),
    ("worker_heartbeat", p.WorkerHeartbeat(free_slabs=3, running=1)),
    ("worker_heartbeat_draining", p.WorkerHeartbeat(free_slabs=0, running=0, draining=True)),
    ("disconnect", p.Disconnect()),
    ("disconnect_reason", p.Disconnect(reason="SIGTERM ✓")),
    (
        "worker_ready_sessions",
        p.WorkerReady(
            model="m",
            slabs=2,
            slab_bytes=1,
            sink=4,
            max_window=64,
            version=1,
            pid=7,
            host="h",
            free_slabs=0,
            sessions=[SID, "f" * 32],
            store="h:/var/lib/kvmux",
        ),
    ),
    (
        "worker_ready_stored",
        p.WorkerReady(
            model="m",
            slabs=2,
            slab_bytes=1,
            sink=4,
            max_window=64,
            version=1,
            pid=7,
            host="h",
            free_slabs=1,
            sessions=[SID],
            store="redis://h:6379/0",
            owners={SID: U},
            stored=[
                p.StoredSession(
                    session_id="f" * 32, model="m", owner=U, created=1.5, updated=2.25, sink=4, window=64, tokens=2**40
                )
            ],
        ),
    ),
    ("stored_session", p.StoredSession(session_id=SID, model="m", sink=0, window=1)),
    ("restored", p.Restored(session_id=SID, seconds=0.012, replayed_tokens=37)),
    # replies
    (
        "opened",
        p.SessionOpened(
            session_id=SID, worker_id="w-1", model="smollm2-135m", sink=4, window=2048, slab_bytes=47_448_064
        ),
    ),
    ("appended", p.Appended(new_tokens=12, history_tokens=40, prefill_s=0.0, truncated_tokens=0)),
    ("appended_truncated", p.Appended(new_tokens=3000, history_tokens=2052, prefill_s=17.25, truncated_tokens=948)),
    ("chunk", p.Chunk(token_ids=[28, 1130], text=" wörld")),
    ("chunk_emoji", p.Chunk(token_ids=[216, 126, 104, 236], text="🦙")),
    ("chunk_empty", p.Chunk(token_ids=[], text="")),
    (
        "chunk_logprobs",
        p.Chunk(
            token_ids=[28, 1130],
            text=" wörld",
            logprobs=[
                p.Logprobs(
                    token=28,
                    logprob=-0.25,
                    text=" w",
                    top=[p.TokenLogprob(28, -0.25, " w"), p.TokenLogprob(9, -1.5, "🦙")],
                ),
                p.Logprobs(token=1130, logprob=0.0, text="örld"),
            ],
        ),
    ),
    (
        "chunk_tool_call_deltas",
        p.Chunk(
            token_ids=[90, 91],
            text="",
            tool_calls=[
                p.ToolCallDelta(index=0, id="call_1", name="get_weather"),
                p.ToolCallDelta(index=0, arguments='{"city": "Pa'),
                p.ToolCallDelta(index=1, arguments='ris"}'),
            ],
        ),
    ),
    (
        "result_with_tool_calls",
        p.GenerateResult(
            stop_reason=p.StopReason.TOOL_CALLS,
            prompt_tokens=14,
            completion_tokens=16,
            prefill_s=0.082,
            decode_s=1.5,
            truncated_tokens=0,
            history_tokens=30,
            content="Checking.",
            tool_calls=[p.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')],
        ),
    ),
    *[
        (
            f"result_{reason.value}",
            p.GenerateResult(
                stop_reason=reason,
                prompt_tokens=14,
                completion_tokens=16,
                prefill_s=0.082,
                decode_s=1.5,
                truncated_tokens=0,
                history_tokens=30,
            ),
        )
        for reason in p.StopReason
    ],
    (
        "result_zero",
        p.GenerateResult(
            stop_reason=p.StopReason.CANCELLED,
            prompt_tokens=0,
            completion_tokens=0,
            prefill_s=0.0,
            decode_s=0.0,
            truncated_tokens=2**33,
            history_tokens=2052,
        ),
    ),
    (
        "info_reply",
        p.SessionInfo(
            session_id=SID,
            worker_id="w-1",
            history_tokens=30,
            cached_tokens=30,
            kv_live_bytes=691200,
            slab_bytes=47_448_064,
            truncated_tokens=0,
            idle_s=1.0,
            sink=4,
            window=2048,
            busy=False,
            messages=3,
        ),
    ),
    (
        "info_reply_hibernated",
        p.SessionInfo(
            session_id=SID,
            worker_id="",
            history_tokens=2052,
            cached_tokens=0,
            kv_live_bytes=0,
            slab_bytes=47_448_064,
            truncated_tokens=948,
            idle_s=301.5,
            sink=4,
            window=2048,
            busy=False,
            messages=9,
            pending_tokens=2,
            marks={"resp_a": 9},
            notes={"resp_a": "{}"},
            state="hibernated",
            restores=3,
            last_restore_s=0.042,
        ),
    ),
    (
        "info_reply_token_ids",
        p.SessionInfo(
            session_id=SID,
            worker_id="w-1",
            history_tokens=3,
            cached_tokens=3,
            kv_live_bytes=2**34,
            slab_bytes=2**34,
            truncated_tokens=0,
            idle_s=0.5,
            sink=4,
            window=2048,
            busy=True,
            messages=1,
            token_ids=[1, 2, 3],
        ),
    ),
    (
        "info_reply_token_ids_empty",
        p.SessionInfo(
            session_id=SID,
            worker_id="w-1",
            history_tokens=0,
            cached_tokens=0,
            kv_live_bytes=0,
            slab_bytes=1,
            truncated_tokens=0,
            idle_s=0.0,
            sink=0,
            window=1,
            busy=False,
            messages=0,
            token_ids=[],
        ),
    ),
    ("closed", p.Closed(session_id=SID)),
    ("rewound", p.Rewound(messages=4, history_tokens=57, kept_tokens=56, pending_tokens=1)),
    ("marked", p.Marked(marks=2)),
    ("found", p.Found(name="c0ffee", session_id="0123456789abcdef0123456789abcdef")),
    ("hibernated", p.Hibernated(session_id=SID, bytes=94_371_840, seconds=0.125)),
    ("session_list_empty", p.SessionList(sessions=[])),
    (
        "session_list",
        p.SessionList(
            sessions=[
                p.SessionSummary(
                    session_id=SID,
                    state="live",
                    owner="büro",
                    worker_id="w-1",
                    history_tokens=2052,
                    idle_s=1.5,
                    bytes_on_disk=94_500_000,
                    created=1732212345.125,
                ),
                p.SessionSummary(
                    session_id="f" * 32,
                    state="hibernated",
                    owner="",
                    history_tokens=0,
                    idle_s=0.0,
                    bytes_on_disk=0,
                    created=0.0,
                ),
            ]
        ),
    ),
    (
        "compute_padded",
        p.Compute(
            device="Device(cpu, 0)",
            blas="OpenBLAS SkylakeX",
            mode="batch-invariant",
            floors={"q": 3, "k": 7, "v": 7, "o": 3, "down": 2},
            pad_cost=1.18,
            calibrate_s=0.95,
        ),
    ),
    ("ack", p.Ack()),
    ("pong", p.Pong(time=1732212345.125)),
    (
        "stats_empty",
        p.BrokerStats(
            version=1,
            uptime_s=0.0,
            workers=[],
            sessions=0,
            in_flight=0,
            frames_forwarded=0,
            slabs_total=0,
            slabs_used=0,
        ),
    ),
    (
        "stats_full",
        p.BrokerStats(
            version=1,
            uptime_s=3600.5,
            workers=[
                worker_stats(),
                worker_stats(
                    worker_id="w-2",
                    host="日本",
                    prefixes=p.PrefixCounts(hits=9, misses=1, tokens=13392, stored=1, bytes=70778880),
                    compute=p.Compute(
                        device="Device(cpu, 0)",
                        blas="OpenBLAS Haswell",
                        exact=False,
                        rows_alone=True,
                        pad_cost=3.9,
                        calibrate_s=1.25,
                    ),
                ),
            ],
            sessions=3,
            in_flight=2,
            frames_forwarded=2**40,
            slabs_total=16,
            slabs_used=3,
            queue_depth=2,
            admitted=100,
            rejected=4,
            expired=1,
            queue_wait_p50_s=0.01,
            queue_wait_p99_s=2.0,
            draining=True,
            refused=[p.Refused(reason="no_slab", count=3), p.Refused(reason="quota", count=1)],
            sessions_live=3,
            sessions_hibernated=61,
            hibernations=240,
            restores=238,
            restore_p50_s=0.012,
            restore_p99_s=0.25,
            store_bytes=2**33,
            endpoints=[
                p.Endpoint(name="frontend", endpoint="tcp://0.0.0.0:5555", protection="CURVE", curve=True),
                p.Endpoint(name="admin", endpoint="ipc:///run/kvmux/admin.ipc", protection="ipc, this user only"),
            ],
            models=[
                p.ModelStats(
                    model="SmolLM2-135M-Instruct.Q4_1.gguf",
                    aliases=["smol"],
                    state="resident",
                    workers=1,
                    default=True,
                    pinned=True,
                    resident_bytes=2**29,
                    idle_s=1.5,
                ),
                p.ModelStats(model="gemma-3-270m-q4_k_m.gguf", state="unloaded"),
            ],
            max_resident_bytes=2**33,
            model_loads=3,
            model_unloads=1,
        ),
    ),
    *[(f"error_{code.value}", p.Error(code=code, message=f"{code.value}: {U}")) for code in p.ErrorCode],
    (
        "error_overloaded_full",
        p.Error(
            code=p.ErrorCode.OVERLOADED,
            message="no free slab",
            reason=p.OverloadReason.QUEUE_TIMEOUT.value,
            retry_after_s=1.0,
            queue_depth=8,
        ),
    ),
]


def to_json(value: Any) -> Any:
    """JSON form of a Struct, with ints JavaScript cannot hold exactly tagged."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and abs(value) > MAX_SAFE:
        return {"$bigint": str(value)}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$bigint"}:
            return int(value["$bigint"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def manifest() -> tuple[list[dict], dict[str, bytes]]:
    entries, files = [], {}
    for name, obj in CASES:
        schema = type(obj).__name__
        assert SCHEMAS[schema] is type(obj), name
        raw = p.encode(obj)
        file = f"{name}.msgpack"
        files[file] = raw
        builtins = msgspec.to_builtins(obj)
        if isinstance(obj, p.Envelope):  # array_like: keep it an array, as on the wire
            builtins = list(builtins)
        entries.append({"name": name, "file": file, "schema": schema, "value": to_json(builtins)})
    return entries, files


# ------------------------------------------------------- TypeScript schema


def ts_type(t: mi.Type) -> Any:
    if isinstance(t, mi.UnionType):
        inner = [u for u in t.types if not isinstance(u, mi.NoneType)]
        # str | NamedTool: the codec picks the member by the value's JS kind
        return {"union": [ts_type(u) for u in inner]} if len(inner) > 1 else ts_type(inner[0])
    if isinstance(t, mi.IntType):
        return "int"
    if isinstance(t, mi.FloatType):
        return "float"
    if isinstance(t, (mi.StrType, mi.EnumType)):
        return "str"
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.ListType):
        return {"list": ts_type(t.item_type)}
    if isinstance(t, mi.StructType):
        return {"struct": t.cls.__name__}
    if isinstance(t, mi.DictType) and isinstance(t.key_type, mi.StrType):
        return {"map": ts_type(t.value_type)}
    if isinstance(t, mi.AnyType):
        return "any"
    raise TypeError(f"no TypeScript mapping for {t}")


TS_NAMES = {"Error": "ErrorReply"}  # not to shadow JavaScript's Error


def ts_decl(t: Any) -> str:
    if isinstance(t, dict):
        if "union" in t:
            return " | ".join(ts_decl(u) for u in t["union"])
        if "map" in t:
            return f"Record<string, {ts_decl(t['map'])}>"
        return f"{ts_decl(t['list'])}[]" if "list" in t else TS_NAMES.get(t["struct"], t["struct"])
    return {"int": "number", "float": "number", "str": "string", "bool": "boolean", "any": "unknown"}[t]


def ts_interfaces() -> str:
    out = []
    for name, cls in SCHEMAS.items():
        info = mi.type_info(cls)
        if info.array_like:
            if name != "Envelope":  # codec.ts's EnvelopeTuple
                members = ", ".join(f"{f.encode_name}: {ts_decl(ts_type(f.type))}" for f in info.fields)
                out.append(f"export type {TS_NAMES.get(name, name)} = [{members}];\n")
            continue
        lines = [f'  type: "{info.tag}";'] if info.tag else []
        for f in info.fields:
            camel = f.encode_name.split("_")[0] + "".join(w.capitalize() for w in f.encode_name.split("_")[1:])
            lines.append(f"  {camel}{'' if f.required else '?'}: {ts_decl(ts_type(f.type))};")
        fields = "".join(f"\n{line}" for line in lines)
        out.append(f"export interface {TS_NAMES.get(name, name)} {{{fields}{chr(10) if lines else ''}}}\n")
    replies = " | ".join(TS_NAMES.get(t.__name__, t.__name__) for t in p.ReplyBody.__args__)
    return "\n".join(out) + f"\nexport type Reply = {replies};\n"


def ts_schema() -> str:
    tables = {}
    for name, cls in SCHEMAS.items():
        info = mi.type_info(cls)
        fields = []
        for f in info.fields:
            field = [f.encode_name, ts_type(f.type)]
            if not f.required:
                field.append({list: [], dict: {}}.get(f.default_factory, f.default))
            fields.append(f"\n    {json.dumps(field)},")
        head = json.dumps({"tag": info.tag, "array": info.array_like})[:-1]
        tables[name] = f'{head}, "fields": [{"".join(fields)}{chr(10) + "  " if fields else ""}]}}'
    body = "{\n" + "".join(f"  {json.dumps(name)}: {table},\n" for name, table in tables.items()) + "}"
    ops = {k: v for k, v in vars(p.Op).items() if k.isupper()}
    return (
        "// Generated by protocol/vectors/make_vectors.py from protocol/messages.py: do not edit.\n"
        "// Field tables in wire order: [name, type] (required) or [name, type, default]; a field\n"
        "// equal to its default is omitted, as msgspec's omit_defaults does.\n\n"
        'import type { StructTable } from "./codec.js";\n\n'
        f"export const PROTOCOL_VERSION = {p.PROTOCOL_VERSION};\n"
        f"export const HEARTBEAT_INTERVAL_S = {p.HEARTBEAT_INTERVAL_S};\n\n"
        f"export const Op = {json.dumps(ops, indent=2)} as const;\n\n"
        f"export const ERROR_CODES = {json.dumps([c.value for c in p.ErrorCode])} as const;\n\n"
        f"export const STOP_REASONS = {json.dumps([c.value for c in p.StopReason])} as const;\n\n"
        f"export const SPECULATIVE_MODES = {json.dumps([c.value for c in p.SpeculativeMode])} as const;\n\n"
        f"export const TOOL_CHOICES = {json.dumps([c.value for c in p.ToolChoice])} as const;\n\n"
        f"export const FORMAT_TYPES = {json.dumps([c.value for c in p.FormatType])} as const;\n\n"
        f"export const SCHEMAS: Record<string, StructTable> = {body};\n\n"
        "// Message shapes with camelCase keys, as the client takes and returns them. Ints beyond\n"
        "// 2**53 travel as bigint.\n\n" + ts_interfaces()
    )


def main(argv: list[str]) -> int:
    check = "--check" in argv
    entries, files = manifest()
    files["manifest.json"] = (
        json.dumps({"version": p.PROTOCOL_VERSION, "vectors": entries}, indent=1, ensure_ascii=False) + "\n"
    ).encode()
    outputs = {HERE / name: raw for name, raw in files.items()}
    outputs[TS_SCHEMA] = ts_schema().encode()
    stale = [path for path, raw in outputs.items() if not path.exists() or path.read_bytes() != raw]
    known = {HERE / name for name in files} | {Path(__file__).resolve()}
    extra = [path for path in HERE.iterdir() if path.suffix in (".msgpack", ".json") and path not in known]
    if check:
        for path in stale + extra:
            print(f"stale: {path}", file=sys.stderr)
        return 1 if stale or extra else 0
    for path in extra:
        path.unlink()
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(outputs[path])
    print(f"{len(entries)} vectors, {len(stale)} written, {len(extra)} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
