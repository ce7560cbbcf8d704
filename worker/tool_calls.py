"""Tool calls: how a model's chat template asks for them, the grammar that
makes a call certain, and the parser that turns a reply back into calls.

A template that knows tools renders them itself (`tools=`) and says how a
call looks (`ToolFormat`, told apart by the markers its source holds, as
mlx-lm's tool parsers are): Hermes/Qwen `<tool_call>{json}</tool_call>`,
Llama 3.x a bare `{"name", "parameters"}` object, Mistral
`[TOOL_CALLS][{json}, ...]`. A template that does not (the embedded
SmolLM2's) gets the generic format: the tools described in the system
prompt and calls as Hermes's, tool results as user turns in
`<tool_response>` tags (docs/clients.md states it).

`tool_choice` required or a named function (exactly one call of it) is a
Lark grammar over the format's markers and each function's JSON schema
(worker/constraint.py enforces it); `auto` parses whatever the model
writes, or, beside a format, lets through calls or the formatted answer.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from kvmux.protocol import ChatMessage, ErrorCode, NamedTool, ProtocolError, Tool, ToolCall, ToolCallDelta, ToolChoice

# JSON written by a grammar: no free whitespace, which a small model would
# otherwise fill until max_tokens.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # opens a call ("": the reply itself is the call, Llama 3)
    end: str  # closes one ("": the JSON's own end)
    arguments: str  # the key that holds the arguments
    native: bool  # the template renders the tools and tool messages itself
    parallel: bool = True  # a reply may hold several calls


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", native=True)
LLAMA3 = ToolFormat("llama3", "", "", "parameters", native=True, parallel=False)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", native=True)
GENERIC = ToolFormat("generic", "<tool_call>\n", "\n</tool_call>", "arguments", native=False)


def format_of(chat_template: str | None) -> ToolFormat:
    """The tool call format a chat template speaks."""
    source = chat_template if isinstance(chat_template, str) else ""
    if "tools" not in source:
        return GENERIC
    if "<tool_call>" in source:
        return HERMES
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<|python_tag|>" in source or "ipython" in source:
        return LLAMA3
    return GENERIC


def template_tools(tools: list[Tool]) -> list[dict]:
    """Tools as chat templates take them (OpenAI's shape)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters or {"type": "object"},
            },
        }
        for t in tools
    ]


def check_tools(tools: list[Tool]) -> None:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "tools: every function needs its own name")
    for t in tools:
        if not t.name or not t.name.replace("_", "").replace("-", "").isalnum():
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT, f"tools: bad function name {t.name!r} (letters, digits, _ and -)"
            )
        if t.parameters and t.parameters.get("type", "object") != "object":
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"tools: {t.name}'s parameters must be an object schema")


def generic_prompt(tools: list[Tool]) -> str:
    """The system prompt's tool part, for a template without tools."""
    listed = "\n".join(json.dumps(tool["function"]) for tool in template_tools(tools))
    return (
        "You can call these functions:\n<tools>\n"
        f"{listed}\n</tools>\n"
        "To call one, reply with a JSON object in <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
    )


def message_dict(m: ChatMessage, fmt: ToolFormat) -> dict:
    """A protocol message as the chat template takes it: a call or a tool
    result in the format's own way (the generic one's as plain text)."""
    if m.role == "assistant" and m.tool_calls:
        if not fmt.native:
            blocks = "".join(f"{fmt.start}{_call_text(c, fmt)}{fmt.end}" for c in m.tool_calls)
            return {"role": "assistant", "content": f"{m.content}{blocks}"}
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
            for c in m.tool_calls
        ]
        return {"role": "assistant", "content": m.content, "tool_calls": calls}
    if m.role == "tool":
        if not fmt.native:
            return {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
        out = {"role": "tool", "content": m.content}
        if m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
        return out
    return {"role": m.role, "content": m.content}


def _arguments(call: ToolCall) -> dict:
    try:
        value = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"tool call {call.id}: arguments must be a JSON object")
    return value


def _call_text(call: ToolCall, fmt: ToolFormat) -> str:
    return json.dumps({"name": call.name, fmt.arguments: _arguments(call)})


# ---------------------------------------------------------------- grammar


def grammar(tools: list[Tool], choice: str | NamedTool, parallel: bool, fmt: ToolFormat, marker) -> str | None:
    """A Lark grammar (llguidance's) that only lets through calls of the
    chosen tools in `fmt`, or None where the model is free (auto, none).
    `marker(text)` writes a marker as a grammar literal (a special token
    as its token)."""
    if isinstance(choice, NamedTool):
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"tool_choice names {choice.name!r}, which is not a tool")
    elif choice == ToolChoice.REQUIRED:
        if not tools:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "tool_choice required: the session has no tools")
        chosen = tools
    else:
        return None
    return f"start: calls\n{calls_rules(chosen, parallel, fmt, marker)}"


