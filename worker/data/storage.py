"""Where prepared datasets live: a local path, file://, s3:// (s3fs), hdfs:// (pyarrow's libhdfs binding) or
http(s):// (read only), all through fsspec, so that the writer and the reader name storage the same way.

Listing (`list_files`, for `ps-prepare --follow`) works on every one of them: fsspec's `find` walks a local
directory, an object-store prefix or an HDFS directory; over http(s) it follows the links of the directory's index
page (as `python -m http.server`, nginx's autoindex and Apache serve one), so a server that lists nothing cannot
be followed."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramserver.files import atomic_write

# The packages each scheme needs, for an ImportError that says what to install.
_NEEDS = {"s3": "s3fs", "s3a": "s3fs", "http": "aiohttp", "https": "aiohttp", "hdfs": "pyarrow", "gs": "gcsfs"}


def scheme(url: str) -> str:
    """The URL's scheme ('file' for a plain path)."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep else "file"


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem serving `url` and the path within it; ImportError naming the package a scheme lacks."""
    try:
        import fsspec.core
    except ImportError:
        raise ImportError("prepared datasets need fsspec: pip install 'paramserver[data]'") from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        need = _NEEDS.get(scheme(url), "the fsspec implementation of this scheme")
        raise ImportError(f"{url}: reading {scheme(url)}:// needs {need} (pip install {need}): {exc}") from None
    except ValueError as exc:  # an unknown protocol
        raise ValueError(f"{url}: {exc}") from None
    except OSError as exc:
        if scheme(url) != "hdfs":
            raise
        # pyarrow's HDFS client loads Hadoop's libhdfs into a JVM of this process.
        raise ImportError(
            f"{url}: hdfs:// needs a JVM and Hadoop's libhdfs on this machine (JAVA_HOME, HADOOP_HOME and "
            f"CLASSPATH=$(hadoop classpath --glob), as pyarrow's HadoopFileSystem documents): "
            f"{str(exc).splitlines()[0]}"
        ) from None
    return fs, path


def join(base: str, name: str) -> str:
    """`name` (a relative path within a dataset) under the directory URL `base`."""
    if scheme(base) == "file" and "://" not in base:
        return str(Path(base) / name)
    return posixpath.join(base.rstrip("/"), name)


def read_bytes(url: str) -> bytes:
    """The whole object at `url`; FileNotFoundError naming it when it is not there."""
    fs, path = filesystem(url)
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{url} does not exist") from None


def write_bytes(url: str, data: bytes, *, durable: bool = False) -> None:
    """Store `data` at `url` whole: a local file through a temporary file and a rename, an object store with one
    put (an object appears whole or not at all); http(s) is read only. `durable`: a local file is fsynced before
    its rename (and its directory after), so that a crash of the host leaves the old file or the new one."""
    kind = scheme(url)
    if kind in ("http", "https"):
        raise ValueError(f"{url}: http(s) storage is read only; write the dataset to a path, s3:// or hdfs://")
    if kind == "file":
        local = url[len("file://") :] if url.startswith("file://") else url
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(local, data, durable=durable)
        return
    fs, path = filesystem(url)
    fs.pipe_file(path, data)


@dataclass(frozen=True)
class Listed:
    """A file found under a listed directory."""

    path: str  # relative to the listed directory, "/"-separated
    size: int | None  # bytes; None where the listing does not say (an http index page): ask `stat`
    version: str  # what changes when the file does: its ETag where the storage gives one, else its mtime; or ""


def _version(info: dict[str, Any]) -> str:
    """A file's version from fsspec's info: an ETag (s3, most http servers), else its modification time."""
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "Last-Modified", "updated", "modified"):
        value = info.get(key)
        if value not in (None, ""):
            return str(value)
    return ""


def list_files(url: str) -> list[Listed]:
    """Every file under the directory or prefix `url`, at any depth, in name order; none when it does not exist."""
    fs, root = filesystem(url)
    fs.invalidate_cache()  # s3fs and others cache listings; a follower must see what landed since the last one
    try:
        found = fs.find(root, withdirs=False, detail=True)
    except NotImplementedError:
        raise ValueError(f"{url}: {scheme(url)}:// storage cannot list a directory, so it cannot be followed") from None
    base = fs._strip_protocol(root).rstrip("/")
    out = []
    for name, info in found.items():
        path = fs._strip_protocol(name)
        relative = path[len(base) + 1 :] if path.startswith(base + "/") else path.rsplit("/", 1)[-1]
        size = info.get("size")
        out.append(Listed(relative, None if size is None else int(size), _version(info)))
    return sorted(out, key=lambda f: f.path)


def stat(url: str) -> Listed:
    """The size and version of the file at `url` (its `path` the URL itself); FileNotFoundError when it is gone."""
    fs, path = filesystem(url)
    fs.invalidate_cache()
    info = fs.info(path)
    size = info.get("size")
    return Listed(url, None if size is None else int(size), _version(info))


def last_byte(url: str, size: int) -> bytes:
    """The last byte of the file at `url`, of `size` bytes (one range request where the server takes them)."""
    fs, path = filesystem(url)
    return bytes(fs.cat_file(path, start=max(0, size - 1), end=size))[-1:]
