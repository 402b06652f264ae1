"""Child processes that never outlive their parent: the one place that asks Linux for a parent-death signal."""

from __future__ import annotations

import signal
import sys

PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send this process `sig` when its parent dies; return whether that was arranged (False
    elsewhere). Safe between fork and exec (a subprocess preexec_fn): it only calls prctl.

    The default SIGTERM still lets a shard checkpoint and exit cleanly; SIGKILL suits children with nothing to
    save (benchmarks). A parent that dies before the call is not noticed: compare os.getppid() after it.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))) == 0
    except (OSError, AttributeError):
        return False
