"""Online: continuous training of click logs that keep landing (issue 39), as a user runs it: a log writer drops
Criteo-layout files of the planted click world, `ps-prepare --follow`, `ps-server` (2 shards, async), two
`ps-worker --model dlrm --follow` and a `ps-serve` copy (worker.demos.online_job).

- lag: per file, from landing (its rename into the followed directory) to every serving copy holding the versions
  its last shard was trained at; against the time to prepare and train that file alone (what ps-prepare --follow
  spent on it, from the manifest, plus what its worker spent training its shard, from the worker's metrics). Files
  land further apart than a file takes, so none waits for another.
- a simulated day: 24 files, the IDs drifting (each file's users mostly new: the Zipf tail), rows evicted once
  untouched for --evict-after-versions (about three files' versions). The shards' resident memory when each file
  shows in serving; flat means within 10 % of the median after the first few files.
- AUC: at several files k, the AUC on file k+1 of the continuously trained model (read from the serving copy before
  file k+1 lands) against a model trained from scratch, one pass, on files 1..k (the same flags, a job of its own).
- faults: SIGKILL of ps-prepare --follow and of a worker, each in the middle of a file, several times; then, from
  the servers' claims record, the samples trained per file: files skipped, files trained twice (only the shard a
  killed worker held may be), and the manifest's files each listed once.
"""

from __future__ import annotations

import contextlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Figure, Processes, log
from bench.plan import Plan
from worker.demos.online_job import (
    Job,
    Timeline,
    day_of_logs,
    drop,
    prepare_alone,
    served_auc,
    start_job,
)

SECTION = "online"
BATCH = 2048


def _sizes(plan: Plan) -> dict[str, Any]:
    if plan.quick:
        return {"files": 2, "lines": 4000, "interval": 3.0, "points": (1,), "kills": 1, "fault_lines": 3000}
    return {
        "files": 24,
        "lines": 100_000,
        "interval": 12.0,
        "points": (3, 6, 12, 23),
        "kills": 5,
        "fault_lines": 20_000,
    }


def _evict(lines: int) -> int:
    """--evict-after-versions for about three files: each push of either worker is a version of each shard."""
    return max(20, 3 * int(0.9 * lines) // BATCH)


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """Lag, a drifting day's memory and AUC against training from scratch, and the fault counts."""
    sizes = _sizes(plan)
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="ps-bench-online-") as tmp:
        root = Path(tmp)
        log(f"online: {sizes['files']} files of {sizes['lines']:,} planted impressions")
        day = day_of_logs(sizes["files"], sizes["lines"])
        alone = {k: prepare_alone(root / "alone", f"part-{k:05d}.tsv", day[k]) for k in _next_files(sizes)}
        continuous, day_figures = _day(root / "day", day, alone, sizes)
        figures += day_figures
        figures += _scratch(root / "scratch", day, alone, continuous, sizes)
        figures += _faults(root / "faults", sizes)
    return figures


def _next_files(sizes: dict[str, Any]) -> list[int]:
    return [k for k in sizes["points"] if k < sizes["files"]]


def _worker_args(lines: int) -> list[str]:
    args = ["--batch-size", str(BATCH), "--follow-poll-seconds", "0.25", "--evict-after-versions", str(_evict(lines))]
    return [*args, "--log-level", "INFO"]  # the log names each worker's id (Job.holder)


