"""A session's chat, rendered with the model's own chat template.

The session's tokens are the truth: what was fed stays as it was fed, and a
reply stays the ids the model generated. So a template is never trusted to
render earlier turns the same way twice (Qwen3 strips an earlier reply's
thinking, Llama 3.x stamps dates, Mistral moves the system prompt to the
latest user turn): only the first piece renders the conversation for real,
and every later piece is the text the template puts after the conversation
so far. It is found by rendering the conversation with its last message's
content swapped for a sentinel, with and without what is added: the piece
is what follows the sentinel in the one, past what follows it in the other
(the last turn's closing, fed already).
"""

from __future__ import annotations

import secrets
from inspect import signature

from transformers import PreTrainedTokenizerBase

from kvmux.protocol import ErrorCode, ProtocolError, Tool

from .tool_calls import ToolFormat, generic_prompt, template_tools

ROLES = ("system", "user", "assistant", "tool")

# apply_chat_template's own options, and the variable it sets itself: not
# template variables a session may set.
RESERVED_KWARGS = {"messages", *signature(PreTrainedTokenizerBase.apply_chat_template).parameters} - {"self", "kwargs"}


def _refused(problem: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_ARGUMENT, f"the model's chat template {problem}")


class Conversation:
    def __init__(
        self, tokenizer, messages=(), rendered: str = "", kwargs: dict | None = None, tools: list[dict] | None = None
    ):
        self._tokenizer = tokenizer
        self.messages: list[dict] = list(messages)
        self.rendered = rendered  # the text fed so far: template pieces and the replies as generated
        self.kwargs: dict = dict(kwargs or {})  # the session's chat_template_kwargs
        self.tools: list[dict] = list(tools or [])  # for a template that renders tools (worker/tool_calls.py)
        self._closing = ""  # what closes the reply the last generation prompt opened

    @classmethod
    def open(
        cls, tokenizer, system: str | None, kwargs: dict | None, tools: list[Tool] = (), fmt: ToolFormat | None = None
    ) -> Conversation:
        """A new session's conversation, its system prompt, tools and
        template options tried on the template now rather than at the first
        append. A template that does not render tools gets them in the
        system prompt (`fmt` generic)."""
        reserved = sorted(RESERVED_KWARGS.intersection(kwargs or ()))
        if reserved:
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT,
                f"chat_template_kwargs holds template variables; {', '.join(reserved)} may not be set there",
            )
        rendered_tools = []
        if tools and fmt.native:
            rendered_tools = template_tools(tools)
        elif tools:
            system = generic_prompt(tools) + (f"\n\n{system}" if system else "")
        messages = [{"role": "system", "content": system}] if system is not None else []
        conv = cls(tokenizer, messages, kwargs=kwargs, tools=rendered_tools)
        if system is not None or kwargs or tools:
            conv._render([*conv.messages, {"role": "user", "content": "Hello."}], generation_prompt=True)
        return conv

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        if not getattr(
            self._tokenizer, "has_chat_template", self._tokenizer.chat_template
        ):  # mlx-lm's wrapper, or HF's
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT,
                "the model has no chat template (a base model's file often has none): "
                "start its worker with --chat-template FILE, or use raw token appends",
            )
        try:
            return self._tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                tools=self.tools or None,
                **self.kwargs,
            )
        except Exception as exc:  # raise_exception() in the template, or its errors on these messages or options
            raise _refused(f"refuses this conversation: {exc}") from None

    def _after_content(self, messages: list[dict], at: int, generation_prompt: bool = False) -> str:
        """What the template renders after the content of `messages[at]`,
        found through a sentinel in its place (random: no message holds it)."""
        mark = f"kvmux-{secrets.token_hex(8)}"
        text = self._render([*messages[:at], {**messages[at], "content": mark}, *messages[at + 1 :]], generation_prompt)
        if text.count(mark) != 1:
            raise _refused("does not render a message's content verbatim; use raw token appends")
        return text[text.index(mark) + len(mark) :]

    def _after(self, new: list[dict], generation_prompt: bool) -> str:
        """What the template renders after the conversation so far (its
        last turn's closing, fed already) for `new` and the generation prompt."""
        last = len(self.messages) - 1
        closing = self._after_content(self.messages, last)
        tail = self._after_content(self.messages + new, last, generation_prompt)
        if not tail.startswith(closing):
            raise _refused("closes a turn differently once more follows; use raw token appends")
        return tail[len(closing) :]

    def _piece(self, new: list[dict], generation_prompt: bool = False) -> str:
        """The text to feed for `new` (and the generation prompt): the first
        piece renders the conversation for real, so a template that folds
        the system prompt into the first turn does so."""
        if self.rendered:
            text, checked = self._after(new, generation_prompt), new
        else:
            text = self._render(self.messages + new, generation_prompt)
            checked = self.messages + new
        for m in checked:
            if m["role"] == "system" and m["content"].strip() not in text:
                raise _refused(
                    "drops this system message here (it may render it only beside a user message): append one with it"
                )
        return text

    def extend(self, messages: list[dict]) -> str:
        """Add messages; return the text they add."""
        for msg in messages:
            if msg["role"] not in ROLES:
                raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"unknown chat role {msg['role']!r}")
        text = self._piece(messages)
        self.messages.extend(messages)
        self.rendered += text
        return text

    def mark(self) -> tuple[int, str]:
        """Where the conversation stands, to roll an extend back to."""
        return len(self.messages), self.rendered

    def rollback(self, mark: tuple[int, str]) -> None:
        del self.messages[mark[0] :]
        self.rendered = mark[1]

    def generation_prompt(self) -> str:
        """The text that opens the assistant's turn. What will close it is
        found now too, so a template that cannot close one fails before
        the reply is generated, not after."""
        text = self._piece([], generation_prompt=True)
        self._closing = self._after_content([*self.messages, {"role": "assistant", "content": ""}], len(self.messages))
        self.rendered += text
        return text

    def close_turn(self, reply: str, generated: str, end: str) -> str:
        """Record the assistant's `reply` (the text sent); return the text
        that closes its turn: what the template puts after a reply's content
        (e.g. `<|im_end|>\\n`), less the end-of-turn token the model
        generated when the closing starts with it. `generated` is the text
        of the generated ids; `end` that of the token that ended the turn,
        or "" when something else stopped the reply."""
        self.messages.append({"role": "assistant", "content": reply})
        closing = self._closing[len(end) :] if end and self._closing.startswith(end) else self._closing
        self.rendered += generated + closing
        return closing
