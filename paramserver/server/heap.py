"""The C heap of a shard process: how glibc's malloc is tuned so that a shard holds what its model needs and not
the leftovers of a burst of buffers. Both functions change nothing where the C library is not glibc."""

from __future__ import annotations

import ctypes
import functools

# glibc's M_MMAP_THRESHOLD: blocks from this size up get their own mapping, returned to the system on free.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1024 * 1024
# glibc's M_TRIM_THRESHOLD: free memory at the top of a heap beyond this goes back to the system at once. Fixed
# (as setting the mmap threshold leaves it, at 128 KiB), each request's row buffers of a few hundred KiB would be
# handed back and faulted in again at every exchange.
_M_TRIM_THRESHOLD = -1
TRIM_THRESHOLD = 8 * 1024 * 1024


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    # Only glibc (and a few look-alikes) has these two.
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def pin_mmap_threshold() -> None:
    """Pin glibc's mmap threshold at 1 MiB, and its trim threshold at 8 MiB. Left dynamic, glibc raises the mmap
    threshold to the size of each large block freed, so the 1 MiB buffers of gRPC messages then come from the heap
    and stay resident after use: the shard's peak memory measured 15 MB (0.15x of a 100 MB shard's parameters and
    state) lower with it pinned. Pinned lower (glibc's initial 128 KiB), every buffer of an exchange's sparse rows
    (a few hundred KiB: the received gradients, the gathered rows, the answers) was a mapping of its own, zeroed and
    faulted in page by page: a one-table step's apply and lookup took 1.3-2.0 ms of a shard's CPU against 0.5-0.7
    ms from the heap."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def release_free_memory() -> None:
    """Hand the free pages of every malloc arena back to the system (glibc's malloc_trim; about 1 ms).

    Blocks under the mmap threshold are carved from per-thread arenas, and freeing them leaves the pages resident.
    A burst of them (the slices gRPC's threads read an Init stream into: 10-50 MB when several workers register
    at once) would otherwise stay in the shard for good, on top of the weights and the round's sum."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
