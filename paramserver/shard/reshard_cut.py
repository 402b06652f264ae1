"""ps-reshard's arithmetic: how the source set's N parts combine, and each of the M new parts cut from them: the
dense tensors piece by piece, the optimizer's elementwise state like the parameters (its other entries copied
once), each table's rows to the shard their IDs now hash to, and the applied pushes of every part.

Apart from the command (paramserver.shard.reshard, which checks the set, stages the new one and renames it into
place) because this part only computes: its functions take the parts' snapshots and the two placements and return
tensors and arrays (and notes on what was not one consistent cut); they write no file and never look at a
directory, so what makes a cut right can be read, and tested, in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paramserver.placement import Placement
from paramserver.shard.durability.checkpoint import Snapshot
from paramserver.shard.membership import REMEMBERED_STEPS
from paramserver.shard.reshard_source import Part, ReshardError

# A table's per-row arrays (moved with their rows) and its admission counts (moved with their IDs).
_ROW_KEYS = ("ids", "values", "optimizer_state", "versions", "times")
_COUNT_KEYS = ("count_ids", "counts")


def regather(old: Placement, flats: Sequence[torch.Tensor], new: Placement, shard: int) -> torch.Tensor:
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
class OptimizerPlan:
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


def plan_optimizer(parts: Sequence[Part], allow_mixed: bool, notes: list[str]) -> OptimizerPlan:
    """How the parts' optimizer states combine; ReshardError where they differ, unless `allow_mixed` (then the
    largest is taken, and `notes` says so)."""
    states = [_param_state(p.snap) for p in parts]
    plan = OptimizerPlan(param_groups=[dict(g) for g in parts[0].snap.optimizer_state.get("param_groups", [])])
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


def tables_plan(parts: Sequence[Part], notes: list[str]) -> list[dict[str, np.ndarray]]:
    """Each table's rows and admission counts from every source shard, concatenated (re-partitioned per new
    shard by `table_part`)."""
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


def table_part(
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


def union_applied(parts: Sequence[Part]) -> dict[str, list[int]]:
    """Every source shard's applied pushes (in sync mode the same on each), in first-seen order per worker."""
    merged: dict[str, dict[int, None]] = {}
    for p in parts:
        for worker, steps in p.snap.applied.items():
            merged.setdefault(worker, {}).update(dict.fromkeys(steps))
    return {w: list(steps)[-REMEMBERED_STEPS:] for w, steps in merged.items()}
