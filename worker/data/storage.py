"""Where prepared datasets live: a local path, file://, s3:// (s3fs), hdfs:// (pyarrow's libhdfs binding) or
http(s):// (read only), all through fsspec, so that the writer and the reader name storage the same way."""

from __future__ import annotations

import posixpath
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


def write_bytes(url: str, data: bytes) -> None:
    """Store `data` at `url` whole: a local file through a temporary file and a rename, an object store with one
    put (an object appears whole or not at all); http(s) is read only."""
    kind = scheme(url)
    if kind in ("http", "https"):
        raise ValueError(f"{url}: http(s) storage is read only; write the dataset to a path, s3:// or hdfs://")
    if kind == "file":
        local = url[len("file://") :] if url.startswith("file://") else url
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(local, data)
        return
    fs, path = filesystem(url)
    fs.pipe_file(path, data)
