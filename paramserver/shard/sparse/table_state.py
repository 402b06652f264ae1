"""A table's checkpointed state: the arrays RowGroup.state gives and RowGroup.from_states takes, and their checks."""

from __future__ import annotations

import time

import numpy as np

from paramserver.tables import TableSpec

STATE_KEYS = ("ids", "values", "optimizer_state", "versions", "times", "count_ids", "counts", "step")


def clock_shift() -> float:
    """time.time() - time.monotonic(), now: a row's last-update time is monotonic in a shard's memory (eviction by
    age compares it with now) and wall-clock seconds in what outlives the process (a checkpoint's "times", an
    Update's `wall` in the log); add this to go from the first to the second, subtract it to come back."""
    return time.time() - time.monotonic()


def checked_state(spec: TableSpec, state_cols: int, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A table's state arrays, checked against its spec; ValueError when they do not fit together."""
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"table {spec.name!r}: the state lacks {', '.join(missing)}")
    a = {k: np.asarray(state[k]) for k in STATE_KEYS}
    n = len(a["ids"]) if a["ids"].ndim == 1 else -1
    shapes = {
        "ids": ((n,), np.int64),
        "values": ((n, spec.dim), np.float32),
        "optimizer_state": ((n, state_cols), np.float32),
        "versions": ((n,), np.int64),
        "times": ((n,), np.float64),
        "count_ids": ((len(a["count_ids"]),), np.int64),
        "counts": ((len(a["count_ids"]),), np.int64),
        "step": ((1,), np.int64),
    }
    for key, (shape, dtype) in shapes.items():
        if a[key].shape != shape or a[key].dtype != dtype:
            raise ValueError(
                f"table {spec.name!r}: state {key!r} is {a[key].dtype}{list(a[key].shape)}, "
                f"expected {np.dtype(dtype)}{list(shape)}"
            )
    ids, count_ids = a["ids"], a["count_ids"]
    if n > 1 and not (np.diff(ids) > 0).all():
        raise ValueError(f"table {spec.name!r}: state ids are not unique and ascending")
    if len(count_ids) > 1 and not (np.diff(count_ids) > 0).all():
        raise ValueError(f"table {spec.name!r}: state count_ids are not unique and ascending")
    if len(count_ids) and ((a["counts"] < 1).any() or np.isin(count_ids, ids).any()):
        raise ValueError(f"table {spec.name!r}: state counts must be >= 1 and only for IDs without a row")
    if a["step"][0] < 0:
        raise ValueError(f"table {spec.name!r}: state step is negative")
    return a


def state_bytes(state: dict[str, np.ndarray]) -> bytes:
    """A table's logical state (RowGroup.state()) as one deterministic byte string: equal exactly when the states
    are."""
    parts = []
    for key, arr in sorted(state.items()):
        arr = np.ascontiguousarray(arr)
        parts.append(f"{key}:{arr.dtype.str}:{arr.shape};".encode())
        parts.append(arr.tobytes())
    return b"".join(parts)
