"""Waiting for a condition instead of a fixed time, and the lines of a server's log by time."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def wait_for(probe: Callable[[], T | None], timeout: float, what: str | Callable[[], str], interval: float) -> T:
    """probe's first true value, polled every `interval` seconds; AssertionError naming `what` (a text, or a
    function saying it at the time) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what if isinstance(what, str) else what()}")


def log_events(path: Path, needle: str) -> list[tuple[float, str]]:
    """(unix time, line) of every line of a log that contains `needle` (logging's asctime, local time)."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if m and needle in line:
            events.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), line))
    return events
