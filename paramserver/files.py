"""Write a file whole or not at all: the one atomic-write helper (checkpoints, saved models, plots, JSON results)."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

# What to write: the bytes, a text (UTF-8), or a function that writes into the open binary file.
Content = bytes | str | Callable[[BinaryIO], object]


def atomic_write(path: str | Path, content: Content, *, durable: bool = False) -> Path:
    """Write `content` to `path` through a temporary file beside it, renamed over it, so a reader never sees half
    a file; return the path. `durable`: fsync the file before the rename and the directory after it, so that a
    crash of the host, not only of this process, leaves the old file or the new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temporary_beside(target)
    try:
        with open(fd, "wb") as f:
            if isinstance(content, bytes):
                f.write(content)
            elif isinstance(content, str):
                f.write(content.encode())
            else:
                content(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)
    return target


def temporary_beside(path: str | os.PathLike[str]) -> tuple[int, Path]:
    """A new file beside `path` to write it in, then rename over it (os.replace): its descriptor, open for
    writing, and its path. Hidden (no reader lists it) and unique to this writer, created exclusively: two
    processes, on one host or two sharing the directory, writing the same path at once never share one."""
    target = Path(path)
    while True:
        tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), tmp
        except FileExistsError:
            continue


def fsync_dir(directory: str | Path) -> None:
    """Make a rename or an unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_files(directory: str | Path, name: re.Pattern[str], shard_index: int) -> list[tuple[int, Path]]:
    """The files of one shard in `directory` whose names match `name` (groups: the shard index, then a version),
    as (version, path), lowest version first; none when the directory does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = name.match(p.name)
        if m and int(m.group(1)) == shard_index:
            found.append((int(m.group(2)), p))
    return sorted(found)
