"""ps-prepare --follow: prepare click logs as they land in a directory or under an object-store prefix, each file
once, into a dataset that grows (docs/continuous.md tells the whole story).

- Which files: every file under SOURCE, at any depth, whose path has no part starting with "." or "_" (Hadoop's
  hidden files: _SUCCESS, _temporary/, .crc; and where a writer puts a file before renaming it into place) and whose
  name matches --pattern; taken in path order.
- When a file is whole: at once when its own directory holds a `_SUCCESS` marker (Hadoop's convention: a job writes
  it once its output directory is complete); otherwise, unless --require-success, once its size and version (ETag
  or modification time) were the same at two listings --settle-seconds apart. A plain-text file (not .gz, not
  .parquet) must also end with a newline, or a pause in the middle of a line could pass for the end.
- What a file becomes: --shards train shards (fewer for a small file) and --test-shards test shards of its held-out
  lines (--test-fraction of each file's lines, spread evenly), named fNNNNNN-SPLIT-I-of-N.parquet after the file's
  place in the dataset; its ids run on from the dataset's, consecutive from one shard to the next; the dense
  features are normalised with the first file's statistics, and every file is read against the first file's schema.
- Exactly once: the manifest is the record. A file's shards are stored (fsynced, on local disk) before the manifest
  that lists them replaces the old one whole (a temporary file and a rename on local disk, one put on an object
  store), with the file's name, size and version in its `files`. A restart reads the manifest and skips what it
  lists; a file cut short by a crash was never listed, and its shards, which no manifest names, are overwritten when
  it is prepared again.
- Bad input: a file that cannot be read as the dataset's kind (undecodable, a bad hash or label, other columns than
  the schema's, empty) is refused, named in one line, and listed in the manifest's `rejected` with the reason; the
  source is left as it is (it may be read only). A refused file is judged again if its size or version changes.
- Storage that fails (a listing, a read, a write): the step is tried again with back-off, one line per try; no file
  is skipped.
"""

from __future__ import annotations

import fnmatch
import gzip
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from paramserver.config import config_field
from worker.data import storage
from worker.data.manifest import MANIFEST, Manifest, Rejected, SourceFile, Split, load_manifest
from worker.data.sources import PrepareConfig

log = logging.getLogger(__name__)

SUCCESS = "_SUCCESS"  # a directory holding this file is complete (Hadoop's marker)
# What a file's content raises when it is no click log of the dataset's kind (gzip's errors are OSErrors: named
# first, so that they are not taken for the storage failing).
_DAMAGED: tuple[type[BaseException], ...] = (ValueError, EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError)
_LONGEST_WAIT = 60.0  # the back-off's ceiling, in seconds

# Called with each file's record once the manifest lists it (taken or refused), and the dataset's manifest then (None
# while no file was taken).
OnFile = Callable[[SourceFile | Rejected, Manifest | None], None]


@dataclass(frozen=True)
class FollowConfig:
    """How ps-prepare --follow watches its source."""

    poll_seconds: float = config_field(2.0, "--follow: seconds between two listings of the source")
    settle_seconds: float = config_field(
        5.0,
        "--follow: a file whose directory holds no _SUCCESS marker is taken once its size and modification time "
        "(or ETag) stayed the same for this many seconds (at two listings at least this far apart); 0: at first "
        "sight, right for object stores, where an object appears whole",
    )
    stop_when_idle: float | None = config_field(
        None,
        "--follow: stop once no file has landed, changed, been taken or refused for this many seconds and none is "
        "settling (default: follow until Ctrl-C or SIGTERM)",
    )
    require_success: bool = config_field(
        False,
        "--follow: take only the files of directories holding a _SUCCESS marker (Hadoop jobs' outputs, whose part "
        "files appear before the job ends); without it, a file in a directory without one is taken once settled",
    )
    pattern: str = config_field("*", "--follow: take only the files whose name matches this glob, e.g. '*.tsv.gz'")

    def __post_init__(self) -> None:
        if not self.poll_seconds > 0:
            raise ValueError(f"poll-seconds must be more than 0, not {self.poll_seconds}")
        if not self.settle_seconds >= 0:
            raise ValueError(f"settle-seconds must be 0 or more, not {self.settle_seconds}")
        if self.stop_when_idle is not None and not self.stop_when_idle >= 0:
            raise ValueError(f"stop-when-idle must be 0 or more, not {self.stop_when_idle}")


