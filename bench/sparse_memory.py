"""Sparse tables' memory (part of the sparse section): a `RowTable` (paramserver.shard.sparse.row_store, Adagrad) filled
with a small and a large number of rows, in a process of its own: bytes it holds (`nbytes`: slabs, index, per-slot
arrays) and its anonymous RSS growth (after malloc_trim: glibc keeps the heap that freed temporaries held, a fixed
amount reused by later batches, not a cost per row; the untrimmed growth is in the figure's extra), over rows x
(value + optimizer state); and the time of one batch (lookup + apply of the unique IDs of 4,096 Zipf IDs, all of
them held rows) on the large table against the small one, in turn. Rows are filled 4,096 new IDs an apply (at most
what one training batch makes: the slabs grow as they would in training) in a random order, as IDs arrive in
training, so a popular ID's row is anywhere in the slab. Where the machine has under 3x the large table's bytes
available, dim 16 instead of 64.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from bench.common import Channel, Figure, Processes, log, median, ms
from bench.plan import Plan

SECTION = "sparse"
MODULE = "sparse_memory"
TIMEOUT = 600.0
BATCH = 4096  # IDs a training batch (the sparse section's step draws the same)
ZIPF_A = 1.1
LR = 0.01
MEMORY_DIM = 64
FILL_CHUNK = 4096  # new rows per apply while filling a RowTable: at most what one training batch makes
TARGET_BYTES = 1.3  # bytes held / (rows x (value + state))
TARGET_SCALE = 1.5  # time per batch, large table / small table


def zipf_ids(rng: Any, rows: int) -> Any:
    """One batch of BATCH Zipf(1.1) IDs mod `rows` (int64 numpy)."""
    return rng.zipf(ZIPF_A, BATCH) % rows


def _label(rows: int) -> str:
    return f"{rows // 1_000_000}M" if rows >= 1_000_000 else f"{rows // 1000}K"


# -- the memory process -----------------------------------------------------------------------------------------


def _anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _huge_bytes() -> int:
    """Anonymous memory of this process on transparent huge pages (a slab on 4 KiB pages misses the TLB far more)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _trim() -> None:
    """Hand the heap's free memory back to the kernel (glibc keeps what freed temporaries held, for reuse)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _memory(chan: Channel, params: dict[str, Any]) -> None:
    """Fill a small and a large RowTable, report their bytes, then time batches on each in turn."""
    import numpy as np
    import torch

    from paramserver.shard.sparse.row_store import RowTable
    from paramserver.tables import TableSpec

    torch.set_num_threads(1)
    dim, rounds, n = params["dim"], params["rounds"], params["steps"]
    rng = np.random.default_rng(params["seed"])
    tables: dict[int, Any] = {}
    facts: dict[int, dict[str, Any]] = {}
    version = 0
    zeros = np.zeros((FILL_CHUNK, dim), dtype=np.float32)
    for rows in params["rows"]:
        spec = TableSpec(name=f"t{rows}", dim=dim, num_embeddings=rows)
        _trim()
        before = _anon_bytes()
        table = RowTable(spec, "adagrad", LR)
        order = rng.permutation(rows).astype(np.int64)
        t0 = time.perf_counter()
        for begin in range(0, rows, FILL_CHUNK):
            ids = np.sort(order[begin : begin + FILL_CHUNK])
            version += 1
            table.apply(ids, zeros[: len(ids)], version, time.monotonic())
        fill_s = time.perf_counter() - t0
        del order, ids
        gc.collect()
        grown_untrimmed = _anon_bytes() - before
        _trim()
        grown = _anon_bytes() - before
        tables[rows] = table
        facts[rows] = {
            "rows": table.rows,
            "row_bytes": table.row_bytes,
            "nbytes": table.nbytes,
            "rss_growth": grown,
            "rss_growth_untrimmed": grown_untrimmed,
            "slots": int(table._capacity),  # noqa: SLF001 - the slab's rows, to explain the bytes held
            "fill_s": round(fill_s, 3),
            "huge_pages_bytes": _huge_bytes(),  # the process's, all tables so far
        }
    # Batches over each table's IDs: unique IDs of 4,096 Zipf IDs (every one a held row) and their gradients.
    work: dict[int, list[tuple[Any, Any]]] = {}
    for rows in params["rows"]:
        work[rows] = []
        for _ in range(params["batches"]):
            ids = np.unique(zipf_ids(rng, rows))
            work[rows].append((ids, (rng.standard_normal((len(ids), dim)) * 0.01).astype(np.float32)))
    times: dict[int, list[list[float]]] = {rows: [] for rows in params["rows"]}
    k = 0
    for r in range(rounds + 1):  # round 0 is a warm-up
        for rows in params["rows"]:
            table, batch = tables[rows], work[rows]
            got = []
            for j in range(n):
                ids, grads = batch[(k + j) % len(batch)]
                version += 1
                t0 = time.perf_counter()
                table.lookup(ids)
                table.apply(ids, grads, version, time.monotonic())
                got.append(time.perf_counter() - t0)
            if r:
                times[rows].append(got)
        k += n
    for rows in params["rows"]:
        facts[rows]["unique_ids"] = round(float(np.mean([len(b[0]) for b in work[rows]])), 1)
    chan.send("result", facts={str(k): v for k, v in facts.items()}, times={str(k): v for k, v in times.items()})


ROLES = {"memory": _memory}


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """The RowTable's memory and its time per batch against its size."""
    small, large = plan.sparse_rows
    dim, why = MEMORY_DIM, ""
    need = large * 8 * MEMORY_DIM * 1.3  # value + Adagrad state, and what holding them costs beyond
    available = _mem_available()
    if available and available < 3 * need:
        dim = 16
        why = f"dim 16, not {MEMORY_DIM}: {available / 1e9:.1f} GB available, under 3x the {need / 1e9:.1f} GB table"
        log(f"sparse memory: {why}")
    params = {"rows": [small, large], "dim": dim, "batches": plan.sparse_batches, "seed": 7}
    params |= {"rounds": plan.sparse_rounds, "steps": plan.sparse_steps}
    kid = procs.child(MODULE, "memory", params, name="sparse-memory")
    try:
        got = kid.expect("result", TIMEOUT)
    finally:
        procs.close_children([kid])
    figures = []
    for rows in (small, large):
        f = got["facts"][str(rows)]
        held = f["rows"] * f["row_bytes"]
        label = _label(rows)
        p = {"rows": rows, "dim": dim, "optimizer": "adagrad", "row_bytes": f["row_bytes"], "target": TARGET_BYTES}
        if why:
            p["dim_note"] = why
        extra = {
            "nbytes": f["nbytes"],
            "value_state_bytes": held,
            "rss_growth_bytes": f["rss_growth"],
            "rss_growth_untrimmed_bytes": f["rss_growth_untrimmed"],
            "rss_growth_untrimmed": round(f["rss_growth_untrimmed"] / held, 4),
            "slots": f["slots"],
            "fill_s": f["fill_s"],
            "huge_pages_bytes": f["huge_pages_bytes"],
        }
        figures += [
            Figure(
                id=f"{SECTION}.bytes.r{label}.d{dim}",
                section=SECTION,
                title=f"RowTable bytes held ÷ rows x (value + Adagrad state), {label} rows, dim {dim}",
                unit="x",
                repeats=[round(f["nbytes"] / held, 4)],
                params=p,
                extra=extra,
            ),
            Figure(
                id=f"{SECTION}.rss.r{label}.d{dim}",
                section=SECTION,
                title=f"anonymous RSS growth of the filled table (after malloc_trim) ÷ rows x (value + Adagrad "
                f"state), {label} rows, dim {dim}",
                unit="x",
                repeats=[round(f["rss_growth"] / held, 4)],
                params=p,
                extra=extra,
            ),
        ]
    per_round = {rows: got["times"][str(rows)] for rows in (small, large)}
    for rows in (small, large):
        f = got["facts"][str(rows)]
        figures.append(
            Figure(
                id=f"{SECTION}.batch.r{_label(rows)}.d{dim}",
                section=SECTION,
                title=f"RowTable lookup + apply of a batch ({BATCH} Zipf IDs, unique'd), {_label(rows)} rows, "
                f"dim {dim}",
                unit="ms",
                repeats=ms([t for r in per_round[rows] for t in r]),
                params={"rows": rows, "dim": dim, "optimizer": "adagrad", **({"dim_note": why} if why else {})},
                warmup=plan.sparse_steps,
                compare=[f"{SECTION}.batch.r{_label(small)}.d{dim}"] if rows == large else [],
                extra={"unique_ids": f["unique_ids"]},
            )
        )
    scale = [median(b) / median(a) for a, b in zip(per_round[small], per_round[large], strict=True)]
    figures.append(
        Figure(
            id=f"{SECTION}.scale.r{_label(large)}.d{dim}",
            section=SECTION,
            title=f"RowTable time per batch, {_label(large)} rows ÷ {_label(small)} rows, dim {dim}; per round",
            unit="x",
            repeats=[round(s, 4) for s in scale],
            params={
                "rows": [small, large],
                "dim": dim,
                "optimizer": "adagrad",
                "target": TARGET_SCALE,
                "baseline": f"{SECTION}.batch.r{_label(small)}.d{dim}",
                **({"dim_note": why} if why else {}),
            },
            warmup=plan.sparse_steps,
        )
    )
    held = {r: got["facts"][str(r)] for r in (small, large)}
    log(
        "sparse memory: bytes held "
        + ", ".join(f"{_label(r)} {f['nbytes'] / (f['rows'] * f['row_bytes']):.3f}x" for r, f in held.items())
        + f"; time per batch {_label(large)} ÷ {_label(small)} {median(scale):.2f}x"
    )
    return figures
