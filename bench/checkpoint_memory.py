"""Peak memory and time of restoring a shard checkpoint: the first format (a JSON header, raw bytes, a sha256
trailer) against safetensors (paramserver.shard.durability.checkpoint now).

    git show <rev before safetensors>:paramserver/shard/durability/checkpoint.py > /tmp/ckpt_old/checkpoint_old.py
    .venv/bin/python bench/checkpoint_memory.py                      # 400 MB, 3 runs of each, interleaved
    .venv/bin/python bench/checkpoint_memory.py --size-mb 100 --runs 1 --old /tmp/ckpt_old/checkpoint_old.py

The parent writes one checkpoint of a single-shard model with Adam state, `--size-mb` in all (parameters,
exp_avg and exp_avg_sq: three float32 tensors of a third each), once with each module. Each measurement then runs
in a fresh child process, so that nothing of an earlier one (the allocator's free lists, the page tables) is
counted:
- load: the child allocates the model's parameters (zeros, resident), then `checkpoint.load(path)` and copies the
  parameters into that tensor (what a restore does with them; the optimizer keeps the state tensors it is given);
- restore: `paramserver.shard.durability.persistence.restored` as a restarted shard runs it (the newest file of a
  directory, the model built, its parameters copied, the optimizer's state loaded), with that module as `checkpoint`.
Peak: the kernel's high-water mark of the child's resident memory (VmHWM, reset through /proc/self/clear_refs
just before) less its resident memory then, divided by the checkpoint's size. The restore's model itself is the
checkpoint's size (1.0x): what it holds beyond that is the cost of reading. The page cache holds the file in
every case (it was just written); the figures are for a warm cache.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on sys.path, the repository root is not
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from paramserver.config import ServerConfig  # noqa: E402
from paramserver.placement import TensorSpec, place  # noqa: E402

MB = 1_000_000
DEFAULT_OLD = "/tmp/ckpt_old/checkpoint_old.py"
ADDRESSES = ["127.0.0.1:1"]


def status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert match, field
    return int(match.group(1)) * 1024


def module(which: str, old: str) -> ModuleType:
    """The checkpoint module of one format: "new" (this tree's) or "old" (the file `old`)."""
    if which == "new":
        return importlib.import_module("paramserver.shard.durability.checkpoint")
    path = Path(old)
    if not path.is_file():
        sys.exit(f"{path}: no copy of the first format's module; see this script's docstring for how to make one")
    sys.path.insert(0, str(path.parent))
    return importlib.import_module(path.stem)


def snapshot(ckpt: ModuleType, numel: int) -> Any:
    """A single-shard Adam snapshot of `numel` parameters (12 bytes each with the optimizer's state)."""
    gen = torch.Generator().manual_seed(0)
    specs = (TensorSpec("w", (numel,)),)
    params = torch.randn(numel, generator=gen)
    groups = torch.optim.Adam([torch.zeros(1)], lr=1e-3).state_dict()["param_groups"]
    state = {
        0: {
            "step": torch.tensor(7.0),
            "exp_avg": torch.randn(numel, generator=gen),
            "exp_avg_sq": torch.rand(numel, generator=gen),
        }
    }
    return ckpt.Snapshot(
        shard_index=0,
        num_shards=1,
        specs=specs,
        digest=place(specs, 1).digest,
        version=7,
        optimizer="adam",
        params=params,
        optimizer_state={"state": state, "param_groups": groups},
        ever_full=True,
        applied={"w": [5, 6, 7]},
    )


def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; print it as JSON."""
    ckpt = module(args.format, args.old)
    directory = Path(args.dir)
    if args.mode == "load":
        params = torch.zeros(args.numel)  # the model's parameters, resident before the load
        path = ckpt.list_checkpoints(directory, 0)[0]
    else:
        from paramserver.shard.durability import persistence
        from paramserver.shard.optimizers import warm_up_optimizer

        persistence.checkpoint = ckpt
        config = ServerConfig(optimizer="adam", lr=1e-3, checkpoint_dir=str(directory))
        warm_up_optimizer(config)  # as a shard does at its start: torch's first optimizer imports torch._dynamo
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    before = status("VmRSS")
    started = time.perf_counter()
    if args.mode == "load":
        snap = ckpt.load(path)
        params.copy_(snap.params)
        del snap
    else:
        found = persistence.restored(config, 0, ADDRESSES)
        assert found is not None
        model = found[0]
        assert model.params.numel() == args.numel
        del found  # and so the snapshot (Shard.restore holds it until it returns)
    seconds = time.perf_counter() - started
    gc.collect()
    print(json.dumps({"seconds": seconds, "peak": status("VmHWM") - before, "after": status("VmRSS") - before}))


def measure(fmt: str, mode: str, directory: Path, numel: int, old: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "child", fmt, mode, str(directory), str(numel), "--old", old]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("child", help="(internal) one measurement")
    one.add_argument("format", choices=["old", "new"])
    one.add_argument("mode", choices=["load", "restore"])
    one.add_argument("dir")
    one.add_argument("numel", type=int)
    one.add_argument("--old", default=DEFAULT_OLD)
    parser.add_argument("--size-mb", type=float, default=400.0, help="the checkpoint's size (default 400)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each measurement; medians are shown")
    parser.add_argument("--old", default=DEFAULT_OLD, help=f"the first format's module (default {DEFAULT_OLD})")
    parser.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")
    args = parser.parse_args()
    if args.command == "child":
        child(args)
        return

    numel = int(args.size_mb * MB) // 12
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        sizes, saves = {}, {}
        for fmt in ("old", "new"):
            ckpt = module(fmt, args.old)
            snap = snapshot(ckpt, numel)
            started = time.perf_counter()
            path = ckpt.save(Path(tmp) / fmt, snap)
            saves[fmt] = time.perf_counter() - started
            sizes[fmt] = path.stat().st_size
            del snap
            gc.collect()
        print(
            f"{numel:,} parameters with Adam state: old file {sizes['old'] / MB:.1f} MB, new {sizes['new'] / MB:.1f} MB"
        )
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(args.runs):  # interleaved, so that a slower moment of the machine hits both formats
            for mode in ("load", "restore"):
                for fmt in ("old", "new"):
                    runs.setdefault((mode, fmt), []).append(measure(fmt, mode, Path(tmp) / fmt, numel, args.old))
        print(f"save: old {saves['old']:.2f} s, new {saves['new']:.2f} s")
        print(f"medians of {args.runs} runs; peak and after: resident memory over that before, / the file's size")
        print(f"{'':31} {'peak':>7} {'after':>7} {'seconds':>8}")
        for (mode, fmt), results in runs.items():
            label = {"load": "load + copy the parameters", "restore": "persistence.restored"}[mode]
            peak = statistics.median(r["peak"] for r in results) / sizes[fmt]
            after = statistics.median(r["after"] for r in results) / sizes[fmt]
            seconds = statistics.median(r["seconds"] for r in results)
            print(f"{label:26} {fmt:>4}: {peak:6.2f}x {after:6.2f}x {seconds:8.3f}")


if __name__ == "__main__":
    main()