def _day(
    root: Path, day: list[Any], alone: dict[int, tuple[str, float]], sizes: dict[str, Any]
) -> tuple[dict[int, float], list[Figure]]:
    """The continuous job over the day; return its AUC on file k+1 at each point k, and the figures."""
    from worker.models.clicks import TableOptions

    job = start_job(root, _worker_args(sizes["lines"]))
    tables = TableOptions(evict_after_versions=_evict(sizes["lines"]))
    rss: list[float] = []
    aucs: dict[int, float] = {}
    try:
        job.wait_workers_waiting()
        timeline = Timeline(job)
        for k in range(sizes["files"]):
            name, at = drop(job.logs, k, day[k])
            timeline.landed(name, at)
            while not timeline.files[name].visible:
                if time.time() - at > 300:
                    raise RuntimeError(f"online: {name} did not show in serving within 300 s (see {root})")
                timeline.poll()
                time.sleep(0.05)
            rss.append(_rss(job))
            if k + 1 in alone:  # read before file k+1 lands: the writer waits for it
                aucs[k + 1] = served_auc(timeline.serving(), alone[k + 1][0], tables, 0)
                log(f"online: files 1..{k + 1} trained: AUC on file {k + 2} {aucs[k + 1]:.4f}")
            time.sleep(max(0.0, at + sizes["interval"] - time.time()))
        timeline.close()
    finally:
        job.stop()
    files = sorted(timeline.files.values(), key=lambda t: t.name)
    train_s = _train_seconds(root)
    lags = [t.visible - t.landed for t in files]
    alone_s = [t.prepare_seconds + sum(train_s.get(s, 0.0) for s in t.shards) for t in files]
    params = {"files": sizes["files"], "lines": sizes["lines"], "batch": BATCH, "workers": 2, "shards": 2}
    log(f"online: lag median {statistics.median(lags):.1f} s, alone {statistics.median(alone_s):.1f} s")
    settled = rss[min(3, len(rss) - 1) :]
    middle = statistics.median(settled)
    figures = [
        Figure(f"{SECTION}.lag", SECTION, "a file landed -> its rows in serving", "s", lags, params),
        Figure(f"{SECTION}.alone", SECTION, "preparing and training that file alone", "s", alone_s, params),
        Figure(
            f"{SECTION}.lag_ratio", SECTION, "lag / alone, per file", "x",
            [lag / max(a, 1e-9) for lag, a in zip(lags, alone_s, strict=True)], params,
        ),
        Figure(
            f"{SECTION}.shard_rss", SECTION, "shards' resident memory as each file shows in serving", "MB",
            [r / 1e6 for r in rss], params,
            extra={"settled_spread": [min(settled) / middle - 1, max(settled) / middle - 1], "after_files": 3},
        ),
    ]  # fmt: skip
    return aucs, figures


def _rss(job: Job) -> float:
    """The shard processes' resident memory, in bytes."""
    total = 0.0
    for pid in job.shard_pids():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += float(line.split()[1]) * 1024
    return total


def _train_seconds(root: Path) -> dict[int, float]:
    """Each dataset shard's training seconds, from the workers' metrics (dataset_shards)."""
    import json

    found: dict[int, float] = {}
    for path in root.glob("worker*-*.json"):
        for entry in json.loads(path.read_text()).get("dataset_shards", []):
            found[int(entry["shard"])] = float(entry["seconds"])
    return found


def _scratch(
    root: Path, day: list[Any], alone: dict[int, tuple[str, float]], continuous: dict[int, float], sizes: dict[str, Any]
) -> list[Figure]:
    """At each point k, a job trained from scratch on files 1..k (one pass), its AUC on file k+1."""
    figures = []
    for k in sorted(continuous):
        scratch = _train_from_scratch(root / f"k{k}", day[:k], sizes)
        from_scratch = _saved_auc(scratch, alone[k][0], sizes)
        gap = continuous[k] - from_scratch
        log(f"online: AUC on file {k + 1}: continuous {continuous[k]:.4f}, from scratch on 1..{k} {from_scratch:.4f}")
        figures.append(
            Figure(
                f"{SECTION}.auc_gap.k{k}", SECTION, f"AUC on file {k + 1}: continuous - from scratch on files 1..{k}",
                "AUC", [gap], {"k": k, "lines": sizes["lines"]},
                extra={"continuous": continuous[k], "from_scratch": from_scratch},
            )
        )  # fmt: skip
    return figures


def _train_from_scratch(root: Path, files: list[Any], sizes: dict[str, Any]) -> str:
    """ps-prepare the files as one dataset, ps-server and two ps-worker (one epoch, async); the saved model."""
    from worker.demos.common import address_of, start_server, stop
    from worker.demos.online_job import PREPARE
    from worker.demos.planted import criteo_lines

    logs = root / "logs"
    logs.mkdir(parents=True)
    for k, clicks in enumerate(files):
        (logs / f"part-{k:05d}.tsv").write_text("\n".join(criteo_lines(clicks)) + "\n")
    dataset, saved = str(root / "ds"), str(root / "dlrm.safetensors")
    prepare = [*map(str, sorted(logs.iterdir())), "--out", dataset, *PREPARE, "--shards", "2"]
    subprocess.run([sys.executable, "-m", "worker.data.prepare", *prepare], check=True, stdout=subprocess.DEVNULL)
    server = start_server(["--shards", "2", "--workers", "2", "--mode", "async", "--port", "0"])
    workers: list[subprocess.Popen[bytes]] = []
    try:
        address = address_of(server)
        args = ["--server", address, "--model", "dlrm", "--dataset", dataset, "--epochs", "1", "--no-progress"]
        args += ["--batch-size", str(BATCH), "--evict-after-versions", str(_evict(sizes["lines"]))]
        workers = [
            subprocess.Popen([sys.executable, "-m", "worker.cli", *args, *(["--save-model", saved] if r == 0 else [])])
            for r in (0, 1)
        ]
        if any(w.wait() != 0 for w in workers):
            raise RuntimeError("online: a from-scratch worker failed")
    finally:
        for w in workers:
            stop(w)
        stop(server)
    return saved


