"""ps-reshard: restore a checkpoint set written by N shards onto M shards, offline.

A shard's checkpoint holds its pieces of the dense tensors back to back (paramserver.placement), its optimizer's
elementwise state over those same elements, and the rows of the sparse tables whose IDs hash to it
(paramserver.tables.shard_of). With the placements of both shard counts known, a set of N checkpoints is cut
again into M: every dense tensor (and every elementwise optimizer state: Adam's moments, momentum, Adagrad's sums)
is copied piece by piece from the N old parts into the M new ones, and every table row, with its optimizer state,
last update and admission count, moves to the shard its ID now hashes to.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from paramserver.config import ServerConfig
from paramserver.placement import Placement, place
from paramserver.shard import buffers as buffer_rules
from paramserver.shard import checkpoint
from paramserver.shard.checkpoint import Snapshot
from paramserver.shard.membership import REMEMBERED_STEPS
from paramserver.shard.reshard_source import Part, ReshardError, read_source, replay_config
from paramserver.tables import shard_of

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

# A table's per-row arrays (moved with their rows) and its admission counts (moved with their IDs).
_ROW_KEYS = ("ids", "values", "optimizer_state", "versions", "times")
_COUNT_KEYS = ("count_ids", "counts")


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


# -- cutting again ---------------------------------------------------------------------------------------------


def _regather(old: Placement, flats: Sequence[torch.Tensor], new: Placement, shard: int) -> torch.Tensor:
    """Shard `shard`'s flat part under `new`, copied piece by piece from the parts `flats` of `old`."""
    dtype = flats[0].dtype if flats else torch.float32
    by_name: dict[str, list[tuple[int, int, int, int]]] = {}  # name -> (start, stop, old shard, offset there)
    for k, pieces in enumerate(old.shards):
        at = 0
        for p in pieces:
            by_name.setdefault(p.name, []).append((p.start, p.start + p.length, k, at))
            at += p.length
    out = torch.empty(new.shard_elements(shard), dtype=dtype)
    at = 0
    for p in new.shards[shard]:
        lo, hi, copied = p.start, p.start + p.length, 0
        for start, stop, k, offset in by_name[p.name]:
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                out[at + a - lo : at + b - lo].copy_(flats[k][offset + a - start : offset + b - start])
                copied += b - a
        if copied != p.length:  # the pieces of a placement cover every element once
            raise ReshardError(f"tensor {p.name!r}: the source shards hold {copied} of elements {lo}..{hi}")
        at += p.length
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return bool(a == b)


@dataclass
class _OptimizerPlan:
    """How the source shards' optimizer states combine: the elementwise entries (cut like the parameters), and
    the others (one value, copied)."""

    elementwise: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # key -> each source shard's flat
    scalars: dict[str, Any] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    present: bool = False  # whether any source shard has state (none before the first update)


def _param_state(snap: Snapshot) -> dict[str, Any]:
    """The state of the shard's one flat parameter ({} before its first update)."""
    state = snap.optimizer_state.get("state", {})
    if len(state) > 1:
        raise ReshardError(f"shard {snap.shard_index}'s optimizer state has {len(state)} parameters, not one")
    return dict(next(iter(state.values()))) if state else {}


def _plan_optimizer(parts: Sequence[Part], allow_mixed: bool, notes: list[str]) -> _OptimizerPlan:
    states = [_param_state(p.snap) for p in parts]
    plan = _OptimizerPlan(param_groups=[dict(g) for g in parts[0].snap.optimizer_state.get("param_groups", [])])
    plan.present = any(states)
    keys = sorted({key for st in states for key in st}, key=str)
    for key in keys:
        held = [(k, st[key]) for k, st in enumerate(states) if key in st]
        elementwise = all(
            isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == parts[k].snap.params.numel() for k, v in held
        )
        if elementwise:
            flats = []
            for k, st in enumerate(states):
                if key in st:
                    flats.append(st[key].detach().reshape(-1))
                    continue
                if not allow_mixed and parts[k].snap.params.numel():
                    raise ReshardError(f"shard {k} holds no optimizer state {key!r}, and the other shards do")
                flats.append(torch.zeros(parts[k].snap.params.numel(), dtype=held[0][1].dtype))
            plan.elementwise[str(key)] = flats
            continue
        values = [v for _, v in held]
        if all(_same(values[0], v) for v in values[1:]) and len(held) == len(parts):
            plan.scalars[str(key)] = values[0]
            continue
        if not allow_mixed:
            shown = ", ".join(f"shard {k}: {_show(v)}" for k, v in held)
            raise ReshardError(
                f"the optimizer's {key!r} differs across the source shards ({shown}): not one consistent cut of a "
                "sync job; --allow-mixed takes the largest"
            )
        if not all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in values):
            raise ReshardError(f"the optimizer's {key!r} differs across the source shards and cannot be combined")
        largest = max(values, key=lambda v: float(v.item()))
        plan.scalars[str(key)] = largest
        notes.append(f"the optimizer's {key!r} differed across the source shards: took the largest, {_show(largest)}")
    return plan


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"{value.item():g}"
    return repr(value)


