"""ps-reshard: restore a checkpoint set written by N shards onto M shards, offline.

A shard's checkpoint holds its pieces of the dense tensors back to back (paramserver.placement), its optimizer's
elementwise state over those same elements, and the rows of the sparse tables whose IDs hash to it
(paramserver.tables.shard_of). With the placements of both shard counts known, a set of N checkpoints is cut
again into M: every dense tensor (and every elementwise optimizer state: Adam's moments, momentum, Adagrad's sums)
is copied piece by piece from the N old parts into the M new ones, and every table row, with its optimizer state,
last update and admission count, moves to the shard its ID now hashes to (that arithmetic is
paramserver.shard.reshard_cut's; reading the source set is paramserver.shard.reshard_source's).

The set must be one consistent cut of the model: each shard is first brought to its newest logged version by
replaying its write-ahead log over its newest checkpoint (as a restarted shard does), and then all of them must be
at the same version, as a sync job's shards are. Shards of an async job, or a set missing a log, are refused
unless `allow_mixed`, which combines them anyway and says which versions it combined.

The source directory is only read (its checkpoints and logs); the new set is written into a fresh directory next
to the target and renamed into place once complete, so the target never holds half a set.

    ps-reshard ckpt-2 ckpt-3 --shards 3
    ps-server --shards 3 --checkpoint-dir ckpt-3 ...
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver.config import ServerConfig
from paramserver.placement import Placement, place
from paramserver.shard import buffers as buffer_rules
from paramserver.shard.durability import checkpoint
from paramserver.shard.durability.checkpoint import Snapshot
from paramserver.shard.reshard_cut import (
    OptimizerPlan,
    plan_optimizer,
    regather,
    table_part,
    tables_plan,
    union_applied,
)
from paramserver.shard.reshard_source import Part, ReshardError, read_source, replay_config
from paramserver.tables import shard_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReshardReport:
    """What `reshard` did."""

    source: Path
    target: Path
    source_shards: int
    target_shards: int
    version: int  # the version the new set is at (with allow_mixed, the newest of the source versions)
    source_versions: tuple[int, ...]  # each source shard's version, after its log was replayed
    replayed: tuple[int, ...]  # how many logged versions each source shard replayed over its checkpoint
    bytes: int  # bytes of the checkpoint files written
    seconds: float
    paths: tuple[Path, ...]  # the new checkpoint files, shard 0 first
    notes: tuple[str, ...] = ()  # what was combined that was not one consistent cut (allow_mixed, tables' steps)

    def summary(self) -> str:
        """One line for the command line."""
        replayed = sum(self.replayed)
        return (
            f"resharded {self.source} ({self.source_shards} shards) into {self.target} ({self.target_shards} shards) "
            f"at version {self.version}"
            + (f", after replaying {replayed} logged versions" if replayed else "")
            + f": {self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s"
        )


# -- the whole --------------------------------------------------------------------------------------------------


def _check_target(target: Path) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ReshardError(f"{target} exists and is not an empty directory: the new set is never written over another")


def reshard(
    source: str | Path,
    target: str | Path,
    shards: int,
    config: ServerConfig | None = None,
    *,
    allow_mixed: bool = False,
) -> ReshardReport:
    """Restore the checkpoint set in `source` (written by N shards) onto `shards` shards, written into `target`
    (absent or empty). Each source shard's newest checkpoint is brought to its newest logged version by replaying
    its write-ahead log, under `config` (the job's flags, as a restarted shard would use them; None: the
    hyperparameters its checkpoint saved and the defaults for the rest: --buffers mean, the table limits).

    ReshardError (a ValueError) for a set that is not one consistent cut (shards at different versions, or with
    different optimizer steps) unless `allow_mixed`, and for anything else that makes the set unusable."""
    started = time.monotonic()
    source, target = Path(source), Path(target)
    if shards < 1:
        raise ReshardError(f"--shards must be at least 1, not {shards}")
    _check_target(target)
    parts = read_source(source, config)
    notes: list[str] = []
    versions = tuple(p.snap.version for p in parts)
    if len(set(versions)) > 1:
        shown = ", ".join(f"shard {k} at version {v}" for k, v in enumerate(versions))
        if not allow_mixed:
            raise ReshardError(
                f"the shards in {source} are not one consistent cut: {shown} (an async job's shards, or a shard "
                "whose write-ahead log is missing); --allow-mixed combines them anyway"
            )
        notes.append(f"combined different versions: {shown}; the new set is at version {max(versions)}")
    cut = _Cut.of(parts, shards, max(versions), allow_mixed, notes)
    written, total = _write_staged(target, cut)
    return ReshardReport(
        source=source,
        target=target,
        source_shards=len(parts),
        target_shards=shards,
        version=cut.version,
        source_versions=versions,
        replayed=tuple(p.replayed for p in parts),
        bytes=total,
        seconds=time.monotonic() - started,
        paths=tuple(target / name for name in written),
        notes=tuple(notes),
    )


@dataclass(frozen=True)
class _Cut:
    """What every new shard's checkpoint is cut from: the old and new placements and the source's state."""

    first: Snapshot
    shards: int
    version: int
    old: Placement
    new: Placement
    plan: OptimizerPlan
    tables: list[dict[str, np.ndarray]]
    owners: list[tuple[np.ndarray, np.ndarray]]
    applied: dict[str, list[int]]
    params: list[torch.Tensor]

    @classmethod
    def of(cls, parts: Sequence[Part], shards: int, version: int, allow_mixed: bool, notes: list[str]) -> _Cut:
        first = parts[0].snap
        tables = tables_plan(parts, notes)
        return cls(
            first=first,
            shards=shards,
            version=version,
            old=place(first.specs, len(parts), tables=first.table_specs),
            new=place(first.specs, shards, tables=first.table_specs),
            plan=plan_optimizer(parts, allow_mixed, notes),
            tables=tables,
            owners=[(shard_of(m["ids"], shards), shard_of(m["count_ids"], shards)) for m in tables],
            applied=union_applied(parts),
            params=[p.snap.params.detach().reshape(-1) for p in parts],
        )

    def snapshot(self, j: int) -> Snapshot:
        """New shard j's checkpoint."""
        state: dict[Any, Any] = {}
        if self.plan.present:
            entry: dict[str, Any] = {
                k: regather(self.old, flats, self.new, j) for k, flats in self.plan.elementwise.items()
            }
            entry.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.plan.scalars.items()})
            state = {0: entry}
        first = self.first
        return Snapshot(
            shard_index=j,
            num_shards=self.shards,
            specs=first.specs,
            digest=self.new.digest,
            version=self.version,
            optimizer=first.optimizer,
            params=regather(self.old, self.params, self.new, j),
            optimizer_state={"state": state, "param_groups": [dict(g) for g in self.plan.param_groups]},
            ever_full=first.ever_full,
            applied={w: list(s) for w, s in self.applied.items()},
            finished_workers=first.finished_workers,
            table_specs=first.table_specs,
            tables=[table_part(m, o, j) for m, o in zip(self.tables, self.owners, strict=True)],
            claims=first.claims if j == 0 else {},  # the dataset claims stay with shard 0 (ps-worker --follow)
        )