def follow(
    source: str,
    out: str,
    config: PrepareConfig,
    watch: FollowConfig | None = None,
    *,
    on_file: OnFile | None = None,
    stop: threading.Event | None = None,
) -> Manifest | None:
    """Prepare each file that lands under `source` into the growing dataset at `out`, once (see the module's
    docstring), calling `on_file` with each file's record and the manifest once it is taken or refused; until
    `stop` is set or, with `watch.stop_when_idle`, nothing happened for that long. Return the dataset's manifest
    (None while no file was prepared). `config` says how a file is prepared (--format criteo, or --categorical and
    --multi-hot for CSV/Parquet tables; its `out` and `progress` are not used)."""
    follower = _Follower(source, out, config, watch or FollowConfig(), on_file)
    return follower.run(stop or threading.Event())


@dataclass(frozen=True)
class _Seen:
    """A file listed and not yet taken: its state, since when it has had it, and when it was first listed."""

    size: int | None
    version: str
    since: float  # time.monotonic()
    landed: float  # time.time()


class _Follower:
    """The state of one follow loop: the dataset so far, and the files seen but not yet taken."""

    def __init__(self, source: str, out: str, config: PrepareConfig, watch: FollowConfig, on_file: OnFile | None):
        _check_kind(config)
        self.source = _normal(source)
        self.out = out
        self.config = replace(config, out=out, progress=False)
        self.watch = watch
        self.on_file = on_file
        _check_apart(self.source, _normal(out))
        if storage.scheme(out) in ("http", "https"):
            raise ValueError(f"--out {out}: http(s) storage is read only; follow into a path, s3:// or hdfs://")
        self.restored = False  # whether the dataset so far was read (the first step, tried again as any other)
        self.manifest: Manifest | None = None
        self.taken: dict[str, int] = {}  # the files the dataset lists, and their sizes then
        self.rejected: dict[str, Rejected] = {}
        self.seen: dict[str, _Seen] = {}
        self.warned: set[str] = set()  # taken files seen changed since, said once each
        self.stirred = False  # whether the last listing found a file new or changed

    def run(self, stop: threading.Event) -> Manifest | None:
        tries = 0  # failed steps in a row
        quiet_since = time.monotonic()
        while not stop.is_set():
            try:
                if not self.restored:
                    self._restore()
                ready, settling = self._poll()
                for name in ready:
                    if stop.is_set():
                        break
                    self._take(name)
                    quiet_since = time.monotonic()
            except _storage_errors() as exc:
                tries += 1
                wait = min(_LONGEST_WAIT, max(1.0, self.watch.poll_seconds) * 2 ** (tries - 1))
                log.warning("ps-prepare --follow: %s; trying again in %.0f s (try %d)", _one_line(exc, ""), wait, tries)
                stop.wait(wait)
                continue
            tries = 0
            if self.stirred:
                quiet_since = time.monotonic()
            idle = self.watch.stop_when_idle
            if idle is not None and not settling and time.monotonic() - quiet_since >= idle:
                break
            stop.wait(self.watch.poll_seconds)
        return self.manifest

    def _restore(self) -> None:
        self.manifest = _restore(self.source, self.out, self.config)
        self.taken = {f.name: f.size for f in self.manifest.files} if self.manifest else {}
        self.rejected = {r.name: r for r in self.manifest.rejected} if self.manifest else {}
        self.restored = True

    def _poll(self) -> tuple[list[str], bool]:
        """The files now whole and not yet taken or refused, in path order; whether another one is settling."""
        listing = storage.list_files(self.source)
        marked = {_directory(f.path) for f in listing if f.path.rsplit("/", 1)[-1] == SUCCESS}
        now = time.monotonic()
        ready, settling, present = [], False, set()
        self.stirred = False
        for entry in listing:
            if not _candidate(entry.path, self.watch.pattern):
                continue
            present.add(entry.path)
            if entry.path in self.taken:
                self._changed_after(entry)
                continue
            if entry.size is None:  # an http index page says no size: ask the file
                entry = replace(storage.stat(self._url(entry.path)), path=entry.path)
            refused = self.rejected.get(entry.path)
            if refused is not None and (refused.size, refused.version) == (entry.size, entry.version):
                continue
            seen = self.seen.get(entry.path)
            if seen is None or (seen.size, seen.version) != (entry.size, entry.version):
                landed = seen.landed if seen is not None else time.time()
                seen = self.seen[entry.path] = _Seen(entry.size, entry.version, now, landed)
                self.stirred = True
            if _directory(entry.path) in marked:
                ready.append(entry.path)
            elif not self.watch.require_success:
                if now - seen.since >= self.watch.settle_seconds:
                    ready.append(entry.path)
                else:
                    settling = True
        for gone in set(self.seen) - present:
            del self.seen[gone]
        return ready, settling

    def _changed_after(self, entry: storage.Listed) -> None:
        """Say once that a file taken has changed since: it is not prepared again."""
        size = self.taken[entry.path]
        if entry.path in self.warned or entry.size in (None, size):
            return
        self.warned.add(entry.path)
        log.warning(
            "ps-prepare --follow: %s changed after it was prepared (%d bytes then, %d now); it is not prepared "
            "again (write a new file instead)",
            entry.path,
            size,
            entry.size,
        )

    def _url(self, name: str) -> str:
        return storage.join(self.source, name)

    def _take(self, name: str) -> None:
        """Prepare one whole file and list it in the manifest, or refuse it."""
        seen = self.seen[name]
        url = self._url(name)
        began = time.monotonic()
        try:
            part = self._prepare(url, seen)
        except FileNotFoundError:
            del self.seen[name]  # gone since the listing
            return
        except _DAMAGED as exc:
            if not self._changed(name, seen):  # else still being written: judged again once settled
                self._refuse(name, seen, _one_line(exc, url))
            return
        if self._changed(name, seen):
            return  # its shards stay unlisted, and are overwritten when it is prepared again
        train = part.splits["train"]
        test = part.splits.get("test", Split(0, ()))
        record = SourceFile(
            name=name,
            size=seen.size or 0,
            version=seen.version,
            landed=seen.landed,
            prepared=time.time(),
            seconds=time.monotonic() - began,
            train=tuple(s.path for s in train.shards),
            train_samples=train.samples,
            test=tuple(s.path for s in test.shards),
            test_samples=test.samples,
        )
        self.rejected.pop(name, None)
        self._commit(_grown(self.manifest, part, record, tuple(self.rejected.values()), self.source))
        self.taken[name] = record.size
        del self.seen[name]
        self._tell(record)

    def _prepare(self, url: str, seen: _Seen) -> Manifest:
        """The file's shards, stored; their manifest (not stored)."""
        from worker.data.clicks import prepare_part

        if not seen.size:
            raise ValueError(f"{url} is empty")
        if _plain_text(url) and storage.last_byte(url, seen.size) != b"\n":
            raise ValueError(f"{url} ends inside a line: still being written, or cut short")
        source = self._source(url)
        before = self.manifest
        stats = None
        if before is not None:
            stats = (np.array(before.normalization["mean"]), np.array(before.normalization["std"]))
        return prepare_part(
            source,
            self.out,
            prefix=f"f{len(before.files) if before else 0:06d}-",
            first_ids={name: split.samples for name, split in before.splits.items()} if before else {},
            shards=self.config.shards,
            test_shards=self.config.test_shards,
            test_fraction=self.config.test_fraction,
            compression=self.config.compression,
            stats=stats,
        )

    def _source(self, url: str) -> Any:
        """The file as a ClickSource (worker.data.clicks), checked against the dataset's schema."""
        from worker.data.sources import click_source

        source = click_source([url], self.config)
        schema = self.manifest.schema if self.manifest is not None else None
        if schema is not None and tuple(source.dense) != schema.dense:
            raise ValueError(
                f"{url}: its dense columns ({', '.join(source.dense) or 'none'}) are not the dataset's "
                f"({', '.join(schema.dense) or 'none'}): another schema than the first file's"
            )
        return source

    def _changed(self, name: str, seen: _Seen) -> bool:
        """Whether the file changed (or went) since it was listed; if so it is watched afresh."""
        try:
            now = storage.stat(self._url(name))
        except FileNotFoundError:
            self.seen.pop(name, None)
            return True
        if (now.size, now.version) == (seen.size, seen.version):
            return False
        self.seen[name] = _Seen(now.size, now.version, time.monotonic(), seen.landed)
        return True

    def _refuse(self, name: str, seen: _Seen, reason: str) -> None:
        record = Rejected(name, seen.size or 0, seen.version, reason, time.time())
        self.rejected[name] = record
        del self.seen[name]
        if self.manifest is not None:  # before the first file is prepared, a restart judges it again
            self._commit(replace(self.manifest, rejected=tuple(self.rejected.values())))
        self._tell(record)

    def _commit(self, manifest: Manifest) -> None:
        """Replace the manifest whole: the one step that makes a file taken (or refused)."""
        storage.write_bytes(storage.join(self.out, MANIFEST), manifest.to_json().encode(), durable=True)
        self.manifest = manifest

    def _tell(self, record: SourceFile | Rejected) -> None:
        if self.on_file is not None:
            self.on_file(record, self.manifest)
        else:
            log.info("%s", describe(record, self.manifest))


