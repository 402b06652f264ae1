"""The demo behind `make demo`: ps-server with 2 shards, two ps-workers on the digits, accuracy, clean shutdown.

It runs the real commands as subprocesses, exactly as a user would in three terminals, and stops every one of
them on the way out (also on Ctrl-C or a failure).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paramserver import modes
from worker.demos.common import address_of, start_server, start_workers, stop, worker_metrics
from worker.train.config import DENSE_BATCH

TARGET_ACCURACY = 0.95


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return 0 when every worker reached the target accuracy."""
    parser = argparse.ArgumentParser(prog="python -m worker.demos.demo", description=__doc__)
    parser.add_argument("--mode", default="sync", choices=modes.NAMES, help=f"consistency mode: {modes.describe()}")
    parser.add_argument("--shards", type=int, default=2, help="shard processes")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument(
        "--port", type=int, default=0, help="port of shard 0, the others follow (default: 0, free ports the OS picks)"
    )
    parser.add_argument(
        "--model",
        default="cnn",
        help="model for ps-worker --model; 'recsys': the recommendation job instead (python -m worker.demos.recsys: "
        "planted click logs as Criteo files, ps-prepare --format criteo, 2 shards and 2 ps-worker --model dlrm in sync "
        "mode, against the same model trained locally); 'online': continuous training instead (python -m "
        "worker.demos.online: click log files landing every few seconds, ps-prepare --follow, 2 ps-worker --follow, "
        "ps-serve; per file landed -> prepared -> trained -> visible in serving)",
    )
    parser.add_argument(
        "--data",
        default="memory",
        choices=("memory", "sharded"),
        help="memory: each worker loads the digits itself; sharded: ps-prepare writes the digits as shards, an HTTP "
        "server serves them, the workers stream them from its URL, and the servers run a warmup-cosine schedule",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args, extra = parser.parse_known_args(argv)
    if args.model == "online":
        from worker.demos import online

        return online.main(["--no-progress"] if args.no_progress else [])
    if args.model == "recsys":
        from worker.demos import recsys

        return recsys.main(["--port", str(args.port), *(["--no-progress"] if args.no_progress else []), *extra])

    server_args = ["--shards", str(args.shards), "--mode", args.mode, "--workers", str(args.workers)]
    server_args += ["--port", str(args.port)]
    with contextlib.ExitStack() as stack:
        dataset: list[str] = []
        if args.data == "sharded":
            files = stack.enter_context(tempfile.TemporaryDirectory(prefix="ps-demo-data-"))
            url, schedule = _sharded_digits(files, stack, args.workers, args.no_progress, extra)
            server_args += schedule
            dataset = ["--dataset", url]
        return _run(args, server_args, dataset + extra)


def _sharded_digits(
    directory: str, stack: contextlib.ExitStack, workers: int, quiet: bool, worker_args: list[str]
) -> tuple[str, list[str]]:
    """Prepare the digits into shards under `directory`, serve them over HTTP until `stack` closes; return the
    manifest's URL and the servers' warmup-cosine schedule flags, sized to the versions the workers will make
    (with their --epochs and --batch-size among `worker_args`)."""
    from worker.cli import build_parser
    from worker.data.fileserver import FileServer
    from worker.data.prepare import PrepareConfig, prepare
    from worker.data.stream import StreamedDataset

    shards = 4 * workers
    print(f"$ ps-prepare digits --out {directory} --shards {shards}", flush=True)
    prepare("digits", PrepareConfig(out=directory, shards=shards, progress=not quiet))
    server = stack.enter_context(FileServer(directory))
    url = f"{server.url}/manifest.json"
    print(f"$ python -m http.server --directory {directory}   (serving {url})", flush=True)
    run, _ = build_parser().parse_known_args(worker_args)
    per_epoch = -(-StreamedDataset(url).samples_per_epoch(workers) // (run.batch_size or DENSE_BATCH))
    versions = run.steps or per_epoch * run.epochs  # a sync round makes one version
    warmup = max(1, versions // 20)
    schedule = [
        "--lr",
        "2e-3",
        "--lr-schedule",
        "cosine",
        "--warmup-versions",
        str(warmup),
        "--decay-versions",
        str(versions - warmup),
        "--min-lr",
        "1e-4",
    ]
    return url, schedule


def _run(args: argparse.Namespace, server_args: list[str], extra: list[str]) -> int:
    server = start_server(server_args)
    workers: list[subprocess.Popen[Any]] = []
    results: list[dict[str, Any]] = []
    try:
        try:
            address = address_of(server)
        except (RuntimeError, TimeoutError) as exc:
            hint = " (--port 0, make demo's default, takes free ports)" if args.port else ""
            print(f"demo: {exc}{hint}", file=sys.stderr)
            return 1
        with tempfile.TemporaryDirectory(prefix="ps-demo-") as tmp:
            print(f"$ ps-worker --server {address} (x{args.workers})", flush=True)
            worker_args = ["--model", args.model, *extra, *(["--no-progress"] if args.no_progress else [])]
            workers = start_workers(address, worker_args, args.workers, Path(tmp), stdout=subprocess.DEVNULL)
            for i, code in enumerate([w.wait() for w in workers]):
                if code != 0:
                    print(f"worker {i} failed with exit status {code}", file=sys.stderr)
                    return 1
            results = worker_metrics(Path(tmp), args.workers)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping workers and servers", file=sys.stderr)
        return 130
    finally:
        for w in workers:
            stop(w, signal.SIGINT)
        server_status = stop(server, signal.SIGTERM)
    return _report(args.mode, results, server_status)


def _report(mode: str, results: list[dict[str, Any]], server_status: int) -> int:
    print()
    for r in sorted(results, key=lambda r: int(r["rank"])):
        print(
            f"worker {r['rank']}: {r['steps']} steps in {r['seconds']:.1f} s ({r['samples_per_second']:.0f} "
            f"samples/s), final loss {r['final_loss']:.4f}, test accuracy {r['test_accuracy']:.4f}"
        )
    accuracy = min(float(r["test_accuracy"]) for r in results)
    verdict = "reached" if accuracy >= TARGET_ACCURACY else "MISSED"
    print(
        f"{mode} mode: held-out test accuracy {accuracy:.4f} ({verdict} the {TARGET_ACCURACY} target); "
        f"servers stopped with status {server_status}"
    )
    return 0 if accuracy >= TARGET_ACCURACY and server_status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
