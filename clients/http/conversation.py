"""The conversation core every API shares: a request as a chat (its
messages and the options of its generate), the session that continues it
(pinned, found by its binding, or opened), the reply generated there, the
session named again after it (binding.py), and the tokens it reused."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request

from kvmux import logs
from kvmux import protocol as p
from kvmux.client import errors

from . import auth, binding
from .binding import Bound
from .errors import bad
from .gateway import PREFIX_HEADER, SESSION_HEADER, Gateway

log = logs.get("http")


DEFAULT_MODEL = "kvmux"  # what a request names for the daemon's default model (each API's default)


@dataclass
class Chat:
    """A request of any API as the chat it continues."""

    messages: list[dict]  # role, content, and a call's tool_calls ({id, name, arguments}) or a result's tool_call_id
    options: dict  # the generate's: sampling, stop, tools' choice, format, logprobs
    model: str  # as the request names it: DEFAULT_MODEL is the daemon's default
    stream: bool = False
    template_kwargs: dict | None = None  # chat_template_kwargs, for a session it opens
    tools: list[p.Tool] = field(default_factory=list)  # for a session it opens
    owner: str = ""  # the caller's (auth.owner): another key's conversation is never continued

    @property
    def context(self) -> dict | None:
        """What a session is opened with beside its messages, and whose it
        is: a request with other template options or tools, or from another
        key, is another conversation."""
        context = {"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else {}
        if self.session_model is not None:
            context["model"] = self.session_model
        if self.owner:
            context["owner"] = self.owner
        if self.tools:
            context["tools"] = [msgspec.to_builtins(t) for t in self.tools]
        return context or None

    @property
    def session_model(self) -> str | None:
        """OpenSession.model: None for DEFAULT_MODEL (the daemon's default)."""
        return None if self.model == DEFAULT_MODEL else self.model


def options(**given: object) -> dict:
    """A generate's options: those given (not None)."""
    return {name: value for name, value in given.items() if value is not None}


async def find_session(gateway: Gateway, request: Request, chat: Chat):
    """The session to continue (pinned, or found by the binding) and the
    messages it still needs; a new one otherwise: (session, Bound, new
    messages). The gateway holds a handle only (detached): the session is
    its caller's and outlives the gateway, whose client would close it on
    the way out."""
    chat.owner = auth.owner(gateway, request)
    auth.prioritize(gateway, request, chat.options)
    prefix = prefix_mode(request)
    client = gateway.client
    pinned = request.headers.get(SESSION_HEADER)  # another key's was refused on the way in (auth.Auth)
    if pinned:
        session = await client.resume_session(pinned)
        await same_model(gateway, session, chat.session_model)
        last = max((i for i, m in enumerate(chat.messages) if m["role"] == "assistant"), default=-1)
        found = session, Bound(session.id, 0, pinned=True), chat.messages[last + 1 :]
    else:
        found = await binding.claim(client, chat.messages, chat.context, chat.owner)
    if found is None:
        messages = chat.messages
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        session = await client.open_session(
            system,
            client_name=chat.owner,
            chat_template_kwargs=chat.template_kwargs,
            tools=chat.tools,
            priority=chat.options.get("priority"),
            prefix=prefix,
            model=chat.session_model,
        )
        found = session, Bound(session.id, 0), messages[1:] if system is not None else messages
    found[0].detach()
    return found


async def same_model(gateway: Gateway, session, named: str | None) -> None:
    """A request that names a model (by id or alias) other than its pinned
    session's is refused: that session would answer with its own model."""
    model = session.opened.model
    if named is None or named == model:
        return
    stats = await gateway.client.stats()
    if named not in next((m.aliases for m in stats.models if m.model == model), []):
        raise bad(f"session {session.id} runs {model}, not {named}", "model")


def prefix_mode(request: Request) -> str | None:
    """The request's X-Kvmux-Prefix (OpenSession.prefix for the session it
    opens: pin its opening, or off), checked."""
    mode = request.headers.get(PREFIX_HEADER)
    if mode is not None and mode not in {m.value for m in p.PrefixMode}:
        raise bad(f"{PREFIX_HEADER} must be one of {', '.join(m.value for m in p.PrefixMode)}", PREFIX_HEADER)
    return mode


@dataclass(frozen=True)
class Usage:
    held: int  # tokens the session held before: reused
    prefilled: int
    completion: int
    restored: int = 0  # tokens a new session took from a shared prefix instead of prefilling them

    @property
    def cached(self) -> int:
        """The prompt's tokens not prefilled: what every API reports as cached."""
        return self.held + self.restored

    @property
    def prompt(self) -> int:
        return self.cached + self.prefilled


@dataclass
class Reply:
    """A generate on its session. Its first chunk is read before the answer
    begins: an error until then is still an HTTP error."""

    session: object
    held: int  # tokens the session held: reused
    stream: object  # the client's AsyncStream
    first: p.Chunk | None
    first_s: float | None  # from the generate sent to its first chunk
    ended: Callable[..., None]  # called with first_s and the usage's tokens at its end (the gateway's metrics)

    @classmethod
    async def start(cls, session, held: int, messages: list[dict], options: dict, ended: Callable[..., None]) -> Reply:
        started = time.monotonic()
        stream = session.generate(messages=[msgspec.convert(m, p.ChatMessage) for m in messages], **options)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        first_s = time.monotonic() - started if first is not None else None
        return cls(session, held, stream, first, first_s, ended)

    async def chunks(self) -> AsyncIterator[p.Chunk]:
        """The stream's chunks, the first included."""
        if self.first is not None:
            yield self.first
            async for chunk in self.stream:
                yield chunk
        usage = self.usage
        self.ended(self.first_s, usage.held, usage.restored, usage.prefilled, usage.completion)

    @property
    def result(self) -> p.GenerateResult:
        return self.stream.result

    @property
    def usage(self) -> Usage:
        result = self.result
        return Usage(self.held, result.prompt_tokens, result.completion_tokens, result.cached_tokens)


def content(text: str, result: p.GenerateResult) -> str:
    """A reply's text as sent (its calls' text never is), less the spaces
    around its calls (the worker's `content`)."""
    return text.strip() if result.tool_calls else text


def calls(result: p.GenerateResult) -> list[dict]:
    """A reply's calls as a kept message holds them."""
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in result.tool_calls]


async def rebind(session, chat: Chat, bound: Bound, text: str, result: p.GenerateResult) -> None:
    """The session now holds the conversation and its reply: name it there,
    under the reply as the client will send it back (its calls too)."""
    if str(result.stop_reason) == "cancelled" or bound.pinned:
        return  # a partial reply: no client will send it back as it is; a pinned session is its client's
    bound.held += result.cached_tokens + result.prompt_tokens + result.completion_tokens
    reply = {"role": "assistant", "content": text}
    if result.tool_calls:
        reply["tool_calls"] = calls(result)
    try:
        await binding.bind(session, bound, [*chat.messages, reply], chat.context)
    except errors.KvmuxError as exc:  # the reply stands; the next turn opens a session anew
        log.warning("gateway_bind_failed", session=session.id, error=str(exc))
