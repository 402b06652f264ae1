"""ps-prepare --follow (worker/data/follow.py): click logs prepared as they land, each file once across restarts
(a SIGKILLed process included), a manifest that a concurrent reader always finds whole, files taken only once whole
(write+rename, slow writes, _SUCCESS markers), damaged and other-schema files refused while the loop goes on,
--stop-when-idle and SIGTERM, and a source followed over http through the repository's file server."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from worker.data.clicks import held_out, share_of
from worker.data.fileserver import FileServer
from worker.data.follow import FollowConfig, follow
from worker.data.manifest import Manifest, Rejected, SourceFile, load_manifest
from worker.data.prepare import PrepareConfig
from worker.data.stream import Part, StreamedDataset

CRITEO = PrepareConfig(format="criteo", shards=2, test_shards=1, progress=False)
FAST = FollowConfig(poll_seconds=0.05, settle_seconds=0.0, stop_when_idle=0.3)
WAIT = 120.0  # seconds any condition may take on a busy machine before a test fails


def _criteo(file_no: int, n: int) -> str:
    """n Criteo lines; C1 is the line's own number (file_no * 100000 + line), so each line can be found again."""
    rng = np.random.default_rng(file_no)
    lines = []
    for i in range(n):
        ints = [str(v) for v in rng.integers(0, 100, 13)]
        cats = [f"{file_no * 100_000 + i:08x}", *(f"{v:08x}" for v in rng.integers(0, 2**32, 25))]
        lines.append("\t".join([str(int(rng.integers(0, 2))), *ints, *cats]))
    return "\n".join(lines) + "\n"


def _land(path: Path, text: str) -> None:
    """Write a file whole under a hidden name, then rename it into place (how a local writer should)."""
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".gz":
        tmp.write_bytes(gzip.compress(text.encode()))
    else:
        tmp.write_text(text)
    os.replace(tmp, path)