def _tables_plan(parts: Sequence[Part], notes: list[str]) -> list[dict[str, np.ndarray]]:
    """Each table's rows and admission counts from every source shard, concatenated (re-partitioned per new
    shard by `_table_part`)."""
    snap0 = parts[0].snap
    combined = []
    for t, spec in enumerate(snap0.table_specs):
        states = []
        for p in parts:
            if len(p.snap.tables) != len(snap0.table_specs):
                raise ReshardError(
                    f"shard {p.snap.shard_index}'s checkpoint holds {len(p.snap.tables)} tables, the model "
                    f"{len(snap0.table_specs)}"
                )
            states.append(p.snap.tables[t])
        missing = [k for k in (*_ROW_KEYS, *_COUNT_KEYS, "step") if any(k not in s for s in states)]
        if missing:
            raise ReshardError(f"table {spec.name!r}: a source shard's state lacks {', '.join(missing)}")
        merged = {k: np.concatenate([np.asarray(s[k]) for s in states]) for k in (*_ROW_KEYS, *_COUNT_KEYS)}
        for ids_key in ("ids", "count_ids"):
            ids = merged[ids_key]
            if len(np.unique(ids)) != len(ids):
                raise ReshardError(f"table {spec.name!r}: an ID is held by two source shards")
        steps = [int(np.asarray(s["step"]).reshape(-1)[0]) for s in states]
        if len(set(steps)) > 1:
            # A shard counts only the updates that brought it rows of the table, so a sync job's shards may differ.
            notes.append(
                f"table {spec.name!r}: the source shards counted {steps} updates (the step of a row optimizer's bias "
                f"correction): the new shards take the largest, {max(steps)}"
            )
        merged["step"] = np.array([max(steps)], dtype=np.int64)
        combined.append(merged)
    return combined


def _table_part(
    merged: dict[str, np.ndarray], owners: tuple[np.ndarray, np.ndarray], shard: int
) -> dict[str, np.ndarray]:
    """New shard `shard`'s rows and admission counts of one table, in ascending ID order (RowTable.state's)."""
    out: dict[str, np.ndarray] = {}
    for keys, ids_key, owner in ((_ROW_KEYS, "ids", owners[0]), (_COUNT_KEYS, "count_ids", owners[1])):
        where = np.flatnonzero(owner == shard)
        where = where[np.argsort(merged[ids_key][where], kind="stable")]
        for k in keys:
            out[k] = np.ascontiguousarray(merged[k][where])
    out["step"] = merged["step"].copy()
    return out


def _union_applied(parts: Sequence[Part]) -> dict[str, list[int]]:
    """Every source shard's applied pushes (in sync mode the same on each), in first-seen order per worker."""
    merged: dict[str, dict[int, None]] = {}
    for p in parts:
        for worker, steps in p.snap.applied.items():
            merged.setdefault(worker, {}).update(dict.fromkeys(steps))
    return {w: list(steps)[-REMEMBERED_STEPS:] for w, steps in merged.items()}


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
    n = len(parts)
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
    version = max(versions)
    snap0 = parts[0].snap
    old = place(snap0.specs, n, tables=snap0.table_specs)
    new = place(snap0.specs, shards, tables=snap0.table_specs)
    plan = _plan_optimizer(parts, allow_mixed, notes)
    tables = _tables_plan(parts, notes)
    owners = [(shard_of(m["ids"], shards), shard_of(m["count_ids"], shards)) for m in tables]
    applied = _union_applied(parts)
    params = [p.snap.params.detach().reshape(-1) for p in parts]

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.reshard-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    written: list[str] = []
    total = 0
    try:
        for j in range(shards):
            state: dict[Any, Any] = {}
            if plan.present:
                entry: dict[str, Any] = {k: _regather(old, flats, new, j) for k, flats in plan.elementwise.items()}
                entry.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in plan.scalars.items()})
                state = {0: entry}
            snap = Snapshot(
                shard_index=j,
                num_shards=shards,
                specs=snap0.specs,
                digest=new.digest,
                version=version,
                optimizer=snap0.optimizer,
                params=_regather(old, params, new, j),
                optimizer_state={"state": state, "param_groups": [dict(g) for g in plan.param_groups]},
                ever_full=snap0.ever_full,
                applied={w: list(s) for w, s in applied.items()},
                finished_workers=snap0.finished_workers,
                table_specs=snap0.table_specs,
                tables=[_table_part(m, o, j) for m, o in zip(tables, owners, strict=True)],
            )
            path = checkpoint.save(staging, snap)
            total += path.stat().st_size
            written.append(path.name)
            del snap, state
        _check_target(target)
        if target.exists():
            target.rmdir()
        os.rename(staging, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ReshardReport(
        source=source,
        target=target,
        source_shards=n,
        target_shards=shards,
        version=version,
        source_versions=versions,
        replayed=tuple(p.replayed for p in parts),
        bytes=total,
        seconds=time.monotonic() - started,
        paths=tuple(target / name for name in written),
        notes=tuple(notes),
    )


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