def _saved_auc(saved: str, dataset: str, sizes: dict[str, Any]) -> float:
    """The AUC of a saved DLRM on every sample of a prepared dataset."""
    import torch

    from worker.client.model_file import load
    from worker.data.manifest import load_manifest
    from worker.demos.online_job import model_auc
    from worker.models.clicks import TableOptions, build_click_model

    schema = load_manifest(dataset).schema
    assert schema is not None
    torch.manual_seed(0)
    tables = TableOptions(evict_after_versions=_evict(sizes["lines"]))
    return model_auc(load(build_click_model("dlrm", schema, tables), saved), dataset)


def _faults(root: Path, sizes: dict[str, Any]) -> list[Figure]:
    """SIGKILL ps-prepare --follow and a worker in the middle of files; count each file's samples from the claims."""
    kills = sizes["kills"]
    files = 2 * kills + 1
    day = day_of_logs(files, sizes["fault_lines"], seed=1)
    rng = random.Random(0)
    job = start_job(root, _worker_args(sizes["fault_lines"]), ["--lease-timeout", "3"])
    try:
        job.wait_workers_waiting()
        for k in range(files):
            name, _ = drop(job.logs, k, day[k])
            if k % 2 == 0 and k // 2 < kills:  # ps-prepare in the middle of this file
                time.sleep(rng.uniform(0.05, 0.4))
                job.prepare.send_signal(signal.SIGKILL)
                job.prepare.wait()
                job.restart_prepare()
            elif k % 2 == 1:  # the worker that holds this file's shard, once it trains it
                _kill_a_holder(job, name)
        record = _all_done(job, files)
    finally:
        job.stop()
    return _fault_figures(job, record, files, kills, sizes)


def _kill_a_holder(job: Job, name: str) -> None:
    """SIGKILL the worker that trains file `name`'s shard, a few steps into it, and start another in its place."""
    from worker.data.manifest import load_manifest

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            manifest = load_manifest(str(job.dataset))
            index = {s.path: i for i, s in enumerate(manifest.splits["train"].shards)}
            shards = {index[p] for f in manifest.files if f.name == name for p in f.train}
            for claim in job.claims():
                proc = job.holder(claim.worker_id) if claim.state == "held" and claim.shard in shards else None
                if proc is not None:
                    time.sleep(0.15)  # a few steps into it
                    log(f"online: SIGKILL the worker training {name} (dataset shard {claim.shard})")
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    job.add_worker()
                    return
        time.sleep(0.02)
    raise RuntimeError(f"online: no worker took {name}'s shard within 120 s")


def _all_done(job: Job, files: int) -> list[Any]:
    from worker.data.manifest import load_manifest

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            manifest = load_manifest(str(job.dataset))
        except (FileNotFoundError, ValueError):
            manifest = None
        if manifest is not None and len(manifest.files) == files:
            record = job.claims()
            if len(record) == len(manifest.splits["train"].shards) and all(c.state == "done" for c in record):
                return record
        time.sleep(0.2)
    raise RuntimeError(f"online: the fault run's files were not all trained within 300 s (see {job.root})")


def _fault_figures(job: Job, record: list[Any], files: int, kills: int, sizes: dict[str, Any]) -> list[Figure]:
    from worker.data.manifest import load_manifest

    manifest = load_manifest(str(job.dataset))
    index = {s.path: i for i, s in enumerate(manifest.splits["train"].shards)}
    per_file = []
    for source in manifest.files:
        shards = [record[index[p]] for p in source.train]
        per_file.append(
            (source.name, sum(c.samples for c in shards), source.train_samples, max(c.tries for c in shards))
        )
    skipped = sum(1 for _, got, want, _ in per_file if got != want)
    twice = sum(1 for *_, tries in per_file if tries > 1)
    retrained = sum(tries - 1 for *_, tries in per_file)  # one per worker killed in a shard, if each was
    names = [s.name for s in manifest.files]
    log(
        f"online: faults: {files} files, {skipped} skipped, {twice} trained again, {retrained} retrainings "
        f"({kills} worker kills)"
    )
    params = {"files": files, "lines": sizes["fault_lines"], "prepare_kills": kills, "worker_kills": kills}
    extra = {"per_file": per_file, "listed_once": len(names) == len(set(names)) == files, "retrained": retrained}
    return [
        Figure(
            f"{SECTION}.faults.skipped",
            SECTION,
            "files skipped after the kills",
            "files",
            [skipped],
            params,
            extra=extra,
        ),
        Figure(
            f"{SECTION}.faults.twice",
            SECTION,
            "files trained again (a killed worker's shard)",
            "files",
            [twice],
            params,
        ),
    ]
