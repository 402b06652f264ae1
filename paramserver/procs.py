"""Child processes that never outlive their parent: the one place that asks Linux for a parent-death signal."""

from __future__ import annotations

import os
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


# A child started with `child_env` finds its parent's pid and signal here, and arranges the parent-death signal
# itself (`follow_parent`, first thing in its main): a subprocess preexec_fn would run Python code between fork and
# exec, where gRPC's fork handlers in a parent that used gRPC abort about one child in a hundred (SIGABRT,
# "epoll_wait error: Bad file descriptor"). Linux sends the signal when the *thread* that started the child ends:
# start such children from a thread that lives as long as they should.
PARENT_ENV = "PARAMSERVER_PARENT"


def child_env(sig: int = signal.SIGTERM) -> dict[str, str]:
    """The environment for a child that must not outlive this process (it calls `follow_parent`)."""
    return {**os.environ, PARENT_ENV: f"{os.getpid()}:{int(sig)}"}


def follow_parent() -> None:
    """In a child started with `child_env`: have Linux send it the parent's chosen signal when the parent dies,
    and exit at once if the parent died before that was arranged. Nothing otherwise."""
    value = os.environ.pop(PARENT_ENV, "")
    if not value:
        return
    pid, sig = (int(part) for part in value.split(":"))
    die_with_parent(sig)
    if os.getppid() != pid:
        sys.exit(f"the process that started this one ({pid}) is gone")
