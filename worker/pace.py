"""How many prefill tokens a pass may carry while other sessions decode.

A pass shared with decoding streams delays every stream's next token by
what its prefill tokens add. `Pace` keeps such a round near `STALL` times a
decode-only round: it times the rounds, grows the share by a token after a
round within the bound and cuts it by a quarter after one past it. Measured,
not assumed, because what a prefill token costs depends on the machine, the
model, the number of streams and how full the slabs are, and a shared pass
has a fixed cost of its own besides.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL = 2.0  # a round with prefill should take at most about this many times a decode-only round
SMOOTHING = 0.2  # weight of the newest decode-only round in their running average


@dataclass
class Pace:
    most: int  # the share never exceeds a whole chunk
    share: int = 8  # prefill tokens for the next round shared with decode steps
    decode_s: float = 0.0  # running average of decode-only rounds

    def observe(self, seconds: float, decoding: bool, prefill_tokens: int) -> None:
        """A round's duration, whether it had decode steps, and its prefill tokens."""
        if not decoding:
            return
        if not prefill_tokens:
            self.decode_s = seconds if not self.decode_s else (1 - SMOOTHING) * self.decode_s + SMOOTHING * seconds
        elif self.decode_s:
            if seconds > STALL * self.decode_s:
                self.share = max(1, self.share * 3 // 4)
            else:
                self.share = min(self.most, self.share + 1)
