"""The shard's C-heap tuning (paramserver.server.heap) really hands memory back, measured in a fresh process."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc tuning"
)

# Allocate and touch `count` blocks of `size` bytes, free every other one (the live ones keep the freed ones from
# merging into the heap's top, which free() would hand back by itself), then print the anonymous RSS in KiB
# before and after the trim.
SCRIPT = """
import ctypes, sys
from pathlib import Path
from paramserver.server import heap

def anon_kib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

size, count, pin, trim = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if pin:
    heap.pin_mmap_threshold()
libc.free(libc.malloc(size))  # glibc raises a dynamic threshold to the size of a freed mapped block
blocks = [libc.malloc(size) for _ in range(count)]
for b in blocks:
    ctypes.memset(b, 1, size)
for b in blocks[::2]:
    libc.free(b)
before = anon_kib()
if trim:
    heap.release_free_memory()
print(before, anon_kib())
"""


def _anon_kib(size: int, count: int, pin: bool, trim: bool) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(size), str(count), str(int(pin)), str(int(trim))],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_release_free_memory_returns_freed_small_blocks() -> None:
    # 32 MiB freed in 64 KiB blocks: under any mmap threshold, so carved from the heap and left resident.
    before, after = _anon_kib(64 * 1024, 1024, pin=False, trim=True)
    assert before - after > 24 * 1024, (before, after)


def test_pinned_threshold_keeps_large_blocks_out_of_the_heap() -> None:
    # 32 MiB freed in 1 MiB blocks: with the threshold left dynamic, the first free raises it, and the blocks
    # then come from the heap and stay resident when freed; pinned, each is a mapping of its own and goes.
    dynamic, _ = _anon_kib(1024 * 1024, 64, pin=False, trim=False)
    pinned, _ = _anon_kib(1024 * 1024, 64, pin=True, trim=False)
    assert dynamic - pinned > 24 * 1024, (dynamic, pinned)
