"""Child processes that go with their parent: a daemon's workers, a bench's
daemon. Each is started in a session of its own (a terminal's Ctrl-C
reaches the parent alone, which stops them in order), so nothing but this
ties it to its parent's life."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """A child's subprocess preexec_fn: SIGTERM when its parent dies,
    however it dies (Linux's parent-death signal; elsewhere nothing). The
    parent is the thread that started the child: start it from one that
    lives as long as it should."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
