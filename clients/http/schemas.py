"""The request bodies of each API as msgspec Structs: every field the
gateway reads, typed, and no other (`forbid_unknown_fields`: a parameter
kvmux does not honour is refused by name, never dropped). Fields taken only
at the value that changes nothing are checked in `__post_init__`
(`neutral`). A body that does not fit is a 400 naming the parameter by its
path (errors.invalid)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from starlette.requests import Request

from kvmux import protocol as p

from .errors import bad, invalid, not_json

Text = Annotated[str, msgspec.Meta(min_length=1)]
Schema = dict[str, Any]  # a JSON schema


class Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class Sampled(Body):
    """A request that generates: kvmux's extension every API takes (the
    SDKs' extra_body), checked by the worker."""

    speculative: str | None = None  # auto, off, lookup, draft
    priority: int | None = None  # higher first in the daemon's queue and passes (the key's default otherwise)


def neutral(body: Body, **values: object) -> None:
    """Parameters taken only at the value that changes nothing here (or
    null); any other value is refused by name."""
    for name, value in values.items():
        given = getattr(body, name)
        if given is not None and given != value:
            raise bad(f"{name} is not supported by kvmux", name)


async def read(request: Request, schema: type[Body]) -> Body:
    """The request's JSON body as `schema`; a 400 when it is not JSON or does not fit."""
    try:
        return msgspec.json.decode(await request.body(), type=schema)
    except msgspec.ValidationError as exc:
        raise invalid(exc) from None
    except msgspec.DecodeError:
        raise not_json() from None


def convert(value: object, schema: type, at: str):
    """`value` (a part of a body, at path `at`) as `schema`."""
    try:
        return msgspec.convert(value, schema)
    except msgspec.ValidationError as exc:
        raise invalid(exc, at) from None


class Rewind(Body):
    """The page's regenerate (page.py): back to the end of an earlier turn."""

    messages: Annotated[int, msgspec.Meta(ge=0)]  # the conversation's messages to keep


# ------------------------------------------------------------------ OpenAI chat completions


class TextPart(Body, tag="text", tag_field="type"):
    text: str


class Call(Body):
    name: str
    arguments: str  # JSON text


class ToolCall(Body):
    id: str
    function: Call
    type: Literal["function"] = "function"


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers


class Function(Body):
    name: str
    description: str | None = None
    parameters: Schema | None = None
    strict: bool | None = None  # a call kvmux constrains holds to the schema whatever it says

    def tool(self) -> p.Tool:
        return p.Tool(name=self.name, description=self.description or "", parameters=self.parameters or {})


class FunctionTool(Body):
    type: Literal["function"]
    function: Function


class Named(Body):
    name: str


class NamedFunction(Body):
    type: Literal["function"]
    function: Named


class JsonSchema(Body):
    schema: Schema
    name: str | None = None
    description: str | None = None
    strict: bool | None = None  # held to it either way


class PlainText(Body, tag="text", tag_field="type"):
    def format(self) -> None:
        return None  # any text: no constraint


class JsonObject(Body, tag="json_object", tag_field="type"):
    def format(self) -> p.Format:
        return p.Format(type="json_object")


class JsonSchemaFormat(Body, tag="json_schema", tag_field="type"):
    json_schema: JsonSchema

    def format(self) -> p.Format:
        return p.Format(type="json_schema", schema=self.json_schema.schema)


class StreamOptions(Body):
    include_usage: bool = False


Choice = Literal["auto", "none", "required"]


class ChatCompletion(Sampled, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    model: str = "kvmux"
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    n: int = 1
    tools: list[FunctionTool] | None = None
    tool_choice: Choice | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    response_format: PlainText | JsonObject | JsonSchemaFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    user: str | None = None  # an identifier: taken, ignored
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, for a session it opens
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        neutral(self, frequency_penalty=0, presence_penalty=0, logit_bias=None, store=False, metadata=None)
        if self.n != 1:
            raise bad("n must be 1", "n")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad("top_logprobs needs logprobs true", "top_logprobs")


# ------------------------------------------------------------------ Anthropic Messages


class Cached(Body):
    cache_control: dict[str, Any] | None = None  # a caching hint: all that a live session holds is cached


class TextBlock(Cached, tag="text", tag_field="type", kw_only=True):
    text: str


class ToolUseBlock(Cached, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Cached, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock]


class AnthropicTool(Cached, kw_only=True):
    name: str
    input_schema: Schema
    description: str | None = None
    type: Literal["custom"] | None = None

    def tool(self) -> p.Tool:
        return p.Tool(name=self.name, description=self.description or "", parameters=self.input_schema)


class Parallel(Body):
    disable_parallel_tool_use: bool | None = None


class AutoChoice(Parallel, tag="auto", tag_field="type"):
    pass


class AnyChoice(Parallel, tag="any", tag_field="type"):
    pass


class NoChoice(Parallel, tag="none", tag_field="type"):
    pass


class NamedChoice(Parallel, tag="tool", tag_field="type", kw_only=True):
    name: str


class AnthropicMessages(Sampled, kw_only=True):
    max_tokens: int
    messages: Annotated[list[AnthropicMessage], msgspec.Meta(min_length=1)]
    model: str = "kvmux"
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Text] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AutoChoice | AnyChoice | NoChoice | NamedChoice | None = None
    metadata: dict[str, Any] | None = None  # an identifier: taken, ignored
    cache_control: dict[str, Any] | None = None  # a caching hint (as on blocks)


# ------------------------------------------------------------------ OpenAI Responses


class InputText(Body, tag="input_text", tag_field="type"):
    text: str


class OutputText(Body, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] | None = None  # as a response gave it
    logprobs: list[Any] | None = None


class Item(Body):
    id: str | None = None  # an output item sent back as it came
    status: str | None = None


class MessageItem(Item, tag="message", tag_field="type", kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText | OutputText | TextPart]


class FunctionCallItem(Item, tag="function_call", tag_field="type", kw_only=True):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Item, tag="function_call_output", tag_field="type", kw_only=True):
    call_id: str
    output: str


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class ResponsesFunction(Function, tag="function", tag_field="type"):
    pass  # Function's fields, flat


class ResponsesNamed(Body):
    type: Literal["function"]
    name: str


class ResponsesSchema(JsonSchema, tag="json_schema", tag_field="type"):
    """JsonSchema's fields, flat."""

    def format(self) -> p.Format:
        return p.Format(type="json_schema", schema=self.schema)


class TextConfig(Body):
    format: PlainText | JsonObject | ResponsesSchema | None = None


class Responses(Sampled, kw_only=True):
    # Items as dicts here: a message item may leave its type out (items_of reads them).
    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1)]
    model: str = "kvmux"
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[ResponsesFunction] | None = None
    tool_choice: Choice | ResponsesNamed | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # an identifier: taken, ignored
    truncation: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        neutral(self, truncation="disabled", background=False, include=[], reasoning={})

    def items(self) -> list[InputItem]:
        """The input's items (a string: one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return [convert({"type": "message", **item}, InputItem, f"input[{i}]") for i, item in enumerate(self.input)]
