"""Stop strings in streamed text (pure Python: no MLX)."""

from __future__ import annotations


class StopMatcher:
    """Finds stop strings in streamed text and holds back any tail that may
    still grow into one, so no stop string is ever sent."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def push(self, segment: str) -> tuple[str, bool]:
        """Add streamed text; return what is safe to send now and whether a
        stop string matched (the text before it is what remains to send)."""
        self.pending += segment
        if not self.stops:
            text, self.pending = self.pending, ""
            return text, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.pending = self.pending[: min(hits)], ""
            return text, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False

    def flush(self) -> str:
        """The held-back tail, once nothing more can complete a stop string."""
        text, self.pending = self.pending, ""
        return text