def _wait(condition: Callable[[], object], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _manifest(out: Path) -> Manifest | None:
    try:
        return load_manifest(str(out))
    except FileNotFoundError:
        return None


def _taken(out: Path) -> list[str]:
    manifest = _manifest(out)
    return [f.name for f in manifest.files] if manifest else []


def _lines_seen(out: Path) -> np.ndarray:
    """Every line's number (its C1), from every shard of both splits, sorted."""
    manifest = load_manifest(str(out))
    ids = [
        pq.read_table(out / s.path, columns=["cat_C1"]).column("cat_C1").to_numpy()
        for split in manifest.splits.values()
        for s in split.shards
    ]
    return np.sort(np.concatenate(ids))


def _check_whole(out: Path, files: dict[str, tuple[int, int]]) -> Manifest:
    """The dataset holds each of `files` (name -> (file number, lines)) once: its lines once each, its training
    lines' count, and ids that run on from shard to shard over the split."""
    manifest = load_manifest(str(out))
    assert sorted(f.name for f in manifest.files) == sorted(files)
    expected = np.sort(np.concatenate([no * 100_000 + np.arange(n) for no, n in files.values()]))
    assert np.array_equal(_lines_seen(out), expected)  # every line once: none lost, none twice
    share = share_of(CRITEO.test_fraction)
    for record in manifest.files:
        n = files[record.name][1]
        assert record.train_samples == int((~held_out(0, n, share)).sum())
        assert record.test_samples == n - record.train_samples
    for split in manifest.splits.values():
        at = 0
        for shard in split.shards:
            ids = np.sort(pq.read_table(out / shard.path, columns=["id"]).column("id").to_numpy())
            assert np.array_equal(ids, np.arange(at, at + shard.samples)), shard.path
            at += shard.samples
        assert at == split.samples
    return manifest


class _Reader(threading.Thread):
    """A worker's view while the dataset grows: it polls the manifest and reads each shard as soon as it is listed
    (size and SHA-256 checked against the manifest), and checks that a listed shard never changes and the splits
    only grow."""

    def __init__(self, out: Path) -> None:
        super().__init__(name="manifest-reader", daemon=True)
        self.out = out
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.manifests = 0

    def run(self) -> None:
        before: Manifest | None = None
        read: set[str] = set()
        while not self.stop.is_set():
            try:
                data = StreamedDataset(str(self.out))
            except FileNotFoundError:
                time.sleep(0.01)
                continue
            try:
                now = data.manifest
                if before is not None:
                    for name, split in before.splits.items():
                        assert now.splits[name].shards[: len(split.shards)] == split.shards, "a listed shard changed"
                    assert now.normalization == before.normalization and now.schema == before.schema
                for split in now.splits.values():
                    for shard in split.shards:
                        if shard.path not in read:
                            data.read(Part(shard, np.arange(shard.samples)))
                            read.add(shard.path)
                before = now
                self.manifests += 1
            except BaseException as exc:  # handed to the test
                self.errors.append(exc)
                return

    def close(self) -> None:
        self.stop.set()
        self.join(timeout=60)
        assert not self.errors, self.errors


class _Following:
    """follow() on a thread of its own until closed."""

    def __init__(self, source: str, out: Path, config: PrepareConfig, watch: FollowConfig) -> None:
        self.stop = threading.Event()
        self.records: list[SourceFile | Rejected] = []
        self.result: list[object] = []

        def run() -> None:
            try:
                on_file = lambda record, manifest: self.records.append(record)  # noqa: E731
                self.result.append(follow(source, str(out), config, watch, on_file=on_file, stop=self.stop))
            except BaseException as exc:
                self.result.append(exc)

        self.thread = threading.Thread(target=run, name="follow", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "follow() did not stop"
        assert not any(isinstance(r, BaseException) for r in self.result), self.result


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts, killed when it ends, however it ends."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _cli(src: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "worker.data.prepare",
        "--follow",
        str(src),
        "--out",
        str(out),
        "--format",
        "criteo",
        "--shards",
        "2",
        "--test-shards",
        "1",
        "--poll-seconds",
        "0.05",
        "--no-progress",
        *extra,
    ]


def test_files_landing_over_time_are_prepared_once_and_a_reader_never_sees_a_missing_shard(tmp_path: Path) -> None:
    src, out = tmp_path / "logs", tmp_path / "live"
    src.mkdir()
    reader = _Reader(out)
    reader.start()
    following = _Following(str(src), out, CRITEO, FollowConfig(poll_seconds=0.05, settle_seconds=1.0))
    try:
        files = {}
        for no in range(4):  # written whole under a hidden name, then renamed: taken once settled
            name = f"day_{no}.tsv" + (".gz" if no % 2 else "")
            _land(src / name, _criteo(no, 300 + 50 * no))
            files[name] = (no, 300 + 50 * no)
            _wait(lambda name=name: name in _taken(out), f"{name} taken")
        # A slow writer appending in pieces, each piece cut inside a line: until the last, the file ends inside a
        # line, so however long the writer pauses, no listing finds it whole (it may be refused, then judged again).
        text = _criteo(7, 400)
        cuts = [i + 20 for i in range(0, len(text), 997)][:-1]
        with open(src / "day_7.tsv", "w") as f:
            for lo, hi in zip([0, *cuts], [*cuts, len(text)], strict=True):
                f.write(text[lo:hi])
                f.flush()
                time.sleep(0.002)
        files["day_7.tsv"] = (7, 400)
        _wait(lambda: "day_7.tsv" in _taken(out), "the slowly written file taken")
    finally:
        following.close()
        reader.close()
    assert reader.manifests > 0
    manifest = _check_whole(out, files)
    assert [f.name for f in manifest.files][:4] == [f"day_{no}.tsv" + (".gz" if no % 2 else "") for no in range(4)]
    assert not manifest.rejected  # a file refused while it was written is no longer listed once taken
    assert [r.name for r in following.records if isinstance(r, SourceFile)] == [f.name for f in manifest.files]


def test_a_sigkilled_follow_restarted_prepares_every_file_exactly_once(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    src, out, ref = tmp_path / "logs", tmp_path / "live", tmp_path / "reference"
    src.mkdir()
    files = {f"day_{no:02d}.tsv": (no, 1500) for no in range(7)}
    for name, (no, n) in files.items():
        _land(src / name, _criteo(no, n))
    follow(str(src), str(ref), CRITEO, FAST)  # the same files, uninterrupted
    for listed in (1, 3, 5):  # killed just after the manifest lists `listed` files: most likely inside the next one
        proc = subprocess.Popen(_cli(src, out, "--settle-seconds", "0"), stdout=subprocess.DEVNULL, text=True)
        procs.append(proc)
        _wait(lambda n=listed, p=proc: len(_taken(out)) >= n or p.poll() is not None, f"{listed} files listed")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # What a kill between storing a file's shards and listing them leaves: shards no manifest names. The next file's
    # are planted here as junk: the restart overwrites them.
    at = len(_taken(out))
    for split in ("train-00000-of-00002", "train-00001-of-00002", "test-00000-of-00001"):
        (out / f"f{at:06d}-{split}.parquet").write_bytes(b"half a shard")
    last = subprocess.run(
        _cli(src, out, "--settle-seconds", "0", "--stop-when-idle", "0.5"),
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert last.returncode == 0, last.stderr
    assert "idle for 0.5 s: 7 files" in last.stdout
    manifest = _check_whole(out, files)
    reference = load_manifest(str(ref))
    assert manifest.splits == reference.splits  # shard for shard, byte for byte (their SHA-256)
    assert [f.name for f in manifest.files] == sorted(files)
    assert not list(out.glob(".*")), "a killed run's temporary files are cleared by the next"


def test_damaged_and_other_schema_files_are_refused_and_the_loop_goes_on(tmp_path: Path) -> None:
    src, out = tmp_path / "logs", tmp_path / "live"
    src.mkdir()
    good = _criteo(0, 200)
    _land(src / "a_good.tsv", good)
    lines = _criteo(1, 50).splitlines()
    fields = lines[10].split("\t")
    _land(src / "b_bad_hash.tsv", "\n".join([*lines[:10], "\t".join([*fields[:20], "zzzzzzzz", *fields[21:]])]) + "\n")
    _land(src / "c_bad_label.tsv", "\n".join(["2" + lines[3][1:], *lines[4:]]) + "\n")
    _land(src / "d_columns.tsv", "\n".join("\t".join(line.split("\t")[:39]) for line in lines) + "\n")
    (src / "e_cut.tsv.gz").write_bytes(gzip.compress(_criteo(2, 100).encode())[:-30])
    (src / "f_binary.tsv").write_bytes(bytes(range(256)) * 8 + b"\n")
    _land(src / "g_good.tsv", _criteo(3, 120))
    (src / "h_unended.tsv").write_text(_criteo(4, 10)[:-1])  # its last line has no newline: maybe not written whole
    told: list[SourceFile | Rejected] = []
    manifest = follow(str(src), str(out), CRITEO, FAST, on_file=lambda record, manifest: told.append(record))
    assert manifest is not None
    _check_whole(out, {"a_good.tsv": (0, 200), "g_good.tsv": (3, 120)})
    refused = {r.name: r.reason for r in manifest.rejected}
    assert sorted(refused) == [
        "b_bad_hash.tsv",
        "c_bad_label.tsv",
        "d_columns.tsv",
        "e_cut.tsv.gz",
        "f_binary.tsv",
        "h_unended.tsv",
    ]
    assert "zzzzzzzz is not an 8-hex-digit hash" in refused["b_bad_hash.tsv"]
    assert "the label 2 is not 0 or 1" in refused["c_bad_label.tsv"]
    assert "Expected 40 columns, got 39" in refused["d_columns.tsv"]
    assert "ends inside a line" in refused["h_unended.tsv"]
    assert all("\n" not in reason and str(src) in reason for reason in refused.values())  # each names its file
    assert [r.name for r in told if isinstance(r, Rejected)] == sorted(refused)
    # A restart judges none of them again; a refused file that changes is judged again, and taken if now whole.
    (src / "h_unended.tsv").write_text(_criteo(4, 10))
    again = follow(str(src), str(out), CRITEO, FAST)
    assert again is not None and [f.name for f in again.files] == ["a_good.tsv", "g_good.tsv", "h_unended.tsv"]
    assert "h_unended.tsv" not in {r.name for r in again.rejected} and len(again.rejected) == 5


def test_a_table_of_another_schema_is_refused(tmp_path: Path) -> None:
    src, out = tmp_path / "logs", tmp_path / "live"
    src.mkdir()
    config = PrepareConfig(label="clicked", categorical="user,item", shards=2, progress=False)
    rows = "\n".join(f"{i % 2},{i % 7},{i % 5},{i * 0.5}" for i in range(60))
    _land(src / "a.csv", "clicked,user,item,price\n" + rows + "\n")
    _land(src / "b.csv", "clicked,user,item,price,extra\n" + "\n".join(r + ",1" for r in rows.splitlines()) + "\n")
    _land(src / "c.csv", "clicked,user,price\n" + "\n".join(f"{i % 2},{i},{i}" for i in range(60)) + "\n")
    _land(src / "d.csv", "clicked,user,item,price\n" + rows + "\n")
    manifest = follow(str(src), str(out), config, FAST)
    assert manifest is not None and [f.name for f in manifest.files] == ["a.csv", "d.csv"]
    refused = {r.name: r.reason for r in manifest.rejected}
    assert "its dense columns (price, extra) are not the dataset's (price)" in refused["b.csv"]
    assert "has no column 'item'" in refused["c.csv"]
    assert manifest.schema is not None and manifest.schema.dense == ("price",)
    with pytest.raises(ValueError, match="categorical features"):  # a restart with other flags is refused
        follow(str(src), str(out), PrepareConfig(label="clicked", categorical="user", progress=False), FAST)


def test_success_markers_and_hidden_files(tmp_path: Path) -> None:
    src, out = tmp_path / "logs", tmp_path / "live"
    (src / "day=1" / "_temporary").mkdir(parents=True)
    (src / "day=2").mkdir()
    (src / "day=1" / "part-0.tsv").write_text(_criteo(1, 100))
    (src / "day=1" / "_temporary" / "part-1.tsv").write_text(_criteo(5, 100))  # hidden: a job's scratch
    (src / "day=1" / "_SUCCESS").write_text("")
    (src / "day=2" / "part-0.tsv").write_text(_criteo(2, 100))  # its job has not finished: no marker yet
    watch = FollowConfig(poll_seconds=0.05, settle_seconds=3600.0, stop_when_idle=0.3, require_success=True)
    manifest = follow(str(src), str(out), CRITEO, watch)  # a marked directory's files: at once, no settling
    assert manifest is not None and [f.name for f in manifest.files] == ["day=1/part-0.tsv"]
    (src / "day=2" / "_SUCCESS").write_text("")
    manifest = follow(str(src), str(out), CRITEO, watch)
    assert manifest is not None
    _check_whole(out, {"day=1/part-0.tsv": (1, 100), "day=2/part-0.tsv": (2, 100)})


def test_stop_when_idle_and_sigterm_end_the_command_cleanly(tmp_path: Path, procs: list[subprocess.Popen[str]]) -> None:
    src, out = tmp_path / "logs", tmp_path / "live"
    src.mkdir()
    idle = subprocess.run(_cli(src, out, "--stop-when-idle", "0.2"), capture_output=True, text=True, timeout=WAIT)
    assert idle.returncode == 0 and "no file prepared yet" in idle.stdout, idle.stderr
    proc = subprocess.Popen(
        _cli(src, out, "--settle-seconds", "0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    procs.append(proc)
    printed: list[str] = []

    def pump() -> None:  # the progress lines as they come (a line is printed just after its manifest is written)
        assert proc.stdout is not None
        for line in proc.stdout:
            printed.append(line)

    threading.Thread(target=pump, name="follow-stdout", daemon=True).start()
    _land(src / "day_0.tsv", _criteo(0, 100))
    _wait(lambda: any("day_0.tsv: landed" in line for line in printed), "the first file's progress line")
    assert "80 train samples in 2 shards" in printed[0] and _taken(out) == ["day_0.tsv"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    assert proc.returncode == 130, stderr
    assert "stopped; the manifest lists every file prepared whole" in stderr
    _check_whole(out, {"day_0.tsv": (0, 100)})
    helped = subprocess.run(
        [sys.executable, "-m", "worker.data.prepare", "--help"], capture_output=True, text=True, timeout=WAIT
    )
    for flag in (
        "--follow",
        "--poll-seconds",
        "--settle-seconds",
        "--stop-when-idle",
        "--require-success",
        "--pattern",
    ):
        assert flag in helped.stdout


def test_a_source_followed_over_http(tmp_path: Path) -> None:
    src, out = tmp_path / "logs", tmp_path / "live"
    (src / "2024-01-01").mkdir(parents=True)
    _land(src / "2024-01-01" / "day_0.tsv", _criteo(0, 150))
    _land(src / "day_1.tsv.gz", _criteo(1, 120))
    (src / "notes.txt").write_text("not a log\n")
    with FileServer(src) as server:
        watch = FollowConfig(poll_seconds=0.05, settle_seconds=0.0, stop_when_idle=0.3, pattern="day_*")
        first = follow(server.url, str(out), CRITEO, watch)
        assert first is not None and [f.name for f in first.files] == ["2024-01-01/day_0.tsv", "day_1.tsv.gz"]
        _land(src / "day_2.tsv", _criteo(2, 90))
        follow(server.url + "/", str(out), CRITEO, watch)  # a restart: only the new file
    _check_whole(out, {"2024-01-01/day_0.tsv": (0, 150), "day_1.tsv.gz": (1, 120), "day_2.tsv": (2, 90)})
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["source"] == server.url and not doc.get("rejected")


def test_what_a_follow_refuses_to_start(tmp_path: Path) -> None:
    src = tmp_path / "logs"
    src.mkdir()
    with pytest.raises(ValueError, match="prepares click logs"):
        follow(str(src), str(tmp_path / "out"), PrepareConfig(progress=False), FAST)
    with pytest.raises(ValueError, match="lies under the followed"):
        follow(str(src), str(src / "out"), CRITEO, FAST)
    _land(src / "day_0.tsv", _criteo(0, 50))
    follow(str(src), str(tmp_path / "out"), CRITEO, FAST)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="is the dataset of"):
        follow(str(other), str(tmp_path / "out"), CRITEO, FAST)


def test_storage_that_fails_is_tried_again_and_no_file_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, blocked = tmp_path / "logs", tmp_path / "blocked"
    src.mkdir()
    blocked.write_text("a file where the dataset's directory should be")  # every read and write of it fails
    out = blocked / "live"
    _land(src / "day_0.tsv", _criteo(0, 100))
    caplog.set_level("WARNING", logger="worker.data.follow")
    following = _Following(str(src), out, CRITEO, FollowConfig(poll_seconds=0.05, settle_seconds=0.0))
    try:
        _wait(lambda: "trying again in" in caplog.text, "a failed try said")
        blocked.unlink()
        _wait(lambda: _taken(out) == ["day_0.tsv"], "the file taken once storage is back")
    finally:
        following.close()
    line = next(r.getMessage() for r in caplog.records if "trying again" in r.getMessage())
    assert "NotADirectoryError" in line and "(try 1)" in line and "\n" not in line
    _check_whole(out, {"day_0.tsv": (0, 100)})


def test_a_file_changed_after_it_was_taken_is_said_once_and_not_taken_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, out = tmp_path / "logs", tmp_path / "live"
    src.mkdir()
    _land(src / "day_0.tsv", _criteo(0, 100))
    first = follow(str(src), str(out), CRITEO, FAST)
    with open(src / "day_0.tsv", "a") as f:
        f.write(_criteo(9, 5))
    caplog.set_level("WARNING", logger="worker.data.follow")
    again = follow(str(src), str(out), CRITEO, FAST)
    assert first is not None and again is not None and again.files == first.files and again.splits == first.splits
    said = [r.getMessage() for r in caplog.records if "changed after it was prepared" in r.getMessage()]
    assert len(said) == 1 and "day_0.tsv" in said[0]
