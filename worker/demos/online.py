"""`make demo MODEL=online`: continuous training. A log writer drops a Criteo-layout file of planted click logs
every few seconds; `ps-prepare --follow` prepares each as it lands, `ps-server` and two `ps-worker --follow` train
each once, and a `ps-serve` copy follows. Per file it prints landed -> prepared -> trained -> visible in serving (in
seconds from its landing), and the AUC of the next file, read from the serving copy before any of that file is
trained on. It stops by itself after --files files (worker.demos.online_job has the machinery).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from worker.demos.online_job import FileTimes, Job, Timeline, day_of_logs, drop, prepare_alone, served_auc, start_job
from worker.models.clicks import TableOptions

TARGET_LAG_S = 30.0  # landed -> visible in serving


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.demos.online", description=__doc__)
    parser.add_argument("--files", type=int, default=6, help="files the writer drops, then the demo stops")
    parser.add_argument("--lines", type=int, default=20_000, help="impressions per file")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between two files landing")
    parser.add_argument("--batch-size", type=int, default=1024, help="ps-worker --batch-size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the planted world and of the model")
    parser.add_argument("--no-progress", action="store_true", help="(accepted for make demo; nothing to show)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when every file became visible in serving within TARGET_LAG_S of landing."""
    args = _parser().parse_args(argv)
    if args.files < 2 or args.lines < 100 or args.interval <= 0:
        print("online: --files 2 or more, --lines 100 or more, --interval above 0", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ps-online-") as tmp:
        root = Path(tmp)
        began = time.perf_counter()
        day = day_of_logs(args.files, args.lines, args.seed)
        # Each next file prepared alone beforehand: its AUC is read from the serving copy before it even lands.
        alone = [prepare_alone(root / "alone", f"part-{k:05d}.tsv", day[k])[0] for k in range(1, args.files)]
        print(
            f"{args.files} files of {args.lines:,} planted impressions (IDs drifting: most users new in each file), "
            f"in {time.perf_counter() - began:.1f} s; one lands every {args.interval:g} s",
            flush=True,
        )
        worker_args = ["--batch-size", str(args.batch_size), "--follow-poll-seconds", "0.25", "--seed", str(args.seed)]
        job = start_job(root, worker_args)
        try:
            rows = _run(job, args, day, alone)
        finally:
            job.stop()
    return _summary(rows, args.files)


def _run(job: Job, args: argparse.Namespace, day: list, alone: list[str]) -> list[FileTimes]:
    """Drop the files on schedule and report each as it shows in serving; return every file's times."""
    job.wait_workers_waiting()  # the first file's times are then the pipeline's, not the workers' start
    timeline = Timeline(job)
    tables = TableOptions()
    shown: list[FileTimes] = []
    try:
        for k in range(args.files):
            name, at = drop(job.logs, k, day[k])
            timeline.landed(name, at)
            deadline = at + (args.interval if k + 1 < args.files else 120.0)
            while time.time() < deadline and len(shown) <= k:
                for t in timeline.poll():
                    shown.append(t)
                    j = int(t.name[5:10])
                    next_auc = served_auc(timeline.serving(), alone[j], tables, args.seed) if j < len(alone) else None
                    _line(t, next_auc, landed_next=j + 1 <= k)
                time.sleep(0.1)
            time.sleep(max(0.0, deadline - time.time()) if k + 1 < args.files else 0.0)
    finally:
        timeline.close()
    return shown


def _line(t: FileTimes, next_auc: float | None, landed_next: bool) -> None:
    after = "" if next_auc is None else f"; next file's AUC before training on it {next_auc:.4f}"
    if next_auc is not None and landed_next:
        after += " (it had landed already: some of it may be trained)"
    print(
        f"{t.name}: landed -> prepared {t.prepared - t.landed:.1f} s -> trained {t.trained - t.landed:.1f} s -> "
        f"visible in serving {t.visible - t.landed:.1f} s{after}",
        flush=True,
    )


def _summary(rows: list[FileTimes], files: int) -> int:
    if len(rows) < files:
        print(f"online: {files - len(rows)} of {files} files never showed in serving", file=sys.stderr)
        return 1
    lags = [t.visible - t.landed for t in rows]
    print(
        f"{files} files: landed -> visible in serving median {statistics.median(lags):.1f} s, worst {max(lags):.1f} s "
        f"(target {TARGET_LAG_S:.0f} s)",
        flush=True,
    )
    return 0 if max(lags) <= TARGET_LAG_S else 1


if __name__ == "__main__":
    sys.exit(main())
