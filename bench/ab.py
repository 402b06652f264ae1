"""A/B: the same exchanges timed on two source trees of paramserver, interleaved in one run.

    python bench/ab.py --before /tmp/before                   # e.g. a `git worktree add /tmp/before <commit>`
    python bench/ab.py --before /tmp/before --rounds 5 --out bench/results/ab.json

For a refactor that must not slow anything down: each round runs, for each model (100 MB dense in 4 tensors,
and the digits MLP, 85 k parameters), one child process per tree (which of the two goes first alternates by
round), and each child times `push_pull` on 2 shard processes over every path: shared memory ("shm"), the data
socket over loopback ("socket") and the gRPC streams or inline Exchange ("grpc"). Only the public API that both
trees have is used (LocalCluster, ServerConfig, PSClient); the tree comes first on PYTHONPATH, so the shard
processes run its code too. Reported: per case, the median step time of each tree over all its rounds, and the
ratio after/before (above 1: slower after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PATHS = {
    "shm": {"shared_memory": True, "data_socket": True},
    "socket": {"shared_memory": False, "data_socket": True},
    "grpc": {"shared_memory": False, "data_socket": False},
}
MODELS = {"100MB": (25_000_000, 4, 3), "mlp": (0, 0, 200)}  # (elements, tensors, timed steps per path)
WARMUP = 2


def _child(model_name: str) -> dict[str, list[float]]:
    """Start 2 shard processes; time push_pull on every path; return seconds per step by path."""
    import torch

    from paramserver import LocalCluster, ServerConfig
    from worker import PSClient

    torch.set_num_threads(1)
    torch.manual_seed(0)
    numel, parts, steps = MODELS[model_name]
    if numel:
        size = numel // parts
        model = {f"layer{i}.weight": torch.randn(size) for i in range(parts)}
    else:
        from worker.models.builtin import build_model

        net = build_model("mlp", in_shape=(1, 8, 8), num_classes=10)
        model = {name: p.detach().clone() for name, p in net.named_parameters()}
    grads = {name: torch.full_like(t, 1e-3) for name, t in model.items()}
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.01)
    out: dict[str, list[float]] = {}
    with LocalCluster(config, shards=2, processes=True) as cluster:
        for path, flags in PATHS.items():
            with PSClient(cluster.address, timeout=600.0, **flags) as client:
                client.register(model)
                times = []
                for i in range(WARMUP + steps):
                    began = time.perf_counter()
                    client.push_pull(grads)
                    if i >= WARMUP:
                        times.append(time.perf_counter() - began)
                out[path] = times
    return out


def _run_child(tree: Path, model: str) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    here = Path(__file__).resolve()
    proc = subprocess.run(
        [sys.executable, str(here), "--child", model],
        env=env,
        cwd=str(tree),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child for {tree} {model} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, list[float]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="source tree of the baseline (a git worktree)")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent, help="(default: this)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child)))
        return 0
    if args.before is None:
        parser.error("--before is required")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    samples: dict[tuple[str, str, str], list[float]] = {}
    for r in range(args.rounds):
        for model in MODELS:
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for side in order:
                for path, times in _run_child(trees[side], model).items():
                    samples.setdefault((model, path, side), []).extend(times)
                print(f"round {r + 1}/{args.rounds}: {model} {side} done", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    print("| model | path | before (ms/step) | after (ms/step) | after/before |")
    print("| --- | --- | --- | --- | --- |")
    for model in MODELS:
        for path in PATHS:
            before = statistics.median(samples[(model, path, "before")]) * 1e3
            after = statistics.median(samples[(model, path, "after")]) * 1e3
            rows.append({"model": model, "path": path, "before_ms": before, "after_ms": after, "ratio": after / before})
            print(f"| {model} | {path} | {before:.2f} | {after:.2f} | {after / before:.2f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
