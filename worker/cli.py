"""ps-worker: train a model against a running parameter server."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from paramserver.config import add_arguments, from_arguments
from paramserver.errors import PSError
from worker.trainer import TrainConfig, train

EPILOG = """\
examples:
  ps-worker --server 127.0.0.1:50051                          the built-in CNN on the digits dataset
  ps-worker --server ps-0.ps:50051 --model mlp --epochs 20 --metrics-out run.json
  ps-worker --server HOST:PORT --model mypkg.models:make_net --dataset data.npz --save-model net.pt

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
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (default: %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ps-worker."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        config = from_arguments(TrainConfig, args)
        metrics = train(config)
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
    print(
        f"worker {metrics['rank']}: {metrics['steps']} steps, {metrics['samples_per_second']:.0f} samples/s, "
        f"final loss {metrics['final_loss']:.4f}, test accuracy {metrics['test_accuracy']:.4f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
