"""A shard that stops on an error says why in one line, with no traceback from any of its threads, on a busy host."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from paramserver.server.cluster import ERROR_LINE, PORT_LINE

ROOT = Path(__file__).resolve().parents[1]
CASES, BATCH = 50, 10

# A minute of two busy loops and 50 shard processes: it runs in `make stress` (which CI runs), not in `make test`,
# whose other tests it would slow by as much again.
pytestmark = pytest.mark.skipif(
    os.environ.get("PS_STRESS") != "1", reason="50 stops under load run with PS_STRESS=1: make stress"
)


@pytest.fixture
def busy_host() -> Iterator[None]:
    """Two processes spinning on the CPU for the whole test (the load under which the exit once failed)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def test_shards_stopping_on_an_error_print_no_traceback_under_load(busy_host):
    # Four cases in five find their port taken; the others are told to stop while the optimizer's warm-up runs, as
    # ps-server --shards 2 stops its other shard when one port is taken (tests/stop_harness.py).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        began = time.monotonic()
        run = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "stop_harness.py"), str(port), str(CASES), str(BATCH)],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == CASES, run.stdout + run.stderr
    for case in results:
        said = f"{case['kind']} (stopped {case['delay']} s after its port): {case['out']}{case['err']}"
        for noise in ("Traceback", "Fatal Python error", "terminate called", "Exception in thread"):
            assert noise not in case["err"], said
        if case["kind"] == "taken":
            assert case["status"] == 2 and case["out"].startswith(ERROR_LINE), said
            assert f":{port}" in case["out"] and "in use" in case["out"], said
        else:
            assert case["status"] == 0 and case["out"].startswith(PORT_LINE), said
    print(f"{CASES} stops in {time.monotonic() - began:.0f} s")