def _write_staged(target: Path, cut: _Cut) -> tuple[list[str], int]:
    """Write every new shard's checkpoint into a staging directory beside `target`, then rename it to `target`:
    the set is whole or absent. Return the files' names and their total size."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.reshard-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    written: list[str] = []
    total = 0
    try:
        for j in range(cut.shards):
            path = checkpoint.save(staging, cut.snapshot(j))  # one shard's tensors held at a time
            total += path.stat().st_size
            written.append(path.name)
        _check_target(target)
        if target.exists():
            target.rmdir()
        os.rename(staging, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written, total


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- ps-reshard -------------------------------------------------------------------------------------------------

_REPLAY_FLAGS = ("buffers", "buffer_momentum", "max_table_bytes", "table_overflow")

EPILOG = """\
examples:
  ps-reshard ckpt-2 ckpt-3 --shards 3       a 2-shard job's set, cut for 3 shards
  ps-server --shards 3 --checkpoint-dir ckpt-3 ...
                                            the 3-shard job resumes where the 2-shard one stopped

Run it on a stopped job (a SIGTERM writes each shard's final checkpoint). Each source shard's newest checkpoint
is brought to its newest logged version by replaying its write-ahead log, as a restarted shard does; the shards
must then all be at one version, as a sync job's are. The source directory is only read; the target must be
absent or empty, and receives the new set only once it is complete.
"""


def build_parser() -> argparse.ArgumentParser:
    """The ps-reshard argument parser."""
    parser = argparse.ArgumentParser(
        prog="ps-reshard",
        description="Restore a checkpoint set written by N shards onto M shards (offline).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="SOURCE_DIR", help="the --checkpoint-dir of the job that wrote the set")
    parser.add_argument("target", metavar="TARGET_DIR", help="where the new set goes (absent or empty)")
    parser.add_argument("--shards", type=int, required=True, metavar="M", help="the number of shards to cut it for")
    parser.add_argument(
        "--allow-mixed",
        action="store_true",
        help="combine shards at different versions (an async job's, or a set missing a log) instead of refusing: "
        "the new set is at the newest of them, and the summary says which versions were combined",
    )
    replay = parser.add_argument_group(
        "replaying the logs",
        "The job's flags that shape an update and that a checkpoint does not record (its optimizer, learning rate,\n"
        "weight decay, --no-weight-decay patterns and momentum are read from the checkpoints). Only a log replayed\n"
        "over a checkpoint uses them.",
    )
    replay.add_argument("--buffers", choices=buffer_rules.NAMES, help="the job's --buffers (default: mean)")
    replay.add_argument("--buffer-momentum", type=float, help="the job's --buffer-momentum (default: 0.5)")
    replay.add_argument("--max-table-bytes", type=int, help="the job's --max-table-bytes (default: 4 GiB)")
    replay.add_argument(
        "--table-overflow", choices=("evict", "refuse"), help="the job's --table-overflow (default: evict)"
    )
    parser.add_argument(
        "--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="(default: WARNING)"
    )
    return parser


def _cli_config(args: argparse.Namespace, source: Path) -> ServerConfig | None:
    """The replay config: the checkpoint's hyperparameters, with the flags given that a checkpoint does not record
    (None without any: reshard reads them all from the checkpoints)."""
    given = {k: getattr(args, k) for k in _REPLAY_FLAGS if getattr(args, k) is not None}
    if not given:
        return None
    snap = checkpoint.load_latest(source, 0)
    if snap is None:
        return None  # reshard says what is wrong
    return replay_config(snap, source, None).replace(**given)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ps-reshard: 0 on success (a summary line), 2 with a one-line error."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        config = _cli_config(args, Path(args.source))
        report = reshard(args.source, args.target, args.shards, config, allow_mixed=args.allow_mixed)
    except (ValueError, OSError, checkpoint.CorruptCheckpoint) as exc:
        print(f"ps-reshard: error: {exc}", file=sys.stderr)
        return 2
    for note in report.notes:
        print(f"ps-reshard: note: {note}", file=sys.stderr)
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
