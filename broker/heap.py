"""Giving the heap a burst freed back to the system.

glibc's malloc keeps the memory a burst of frames freed (per-thread arenas,
free chunks below the top of the heap) for reuse, so a long-lived broker
that once took a flood stays at the flood's high-water mark. At a quiet poll
after any frame, at most once per `min_interval_s`, `malloc_trim(0)`
returns free pages to the system: microseconds when there is nothing to
free, a few milliseconds after a flood. Off glibc (macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    def __init__(self, min_interval_s: float = 1.0):
        self.min_interval_s = min_interval_s
        self.frames = 0  # read since the last trim
        self._last = 0.0
        self._trim = _malloc_trim()

    def quiet(self) -> None:
        """The sockets had nothing to read: trim if frames came since the last time."""
        if self._trim is None or not self.frames:
            return
        now = time.monotonic()
        if now - self._last >= self.min_interval_s:
            self.frames, self._last = 0, now
            self._trim(0)
