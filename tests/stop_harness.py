"""Shard processes of ps-server that stop on an error, many at a time (run as a script by test_stop_on_error.py).

Each case is one shard process as ps-server --shards N starts it (--peers-from-stdin), in one of two ways to fail:
`taken` (its port is in use: it says so and exits 2; four cases in five) or `stopped` (every fifth case: it serves
its port, then is told to stop while it waits for its peers, `delay` seconds after it said its port, as ps-server
stops the others when one shard fails: SIGTERM and its stdin closed; it exits 0). Every case is forked from this
process once it has imported ps-server's modules, torch among them, so a case costs only what follows the import
(the optimizer's warm-up included), and each ends as a process does, through the interpreter's shutdown.

    python tests/stop_harness.py TAKEN_PORT CASES BATCH   ->   one JSON line a case: kind, delay, status, out, err
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import tempfile
import time

from paramserver.server import cli
from paramserver.server.cluster import PORT_LINE

DELAYS = (0.0, 0.05, 0.15, 0.3, 0.5, 0.8)  # the optimizer's warm-up runs ~1 s after the port is said
KEPT: set[int] = set()  # the write ends of the cases' stdin: a case forked later must not hold another's open


class Case:
    """One forked shard process and the ends of its pipes this process keeps."""

    def __init__(self, number: int, taken: int) -> None:
        self.kind = "stopped" if number % 5 == 4 else "taken"
        self.delay = DELAYS[(number // 5) % len(DELAYS)]
        port = taken if self.kind == "taken" else 0
        stdin_r, self.stdin = os.pipe()
        self.stdout, stdout_w = os.pipe()
        self.err = tempfile.TemporaryFile()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the shard: leaves by SystemExit, through the interpreter's shutdown as any process
            os.dup2(stdin_r, 0)
            os.dup2(stdout_w, 1)
            os.dup2(self.err.fileno(), 2)
            for fd in (stdin_r, self.stdin, self.stdout, stdout_w, *KEPT):
                os.close(fd)
            argv = ["--shard-index", "0", "--peers-from-stdin", "--host", "127.0.0.1", "--port", str(port)]
            raise SystemExit(cli.main(argv))
        os.close(stdin_r)
        os.close(stdout_w)
        KEPT.add(self.stdin)

    def read_line(self, timeout: float) -> str:
        """The shard's first line on stdout ('' if it closed it or said nothing in time)."""
        line = b""
        deadline = time.monotonic() + timeout
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            ready, _, _ = select.select([self.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            byte = os.read(self.stdout, 1)
            if not byte:
                break
            line += byte
        return line.decode(errors="replace")

    def finish(self) -> dict[str, object]:
        first = self.read_line(timeout=120)
        if self.kind == "stopped" and first.startswith(PORT_LINE):
            time.sleep(self.delay)
            os.kill(self.pid, signal.SIGTERM)
        os.close(self.stdin)  # a shard waiting for its peers learns there are none
        KEPT.discard(self.stdin)
        _, status = os.waitpid(self.pid, 0)
        rest = b""
        while chunk := os.read(self.stdout, 65536):
            rest += chunk
        os.close(self.stdout)
        self.err.seek(0)
        err = self.err.read().decode(errors="replace")
        self.err.close()
        code = os.waitstatus_to_exitcode(status)
        return {"kind": self.kind, "delay": self.delay, "status": code, "out": first + rest.decode(), "err": err}


taken, cases, batch = (int(a) for a in sys.argv[1:4])
for start in range(0, cases, batch):
    running = [Case(n, taken) for n in range(start, min(cases, start + batch))]
    for case in running:
        print(json.dumps(case.finish()), flush=True)
