"""Serve a local directory over HTTP with Python's own server, in a process of its own: how `make demo
DATA=sharded` and the tests put a prepared dataset behind a URL. (For production, any web server or object store
that answers GET serves a prepared dataset as it is.)"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType

_SERVING = re.compile(r"Serving HTTP on \S+ port (\d+)")


class FileServer:
    """`python -m http.server` on 127.0.0.1 and a free port, serving `directory` until closed; `url` is its root."""

    def __init__(self, directory: str | Path, host: str = "127.0.0.1", timeout: float = 30.0) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"{directory} is not a directory")
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "http.server", "--bind", host, "--directory", str(self.directory), "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # one line per request
            text=True,
        )
        port: list[int] = []
        found = threading.Event()

        def read() -> None:
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                match = _SERVING.search(line)
                if match and not port:
                    port.append(int(match.group(1)))
                    found.set()
            found.set()

        threading.Thread(target=read, name="http-server-output", daemon=True).start()
        if not found.wait(timeout) or not port:
            self.close()
            raise RuntimeError(f"the HTTP server for {directory} did not start within {timeout:.0f} s")
        self.url = f"http://{host}:{port[0]}"

    def close(self) -> None:
        """Stop the server process."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> FileServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
