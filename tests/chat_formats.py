"""The chat formats of the real templates in tests/data/templates, written
out by hand from each model family's documented format, so tests can say
what a session's history must hold without asking a template engine; and
`Chat`, a session's turns checked against them.

Under the embedded model's tokenizer (SmolLM2) `bos_token` is `<|im_start|>`
and `eos_token` is `<|im_end|>`, so that is what the templates' bos_token and
eos_token render as; their other special tokens (`<start_of_turn>`,
`<|eot_id|>`, `[INST]`, ...) are plain text to that vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvmux.protocol import StopReason

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
BOS, EOS = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class Format:
    template: str  # file stem in TEMPLATES
    kwargs: dict | None  # the session's chat_template_kwargs
    first: Callable[[str, str], str]  # (system, user) -> the first append's text
    user: Callable[[str, str], str]  # (system, user) -> a later user message's text
    prompt: str  # the generation prompt
    closing: str  # what the template puts after a reply's content

    @property
    def source(self) -> str:
        return (TEMPLATES / f"{self.template}.jinja").read_text()

    def close(self, end: str) -> str:
        """The closing fed after a reply; less the end-of-turn token `end`
        when the model generated it ("" when something else stopped the
        reply) and the closing starts with it."""
        return self.closing[len(end) :] if end and self.closing.startswith(end) else self.closing

    def turn(self, i: int, system: str, user: str) -> str:
        return (self.first if i == 0 else self.user)(system, user)


def _chatml(system: str, user: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"


def _chatml_user(_system: str, user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n"


CHATML = {"first": _chatml, "user": _chatml_user, "prompt": "<|im_start|>assistant\n", "closing": "<|im_end|>\n"}
LLAMA_DATE = "23 Nov 2026"

FORMATS = {
    "smollm2": Format("smollm2", None, **CHATML),
    # Thinking on: the generation prompt leaves the reply to open its <think>.
    "qwen3-thinking": Format("qwen3", {"enable_thinking": True}, **CHATML),
    "qwen3-no-thinking": Format(
        "qwen3", {"enable_thinking": False}, **{**CHATML, "prompt": "<|im_start|>assistant\n<think>\n\n</think>\n\n"}
    ),
    # The system prompt folded into the first user turn, once.
    "gemma3": Format(
        "gemma3",
        None,
        first=lambda system, user: f"{BOS}<start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n",
        user=lambda _system, user: f"<start_of_turn>user\n{user}<end_of_turn>\n",
        prompt="<start_of_turn>model\n",
        closing="<end_of_turn>\n",
    ),
    # The date stamp, here from the session's chat_template_kwargs.
    "llama3.1": Format(
        "llama3.1",
        {"date_string": LLAMA_DATE},
        first=lambda system, user: (
            f"{BOS}<|start_header_id|>system<|end_header_id|>\n\n"
            f"Cutting Knowledge Date: December 2023\nToday Date: {LLAMA_DATE}\n\n{system}<|eot_id|>"
            f"<|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|>"
        ),
        user=lambda _system, user: f"<|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|>",
        prompt="<|start_header_id|>assistant<|end_header_id|>\n\n",
        closing="<|eot_id|>",
    ),
    # Mistral's v3 format puts the system prompt in the latest user turn:
    # each user turn, when it is appended, is the latest.
    "mistral": Format(
        "mistral",
        None,
        first=lambda system, user: f"{BOS}[INST]{system}\n\n{user}[/INST]",
        user=lambda system, user: f"[INST]{system}\n\n{user}[/INST]",
        prompt="",
        closing=EOS,
    ),
}


class Chat:
    """A session's chat turns, and what its history must hold, built
    alongside (docs/design.md, "A session"): the format's pieces, tokenized
    as they were appended, and the replies' ids as generated."""

    def __init__(self, session, fmt: Format, tokenizer, system: str):
        self.session, self.fmt, self.tokenizer, self.system = session, fmt, tokenizer, system
        self.turns = 0
        self.ids: list[int] = []  # what the history must hold, but for the pending closing
        self.text = ""  # and its text
        self.closing = ""  # the last reply's closing: pending until the next turn

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def turn(self, question: str, **options) -> str:
        """One chat turn; checks it prefilled exactly the pieces the slab
        did not hold yet (the last closing, the message, the generation
        prompt). Returns the reply's text."""
        stream = self.session.chat(question, **options)
        chunks = list(stream)
        generated, result = [t for chunk in chunks for t in chunk.token_ids], stream.result
        pieces = [self.closing, self.fmt.turn(self.turns, self.system, question), self.fmt.prompt]
        self.turns += 1
        fed = [t for piece in pieces for t in self.encode(piece)]
        assert result.prompt_tokens == len(fed), f"{self.fmt.template}, {question!r}: {result}"
        assert result.completion_tokens == len(generated) > 0
        self.closing = self.fmt.close(
            self.tokenizer.decode(generated[-1:]) if result.stop_reason == StopReason.EOS else ""
        )
        self.ids += fed + generated
        self.text += "".join(pieces) + self.tokenizer.decode(generated)
        assert result.history_tokens == len(self.history)
        return "".join(chunk.text for chunk in chunks)

    @property
    def history(self) -> list[int]:
        return self.ids + self.encode(self.closing)

    @property
    def history_text(self) -> str:
        return self.text + self.closing
