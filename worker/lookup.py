"""Drafts from what was already said: where the context's last tokens
occurred before, and what followed them (prompt lookup / suffix decoding,
with no extra model).

A session's `Lookup` indexes its whole token history, including what the
window has dropped, so an agent quoting a file read twenty turns ago, or an
edit repeating its input, drafts the quote. The worker's `recent` lookup
indexes recent replies of every session, for traffic that repeats itself
across sessions (suffix decoding, arXiv 2411.04975).
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_MATCH = 2  # tokens of context that must match before a continuation is drafted
LONGEST_MATCH = 32  # a match is scored by its length up to this
CANDIDATES = 4  # occurrences kept per bigram (the most recent ones)
SEPARATOR = -1  # ends a reply in the worker-wide lookup: no match runs across it


class Lookup:
    """An index of bigram -> where it ended, over a growing token list."""

    def __init__(self, bound: int = 0):
        self.tokens: list[int] = []
        self.where: dict[tuple[int, int], list[int]] = {}
        self.bound = bound  # 0: unbounded; else keep about this many recent tokens

    def extend(self, tokens: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(tokens)
        self._index(max(1, start))
        if self.bound and len(self.tokens) > self.bound:
            self.tokens = self.tokens[-self.bound // 2 :]  # keep the newer half, index it afresh
            self.where = {}
            self._index(1)

    def follow(self, history: Sequence[int]) -> None:
        """Index whatever `history` (a list this lookup mirrors) gained."""
        if len(history) > len(self.tokens):
            self.extend(history[len(self.tokens) :])

    def _index(self, start: int) -> None:
        tokens, where = self.tokens, self.where
        for end in range(start, len(tokens)):
            seen = where.setdefault((tokens[end - 1], tokens[end]), [])
            seen.append(end)
            if len(seen) > CANDIDATES:
                del seen[0]

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest match of the context's
        end ([] if none matches MIN_MATCH tokens or has a continuation)."""
        if len(context) < MIN_MATCH or k < 1:
            return []
        seen = self.where.get((context[-2], context[-1]))
        if not seen:
            return []
        tokens = self.tokens
        best, best_len = -1, 0
        for end in reversed(seen):
            if end == len(tokens) - 1:  # nothing followed it yet
                continue
            length = 2
            while (
                length < LONGEST_MATCH
                and length < len(context)
                and end - length >= 0
                and tokens[end - length] == context[-1 - length]
            ):
                length += 1
            if length > best_len:
                best, best_len = end, length
        if best < 0 or best_len < MIN_MATCH:
            return []
        draft = tokens[best + 1 : best + 1 + k]
        if SEPARATOR in draft:
            draft = draft[: draft.index(SEPARATOR)]
        return draft