def calls_rules(tools: list[Tool], parallel: bool, fmt: ToolFormat, marker) -> str:
    """Lark rules whose `calls` is a reply of calls of `tools` in `fmt`:
    one, or several where `parallel` and the format allow."""
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, fmt.arguments: t.parameters or {"type": "object"}},
                "required": ["name", fmt.arguments],
                "additionalProperties": False,
            }
            for t in tools
        ],
        "x-guidance": COMPACT,
    }
    several = parallel and fmt.parallel
    if fmt.name == "mistral":
        items = {"type": "array", "items": schema, "minItems": 1, "x-guidance": COMPACT}
        if not several:
            items["maxItems"] = 1
        return f"calls: {marker(fmt.start)} call\ncall: %json {json.dumps(items)}\n"
    call = f"{marker(fmt.start)} body {marker(fmt.end)}" if fmt.start else "body"
    repeat = ' ("\\n" call)*' if several else ""
    return f"calls: call{repeat}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"


# ---------------------------------------------------------------- parsing


@dataclass
class _Call:
    text: str = ""  # the call's JSON so far
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")
    named: bool = False  # its id and name went out
    sent: int = 0  # characters of its arguments sent
    done: bool = False


class ToolCallStream:
    """Reads a reply as it streams: text goes on as text, and a call goes
    out as deltas (id and name once known, then its arguments' JSON as it
    is generated), as OpenAI's streamed tool calls do."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True):
        self.fmt = fmt
        self.parallel = parallel and fmt.parallel
        self.calls: list[_Call] = []
        self.content = ""  # text sent as text
        self._held = ""  # text that may be the start of a call's marker
        self._open: _Call | None = None
        self._after = False  # a call's JSON ended: its end marker (or the next call) may follow
        self._gap = False  # past a call's end marker: spaces are not text
        self._started = False  # some non-space text has been seen (Llama 3: only a reply's start is a call)

    @property
    def finished(self) -> bool:
        """No more calls may follow (parallel calls off, and one is done)."""
        return not self.parallel and any(c.done for c in self.calls) and not self._after

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Text to send as text, and call deltas, for the next piece."""
        out, deltas = "", []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._open is not None:
                buf = self._feed_call(buf, deltas)
                continue
            if self._after:
                buf = self._past_call(buf)
                if buf is None:
                    break
                continue
            if self.finished:
                return out, deltas  # the rest is past the call: dropped, as a stop string's tail is
            if self._gap:
                buf = buf.lstrip()
                self._gap = not buf
                continue
            start = self._call_start(buf)
            if start is None:  # hold what may still become a marker
                keep = self._may_start(buf)
                out += buf[: len(buf) - keep]
                self._held = buf[len(buf) - keep :]
                break
            at, skip = start
            out += buf[:at] if buf[:at].strip() else ""
            self._open = _Call()
            self.calls.append(self._open)
            buf = buf[at + skip :]
        if out.strip():
            self._started = True
        self.content += out
        return out, deltas

    def _past_call(self, buf: str) -> str | None:
        """Just past a call's JSON: its end marker (or Mistral's comma that
        opens the next) and the spaces around them are not text. The rest
        of `buf`, or None with `buf` held (too little to tell yet)."""
        stripped = buf.lstrip()
        end = self.fmt.end.strip()
        if not stripped or (end and end.startswith(stripped) and stripped != end):
            self._held = buf
            return None
        self._after = False
        if end and stripped.startswith(end):
            self._gap = True
            return stripped[len(end) :]
        if self.fmt.name == "mistral" and stripped[0] in ",]":
            if stripped[0] == ",":
                self._open = _Call()
                self.calls.append(self._open)
            return stripped[1:]
        return stripped

    def _call_start(self, buf: str) -> tuple[int, int] | None:
        """Where a call starts in `buf` and the marker's length to skip."""
        if self.fmt.start:
            marker = self.fmt.start.strip()
            at = buf.find(marker)
            if at < 0:
                return None
            skip = len(marker) + (len(buf[at + len(marker) :]) - len(buf[at + len(marker) :].lstrip("\n")))
            return at, skip
        if self._started and not self.calls:
            return None
        stripped = buf.lstrip()
        if stripped.startswith("<|python_tag|>"):
            stripped = stripped[len("<|python_tag|>") :]
        if stripped.startswith("{"):
            return len(buf) - len(stripped), 0
        return None

    def _may_start(self, buf: str) -> int:
        """How much of `buf`'s end to hold back: it may open a call."""
        if self.fmt.start:
            marker = self.fmt.start.strip()
            for n in range(min(len(marker) - 1, len(buf)), 0, -1):
                if marker.startswith(buf[-n:]):
                    return n
            return 0
        if not self._started and not buf.strip():
            return len(buf)  # only spaces so far: a Llama 3 call may still begin
        if not self._started and "<|python_tag|>".startswith(buf.lstrip()):
            return len(buf)
        return 0

    def _feed_call(self, buf: str, deltas: list[ToolCallDelta]) -> str:
        """Add text to the open call; return what is past its end."""
        call = self._open
        if not call.text and self.fmt.name == "mistral":  # its calls are one JSON array
            buf = buf.lstrip()
            buf = buf[1:] if buf.startswith("[") else buf
        call.text += buf
        scan = _scan(call.text, self.fmt.arguments)
        index = self.calls.index(call)
        if scan.name is not None and not call.named:
            call.named = True
            deltas.append(ToolCallDelta(index=index, id=call.id, name=scan.name))
        if call.named and scan.args_start is not None:
            args = call.text[scan.args_start : scan.args_end if scan.args_end is not None else len(call.text)]
            if len(args) > call.sent:
                deltas.append(ToolCallDelta(index=index, arguments=args[call.sent :]))
                call.sent = len(args)
        if scan.end is None:
            return ""
        rest = call.text[scan.end :]
        call.text = call.text[: scan.end]
        call.done = True
        self._open = None
        self._after = bool(self.fmt.end) or self.fmt.name == "mistral"
        return rest

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply's text less its calls, and its calls: those that parsed,
        and one the generation cut (max_tokens) once its name went out, with
        its arguments as far as they were generated (as they streamed).
        Another that does not parse stays text."""
        content, calls = self.content + ("" if self._after else self._held), []
        for call in self.calls:
            scan = _scan(call.text, self.fmt.arguments)
            parsed = _parse(call.text, self.fmt.arguments)
            if parsed is not None:
                name, arguments = parsed
                raw = (
                    call.text[scan.args_start : scan.args_end] if scan.args_start is not None else json.dumps(arguments)
                )
                calls.append(ToolCall(id=call.id, name=name, arguments=raw))
            elif call.named and not call.done:  # cut
                raw = call.text[scan.args_start :] if scan.args_start is not None else ""
                calls.append(ToolCall(id=call.id, name=scan.name, arguments=raw))
            else:  # what was generated, as text
                content += self.fmt.start.strip() + call.text
        return content.strip() if calls else content, calls


@dataclass
class _Scan:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None  # just past the call object's closing brace


def _scan(text: str, arguments: str) -> _Scan:
    """Find, in a call's JSON as far as it has streamed, its name, where
    its arguments' value starts and ends, and where the object ends."""
    out = _Scan()
    depth, in_string, escaped = 0, False, False
    string_start, key, expect_value, value_start, value_depth = 0, None, False, None, 0
    started = False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and value_start is None and not expect_value:
                    key = text[string_start + 1 : i]
                elif depth == 1 and value_start == string_start:
                    if key == "name" and out.name is None:
                        out.name = json.loads(text[string_start : i + 1])
                    if key == arguments and out.args_start is not None and out.args_end is None:
                        out.args_end = i + 1
                    value_start = None
            continue
        if c == '"':
            in_string, string_start = True, i
            if expect_value:
                expect_value, value_start, value_depth = False, i, depth
                if key == arguments:
                    out.args_start = i
            continue
        if c.isspace():
            continue
        if not started:
            if c != "{":
                return out  # not an object: never a call
            started = True
        if expect_value:
            expect_value, value_start, value_depth = False, i, depth
            if key == arguments:
                out.args_start = i
        if c == ":" and depth == 1:
            expect_value = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if value_start is not None and depth == value_depth and text[value_start] in "{[":
                if key == arguments and out.args_end is None:
                    out.args_end = i + 1
                value_start = None
            if depth == 0:
                out.end = i + 1
                return out
        elif c == "," and depth == 1:
            if value_start is not None and key == arguments and out.args_end is None:
                out.args_end = i  # a number, true, false or null
            value_start, key = None, None
    return out


def _parse(text: str, arguments: str) -> tuple[str, dict] | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None
