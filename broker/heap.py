"""Giving the heap a burst freed back to the system.

glibc's malloc keeps the memory a burst of frames freed (per-thread arenas,
free chunks below the top of the heap) for reuse, so a long-lived broker
that once took a flood stays at the flood's high-water mark. Two settings
hand it back:

- At a quiet poll after any frame, at most once per `min_interval_s`,
  `malloc_trim(0)` returns free pages to the system: microseconds when there
  is nothing to free, a few milliseconds after a flood.
- glibc raises its mmap threshold to the largest block freed (up to 32 MiB).
  After one multi-megabyte frame, later large buffers (libzmq's for big
  frames) come from the arenas instead of mappings of their own, and the few
  live chunks between them pin pages no trim can return: the broker's RSS
  then swung by 10-16 MB with the timing of its last burst. The threshold
  is fixed at glibc's starting 128 KiB, so a large buffer is unmapped the
  moment it is freed.

Off glibc (macOS) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


class HeapTrimmer:
    def __init__(self, min_interval_s: float = 1.0):
        self.min_interval_s = min_interval_s
        self.frames = 0  # read since the last trim
        self._last = 0.0
        libc = _libc()
        self._trim = getattr(libc, "malloc_trim", None)
        mallopt = getattr(libc, "mallopt", None)
        if self._trim is not None and mallopt is not None:  # glibc
            mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)

    def quiet(self) -> None:
        """The sockets had nothing to read: trim if frames came since the last time."""
        if self._trim is None or not self.frames:
            return
        now = time.monotonic()
        if now - self._last >= self.min_interval_s:
            self.frames, self._last = 0, now
            self._trim(0)
