"""Constrained decoding: a reply held to a JSON schema, a grammar (Lark or
GBNF) or a regex while it is generated, with llguidance.

The worker builds one llguidance tokenizer from the model's own vocabulary
(the GGUF's, through transformers) the first time a request asks, with the
tokens that end a turn as its end of sequence. A generation's `Constraint`
is a matcher on that grammar: before each sampling it gives the tokens
allowed next as a bitmask, and everything else gets -inf. A verify pass of
drafts gets a mask per row (the state after each draft), and drafts the
grammar forbids are cut from the proposal before they cost a row: a
forbidden draft could never stand, so cutting it changes no token.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np

from kvmux.protocol import ErrorCode, Format, FormatType, ProtocolError

from .tool_calls import COMPACT

# Bounds on what one grammar may cost the compute thread (llguidance's own
# defaults are for servers with cores to spare).
LIMITS = llguidance.LLParserLimits(max_grammar_size=500_000, step_lexer_fuel=500_000)


def _invalid(problem: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_ARGUMENT, problem)


class Grammars:
    """The worker's llguidance tokenizer and what compiles against it."""

    def __init__(self, tokenizer, vocab_size: int, eos: set[int]):
        self._hf = tokenizer._tokenizer  # mlx-lm's wrapper holds transformers' fast tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos)
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:  # ~0.4 s: not for a worker that never constrains
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self._eos)
        return self._tokenizer

    def marker(self, text: str) -> str:
        """A tool call marker as a Lark literal: its token where the
        vocabulary holds it as one special token (text would not match it)."""
        ids = self._hf.encode(text.strip(), add_special_tokens=False)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def of_format(self, fmt: Format) -> str:
        """The llguidance grammar (its JSON form) of a Format; invalid_argument
        if it is not one."""
        kind = fmt.type
        if kind == FormatType.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object", "x-guidance": COMPACT})
        if kind == FormatType.JSON_SCHEMA:
            if not isinstance(fmt.schema, dict):
                raise _invalid("format json_schema needs a schema (a JSON object)")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(fmt.schema, defaults=COMPACT)
            except ValueError as exc:
                raise _invalid(f"format json_schema: {exc}") from None
        if kind in (FormatType.LARK, FormatType.GBNF, FormatType.REGEX):
            if not fmt.grammar:
                raise _invalid(f"format {kind} needs a grammar")
            if kind == FormatType.REGEX:
                return llguidance.LLMatcher.grammar_from_regex(fmt.grammar)
            text = fmt.grammar
            if kind == FormatType.GBNF:
                try:
                    text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
                except Exception as exc:  # its parser's own errors, of any type
                    raise _invalid(f"format gbnf: {exc}") from None
            return json.dumps({"grammars": [{"lark_grammar": text}]})
        kinds = ", ".join(k.value for k in FormatType)
        raise _invalid(f"format type must be one of {kinds}")

    @staticmethod
    def either(calls: str, answer: str) -> str:
        """A reply of tool calls (`calls`: Lark rules whose `calls` is one,
        worker/tool_calls.py) or the answer a format's grammar lets through
        (of_format's, nested as @answer)."""
        grammars = json.loads(answer)["grammars"]
        top = [{"lark_grammar": f"start: calls | @answer\n{calls}"}, {**grammars[0], "name": "answer"}, *grammars[1:]]
        return json.dumps({"grammars": top})

    def constraint(self, grammar: str, what: str) -> Constraint:
        """A matcher for one generation; invalid_argument naming `what`
        (format, tool_choice) when llguidance refuses the grammar."""
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=LIMITS)
        if error:
            raise _invalid(f"{what}: the grammar is refused: {messages[0].strip()}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise _invalid(f"{what}: the grammar is refused: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, set(self._eos))


class Constraint:
    """One generation's grammar state: masks for the next token(s), advanced
    by the tokens that stand."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: set[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = eos
        self._bits = llnp.allocate_token_bitmask(1, vocab_size)

    def _rows(self, n: int) -> np.ndarray:
        if self._bits.shape[0] < n:
            self._bits = llnp.allocate_token_bitmask(n, self.vocab_size)
        return self._bits[:n]

    def allowed(self, drafts: list[int]) -> tuple[list[int], mx.array]:
        """The drafts the grammar lets through (a prefix of `drafts`) and a
        mask per row of the pass that feeds them: row i allows what may
        follow the consumed tokens and the first i drafts. An end of
        sequence ends the drafts: the reply ends there, and the matcher,
        stopped, takes nothing after it (nor gives it back)."""
        if self.matcher.is_error():  # a token it never allowed: a bug, not the request's fault
            raise ProtocolError(ErrorCode.INTERNAL, f"the grammar's matcher failed: {self.matcher.get_error()}")
        drafts = drafts[: self.matcher.validate_tokens(drafts)] if drafts and not self.matcher.is_stopped() else []
        ends = next((i for i, token in enumerate(drafts) if token in self.eos), None)
        if ends is not None:
            drafts = drafts[: ends + 1]
        body = drafts[:ends] if ends is not None else drafts  # consumed, then given back
        bits = self._rows(len(drafts) + 1)
        for i, token in enumerate(body):
            llnp.fill_next_token_bitmask(self.matcher, bits, i)
            self.matcher.consume_token(token)
        llnp.fill_next_token_bitmask(self.matcher, bits, len(body))
        bits[len(body) + 1 :] = bits[len(body)]  # past an end of sequence: never read
        if body:
            self.matcher.rollback(len(body))
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        return drafts, mx.array(unpacked.astype(bool))

    def advance(self, tokens: list[int]) -> None:
        """The tokens that stand (each was allowed by its mask); an end of
        sequence ends the reply, so the matcher takes nothing from there."""
        ends = next((i for i, token in enumerate(tokens) if token in self.eos), len(tokens))
        if tokens[:ends] and not self.matcher.is_stopped():
            self.matcher.consume_tokens(tokens[:ends])


def masked(logits: mx.array, mask: mx.array) -> mx.array:
    """Logits where the mask allows, -inf elsewhere (rows of both agree;
    a model's logits may be wider than its vocabulary: padding)."""
    width = logits.shape[-1]
    if mask.shape[-1] < width:
        mask = mx.concatenate([mask, mx.zeros((mask.shape[0], width - mask.shape[-1]), dtype=mx.bool_)], axis=-1)
    return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))
