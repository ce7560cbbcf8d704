"""A session's chat, rendered with the model's own chat template.

The cache must hold exactly the tokens a one-shot rendering of the whole
conversation would give, so every append renders the full conversation and
tokenizes only the text the new messages added; after a generation the
assistant turn is closed the way the template renders it.
"""

from __future__ import annotations

from kvmux import logs
from kvmux.protocol import ErrorCode, ProtocolError

log = logs.get("worker.conversation")


class Conversation:
    def __init__(self, tokenizer, system: str | None):
        self._tokenizer = tokenizer
        self.messages: list[dict] = [{"role": "system", "content": system}] if system is not None else []
        self.rendered = ""  # template text already turned into history tokens

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        if not messages:
            return ""
        return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _suffix(self, full: str) -> str:
        if not full.startswith(self.rendered):
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT, "the model's chat template re-renders earlier turns; use raw token appends"
            )
        return full[len(self.rendered) :]

    def extend(self, messages: list[dict]) -> str:
        """Add messages; return the template text they add."""
        for msg in messages:
            if msg["role"] not in ("system", "user", "assistant", "tool"):
                raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"unknown chat role {msg['role']!r}")
        full = self._render(self.messages + messages)
        text = self._suffix(full)
        self.messages.extend(messages)
        self.rendered = full
        return text

    def mark(self) -> tuple[int, str]:
        """Where the conversation stands, to roll an extend back to."""
        return len(self.messages), self.rendered

    def rollback(self, mark: tuple[int, str]) -> None:
        del self.messages[mark[0] :]
        self.rendered = mark[1]

    def generation_prompt(self) -> str:
        full = self._render(self.messages, generation_prompt=True)
        text = self._suffix(full)
        self.rendered = full
        return text

    def close_turn(self, content: str, generated_text: str) -> str:
        """Record the assistant's reply; return the text that closes its turn
        (what the template adds after the generated tokens, e.g. `<|im_end|>\\n`)."""
        in_slab = self.rendered + generated_text
        self.messages.append({"role": "assistant", "content": content})
        full = self._render(self.messages)
        self.rendered = full
        if full.startswith(in_slab):
            return full[len(in_slab) :]
        # The reply was cut inside a special token or the template rewrote
        # it: fall back to what the template puts after the content, or to
        # nothing when the content is not there verbatim (never the text
        # before it, which the slab already holds).
        log.warning("turn_close_mismatch", content_chars=len(content))
        at = full.rfind(content) if content else -1
        return full[at + len(content) :] if at >= 0 else ""
