"""The benchmark suite's quick run, as the bench tests start it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 1200  # pytest-timeout's limit for the run: for a machine many times slower than usual, never a verdict


def run_quick(out: Path, sections: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Run `bench/run.py --quick --only SECTIONS --out OUT` to its end, however long it takes; stop it (and so
    every shard and worker it started) if the test is interrupted or timed out meanwhile."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--only", ",".join(sections), "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        # SIGTERM first: the suite then stops every shard and worker it started (SIGKILL would orphan them).
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