def _grown(
    manifest: Manifest | None, part: Manifest, record: SourceFile, rejected: tuple[Rejected, ...], source: str
) -> Manifest:
    """The dataset with one more file: its splits' shard lists extended, never changed."""
    if manifest is None:
        return replace(part, source=source, files=(record,), rejected=rejected)
    splits = dict(manifest.splits)
    for name, split in part.splits.items():
        old = splits.get(name)
        splits[name] = split if old is None else Split(old.samples + split.samples, old.shards + split.shards)
    return replace(manifest, splits=splits, files=(*manifest.files, record), rejected=rejected)


def describe(record: SourceFile | Rejected, manifest: Manifest | None) -> str:
    """A file's progress line: landed -> prepared, its samples and shards, the seconds; or why it was refused."""
    if isinstance(record, Rejected):
        return (
            f"refused {record.name}: {record.reason} (listed in {MANIFEST}'s rejected; nothing of it is in the "
            "dataset; it is judged again if it changes)"
        )
    clock = time.strftime("%H:%M:%S", time.localtime(record.landed))
    line = (
        f"{record.name}: landed {clock} -> prepared {record.prepared - record.landed:.1f} s later "
        f"({record.seconds:.1f} s preparing): {record.train_samples} train samples in {len(record.train)} shards"
    )
    if record.test:
        line += f", {record.test_samples} test samples in {len(record.test)}"
    if manifest is not None:
        train = manifest.splits["train"]
        line += f"; the dataset: {train.samples} train samples in {len(train.shards)} shards"
    return line


