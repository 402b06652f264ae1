"""ps-worker: train a model against a running parameter server."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from paramserver.config import add_arguments, from_arguments
from paramserver.errors import PSError
from paramserver.procs import child_env, follow_parent
from worker.client.host_group import ENV as GROUP_ENV
from worker.client.host_group import GroupBroken, GroupSpec
from worker.train.config import NUMBERED_ENV, numbered
from worker.train.trainer import TrainConfig, train

EPILOG = """\
examples:
  ps-worker --server 127.0.0.1:50051                          the built-in CNN on the digits dataset
  ps-worker --server ps-0.ps:50051 --model mlp --epochs 20 --metrics-out run.json
                                                              (in a job of several workers: run-RANK.json each)
  ps-worker --server HOST:PORT --model mypkg.models:make_net --dataset data.npz --save-model net.safetensors
  ps-worker --server HOST:PORT --model dlrm --dataset DS --follow
                                                              train DS's shards as ps-prepare --follow adds them
  ps-worker --server HOST:PORT --nproc 4                      one process per GPU of this host (else 4 on the CPU),
                                                              one member of the job: gradients reduced on the host

The servers decide the mode (sync/async), optimizer and learning rate; see ps-server --help.
"""


def build_parser() -> argparse.ArgumentParser:
    """Return the ps-worker argument parser, built from TrainConfig's fields."""
    parser = argparse.ArgumentParser(
        prog="ps-worker",
        description="Train a PyTorch model against a paramserver parameter server: pull "
        "weights, compute gradients on this worker's part of the data, push them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, TrainConfig)
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="start this many processes on this host, one per GPU (cuda:0, cuda:1, ...) where --device is auto "
        "and there are that many, else on --device; they share the host's part of the data and, with "
        "--host-reduce (the default), its one exchange a step; their --metrics-out and --plot files get -0, -1, "
        "... before the extension (--save-model too with --no-host-reduce); Ctrl-C stops them all "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--host-reduce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --nproc: the processes are one member of the job, their gradients averaged on this host "
        "(shared memory) and exchanged with the shards once, by the first of them (ps-server --workers counts "
        "hosts); --no-host-reduce: each process is a worker of the job of its own (--workers counts processes). "
        "A process of a group that dies stops the group (default: on)",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (default: %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ps-worker."""
    follow_parent()  # one of ps-worker --nproc N's workers stops with its launcher
    args = build_parser().parse_args(argv)
    if args.nproc != 1:
        return run_several(args, list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    signal.signal(signal.SIGTERM, _terminated)  # a pod's or a supervisor's stop: the same clean leave as Ctrl-C
    try:
        config = from_arguments(TrainConfig, args)
        stop = threading.Event()
        if config.follow:  # a follow loop's stop: at its next step (the dataset shard it holds is freed), summarised
            signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
        metrics = train(config, stop=stop)
    except KeyboardInterrupt:
        print(
            "ps-worker: interrupted; the servers keep the weights, and a new worker resumes from them",
            file=sys.stderr,
        )
        return 130
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        print(f"ps-worker: {exc}", file=sys.stderr)
        return 2
    except PSError as exc:
        print(f"ps-worker: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except GroupBroken as exc:
        print(f"ps-worker: {exc}", file=sys.stderr)
        return 1
    tested = metrics["test_accuracy"]  # None for a regression or a --train-step job: their test loss instead
    if "test_auc" in metrics:  # a click model
        result = f"test AUC {metrics['test_auc']:.4f}, test log loss {metrics['test_logloss']:.4f}"
    elif "test_loss" not in metrics:  # a dataset with no held-out split (one that grows may have none)
        result = "no held-out split to test on"
    else:
        result = f"test accuracy {tested:.4f}" if tested is not None else f"test loss {metrics['test_loss']:.4f}"
    if "dataset_shards" in metrics:
        shards = metrics["dataset_shards"]
        result += f", {len(shards)} dataset shards trained ({', '.join(str(s['shard']) for s in shards) or 'none'})"
    print(
        f"worker {metrics['rank']}: {metrics['steps']} steps, {metrics['samples_per_second']:.0f} samples/s, "
        f"final loss {metrics['final_loss']:.4f}, {result}",
        flush=True,
    )
    return 0


def run_several(args: argparse.Namespace, argv: list[str]) -> int:
    """Start --nproc workers (this command without --nproc, each on its device and with its own output files),
    wait for all of them, and stop them all on Ctrl-C or SIGTERM; the exit status is the first failure's, else 0."""
    if args.nproc < 1:
        print("ps-worker: --nproc must be at least 1", file=sys.stderr)
        return 2
    import torch

    gpus = torch.cuda.device_count() if args.device == "auto" else 0
    base = _without(_without(argv, "--nproc"), "--save-model")
    groups = GroupSpec.new(args.nproc) if args.host_reduce else []
    procs: list[subprocess.Popen[bytes]] = []
    for i in range(args.nproc):
        extra = ["--device", f"cuda:{i}"] if gpus >= args.nproc else []
        for flag, value in (("--metrics-out", args.metrics_out), ("--plot", args.plot)):
            if value:
                extra += [flag, numbered(value, i)]
        if args.save_model and (i == 0 or not groups):  # a group's model is its first process's
            extra += ["--save-model", numbered(args.save_model, i) if not groups else args.save_model]
        env = child_env()
        env[NUMBERED_ENV] = "1"  # each process's files are numbered here, by its place on the host
        if groups:
            env[GROUP_ENV] = groups[i].env()
        cmd = [sys.executable, "-m", "worker.cli", *base, *extra]
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_sigint_as_ctrl_c))

    def stop(signum: int, frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        codes = [proc.wait() for proc in procs]
    except KeyboardInterrupt:
        stop(signal.SIGINT, None)  # a terminal's Ctrl-C reached them too; a SIGINT sent to this process alone did not
        codes = [proc.wait() for proc in procs]
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return next((c for c in codes if c), 0)


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _sigint_as_ctrl_c() -> None:
    """In a worker child before exec: take SIGINT as Ctrl-C (a shell starts a background job with SIGINT ignored,
    which the child would inherit). (This launcher never uses gRPC, so code between fork and exec is safe here.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _without(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value (as --flag N or --flag=N)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