def _check_kind(config: PrepareConfig) -> None:
    if config.format != "criteo" and not (config.categorical or config.multi_hot):
        raise ValueError(
            "--follow prepares click logs: say --format criteo for Criteo day files, or --categorical (and "
            "--multi-hot) for CSV or Parquet tables of them"
        )


def _normal(url: str) -> str:
    """A source or output named one way: a local path absolute, a URL without a trailing slash."""
    if "://" not in url:
        return str(Path(url).resolve())
    if url.startswith("file://"):
        return str(Path(url[len("file://") :]).resolve())
    return url.rstrip("/")


def _check_apart(source: str, out: str) -> None:
    if out == source or out.startswith(source + "/"):
        raise ValueError(f"--out {out} lies under the followed {source}: its shards would be taken as logs")


def _restore(source: str, out: str, config: PrepareConfig) -> Manifest | None:
    """The dataset a previous ps-prepare --follow of `source` grew at `out`, or None; ValueError where `out` holds
    another one. On local disk, the temporary files a killed run left are removed (one follower per dataset)."""
    if storage.scheme(out) == "file":
        local = Path(_normal(out))
        for tmp in (*local.glob(".f*.parquet.*.tmp"), *local.glob(f".{MANIFEST}.*.tmp")):
            tmp.unlink(missing_ok=True)
    try:
        manifest = load_manifest(out)
    except FileNotFoundError:
        return None
    if not manifest.files:
        raise ValueError(f"{out} holds a dataset prepared without --follow: follow into another --out")
    if manifest.source != source:
        raise ValueError(f"{out} is the dataset of {manifest.source}, not of {source}: follow into another --out")
    ours = _features(config)
    theirs = [(c.name, c.multi_hot) for c in manifest.schema.categorical] if manifest.schema else []
    if ours != theirs:
        raise ValueError(
            f"{out} has the categorical features {theirs}, and these flags say {ours}: give the flags it was "
            "prepared with (or follow into another --out)"
        )
    return manifest


def _features(config: PrepareConfig) -> list[tuple[str, bool]]:
    """The categorical features (name, multi-hot) the flags give a dataset."""
    if config.format == "criteo":
        from worker.data.clicks import CATEGORICAL

        return [(c, False) for c in CATEGORICAL]
    from worker.data.click_tables import parse_multi_hot

    one_hot = [c.strip() for c in config.categorical.split(",") if c.strip()]
    return [(c, False) for c in one_hot] + [(c, True) for c in parse_multi_hot(config.multi_hot)]


def _directory(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _candidate(path: str, pattern: str) -> bool:
    """Whether a listed file is one to take: no hidden part (".x", "_x"), a name matching the pattern."""
    parts = path.split("/")
    return not any(p.startswith((".", "_")) for p in parts) and fnmatch.fnmatch(parts[-1], pattern)


def _plain_text(url: str) -> bool:
    return not url.split("?")[0].lower().endswith((".gz", ".parquet"))


def _one_line(exc: BaseException, url: str) -> str:
    """An error in one line that names `url`: a ValueError's message, else its kind and message too."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if not isinstance(exc, ValueError) or not text:
        text = f"{type(exc).__name__}: {text}".rstrip(": ")
    return text if url in text else f"{url}: {text}"


def _storage_errors() -> tuple[type[BaseException], ...]:
    """What storage raises when it fails: OSError (the local disk, s3fs, HDFS), and aiohttp's errors (http)."""
    errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)
    try:
        import aiohttp

        errors += (aiohttp.ClientError,)
    except ImportError:
        pass
    return errors
