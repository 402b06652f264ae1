"""The report's sparse tables (bench.sparse, bench.sparse_many) and their plots: a part of bench.report."""

from __future__ import annotations

from typing import Any

from bench import report_links, report_plot
from bench.report_base import _Index, _table, fmt

PATHS = {"shm": "shared memory", "socket": "data socket", "grpc": "gRPC"}


def sparse(ix: _Index) -> list[str]:
    """The sparse section's tables."""
    figs = ix.section("sparse")
    if not figs:
        return []
    order = list(PATHS)
    lines = [
        "## Sparse tables: a step on 4,096 Zipf IDs against the same step in plain torch",
        "",
        'A worker process (1 torch thread) trains one `SparseEmbedding(dim, num_embeddings=1M, optimizer="adagrad")` '
        "and a one-element dense parameter: forward (torch.unique of the batch; its rows came with the previous "
        "push_pull, as the table was told to prefetch them), loss = sum, backward, `push_pull` (the touched rows' "
        "summed gradients, the dense gradient and the next batch's rows, one exchange per shard); sync mode, 1 "
        "worker. Local: `nn.Embedding(1M, dim, sparse=True)` + `torch.optim.Adagrad`, the same batches (Zipf(1.1) "
        "mod 1M, about 2,400 unique IDs of 4,096), 1 torch thread, in a process of its own. "
        "Both after one warm-up pass over the batches (so every row exists on the shards); rounds of local and PS "
        "steps in turn, and ÷ local is the median of each round's ratio of medians. 1 shard is the per-shard "
        "figure, 2 shards end to end.",
        "",
    ]
    steps = [f for f in figs if f["id"].startswith("sparse.step.")]
    if steps:
        rows = []
        for f in sorted(
            steps,
            key=lambda f: (
                f["params"]["dim"],
                f["params"]["shards"],
                order.index(f["params"]["wire"]) if f["params"]["wire"] in order else len(order),
            ),
        ):
            p, e = f["params"], f.get("extra", {})
            raw = ix.get(f["id"].replace("sparse.step.", "sparse.ms.", 1))
            rows.append(
                [
                    str(p["dim"]),
                    f"{p['shards']} ({p.get('scope', '')})",
                    PATHS.get(p["wire"], p["wire"]),
                    fmt(e.get("local_ms")),
                    fmt(raw["median"] if raw else None),
                    fmt(e.get("forward_ms")),
                    fmt(e.get("backward_ms")),
                    fmt(e.get("push_pull_ms")),
                    fmt(f["median"], "x"),
                    report_links._target(f["median"], p.get("target")),
                    _cpu_cell(ix, f["id"].replace("sparse.step.", "sparse.cpu.", 1)),
                ]
            )
        header = [
            "dim",
            "shards",
            "path",
            "local step ms",
            "PS step ms",
            "forward (lookup) ms",
            "backward ms",
            "push_pull ms",
            "÷ local step",
            "target",
            "CPU ÷ local (worker + shards ms); target",
        ]
        lines += [*_table(header, rows), ""]
    tput = [f for f in figs if f["id"].startswith("sparse.ids.")]
    if tput:
        rows = []
        for f in tput:
            p = f["params"]
            ratio = ix.get(f["id"].replace("sparse.ids.", "sparse.throughput.", 1))
            rows.append(
                [
                    PATHS.get(p["wire"], p["wire"]),
                    str(p["shards"]),
                    str(p["workers"]),
                    str(p["dim"]),
                    fmt(f["median"]),
                    fmt(ix.median(p["baseline"])),
                    fmt(ratio["median"] if ratio else None, "x"),
                ]
            )
        header = ["path", "shards", "workers", "dim", "M IDs/s", "local step M IDs/s (1 thread)", "÷ local"]
        lines += [
            f"Throughput: {tput[0]['params']['workers']} worker processes step as fast as they can against one shard "
            f"(async mode) for windows of {fmt(tput[0]['params']['seconds'])} s, local rounds in between; IDs/s "
            "counts every worker's 4,096 IDs a step over the window. All these processes share the machine's "
            "cores, which the local rate has to itself.",
            "",
            *_table(header, rows),
            "",
        ]
    held = [f for f in figs if f["id"].startswith("sparse.bytes.")]
    if held:
        rows = []
        for f in sorted(held, key=lambda f: f["params"]["rows"]):
            p, e = f["params"], f.get("extra", {})
            label = f["id"].split(".")[2]
            rss = ix.get(f"sparse.rss.{label}.d{p['dim']}")
            batch = ix.get(f"sparse.batch.{label}.d{p['dim']}")
            scale = ix.get(f"sparse.scale.{label}.d{p['dim']}")
            rows.append(
                [
                    f"{p['rows']:,}",
                    str(p["dim"]),
                    fmt(e["value_state_bytes"] / 1e6),
                    fmt(e["nbytes"] / 1e6),
                    fmt(f["median"], "x"),
                    report_links._target(f["median"], p.get("target")),
                    fmt(rss["median"] if rss else None, "x"),
                    fmt(e["slots"] / p["rows"], "x"),
                    fmt(e["huge_pages_bytes"] / 1e6) if "huge_pages_bytes" in e else "—",
                    fmt(batch["median"] if batch else None),
                    fmt(scale["median"], "x") if scale else "",
                    report_links._target(scale["median"], scale["params"].get("target")) if scale else "",
                ]
            )
        header = [
            "rows",
            "dim",
            "value + state MB",
            "held MB",
            "held ÷ (value + state)",
            "target",
            "RSS growth ÷ (value + state)",
            "slab slots ÷ rows",
            "process on huge pages MB",
            "ms per batch",
            "÷ smaller table",
            "target",
        ]
        note = next((f["params"]["dim_note"] for f in held if f["params"].get("dim_note")), "")
        lines += [
            "Row table (paramserver.shard.sparse.row_store.RowTable, Adagrad), one process, no servers: held = its "
            "nbytes "
            "(value and state slabs, hash index, per-slot arrays); RSS growth after malloc_trim (glibc keeps the "
            "heap freed temporaries held, a fixed amount, not a cost per row). Filled 4,096 new IDs an apply, in a "
            "random order; the slabs grow by 1.25x, so slots ÷ rows lies anywhere in 1.0-1.25x. ms per batch: lookup "
            "+ apply of the unique IDs of 4,096 Zipf IDs over the held rows, both tables in turn. Huge pages: the "
            "process's anonymous memory on transparent huge pages once that table was filled (numpy asks for them "
            "for the slabs; where the kernel has none to give, a large table's scattered rows miss the TLB more)."
            + (f" {note}." if note else ""),
            "",
            *_table(header, rows),
            "",
        ]
    return lines


def _cpu_cell(ix: _Index, fid: str) -> str:
    f = ix.get(fid)
    if f is None:
        return ""
    e = f.get("extra", {})
    worker, shards, local = (fmt(e.get(f"{k}_cpu_ms")) for k in ("worker", "shards", "local"))
    split = f"{worker} + {shards} vs {local}"
    return f"{fmt(f['median'], 'x')} ({split}); {report_links._target(f['median'], f['params'].get('target'))}"


def _many_key(f: dict[str, Any]) -> tuple[int, int, int]:
    p = f["params"]
    return p["tables"], p["workers"], p["shards"]


def sparse_many(ix: _Index) -> list[str]:
    """The sparse_many section's table: every case's CPU per sample, step time and samples/s against local torch."""
    figs = sorted((f for f in ix.section("sparse_many") if f["id"].startswith("sparse_many.cpu.")), key=_many_key)
    if not figs:
        return []
    rows = []
    for f in figs:
        p, e = f["params"], f.get("extra", {})
        key = f["id"].removeprefix("sparse_many.cpu.")
        step, rate = ix.get(f"sparse_many.step.{key}"), ix.get(f"sparse_many.rate.{key}")
        rows.append(
            [
                str(p["tables"]),
                str(p["workers"]),
                str(p["shards"]),
                fmt(e.get("local_ms")),
                fmt(e.get("ps_ms")),
                fmt(step["median"] if step else None, "x"),
                fmt(e.get("samples_per_s")),
                fmt(rate["median"] if rate else None, "x"),
                f"{fmt(e.get('workers_cpu_us_per_sample'))} + {fmt(e.get('shards_cpu_us_per_sample'))}",
                fmt(e.get("local_cpu_us_per_sample")),
                fmt(f["median"], "x"),
                report_links._target(f["median"], p.get("target")),
            ]
        )
    header = [
        "tables",
        "workers",
        "shards",
        "local step ms",
        "job step ms",
        "÷ local",
        "job samples/s",
        "÷ local",
        "CPU µs/sample (workers + shards)",
        "local µs/sample",
        "CPU ÷ local",
        "target",
    ]
    batch = figs[0]["params"]["batch"]
    return [
        "## Many tables: a DeepFM-shaped model through the shards against plain torch",
        "",
        "Each field a 16-wide and a 1-wide `SparseEmbedding` (Adagrad; four fields with millions of IDs, Zipf(1.1) "
        "IDs), 13 dense features, a bottom and a top MLP, BCE; each table prefetches the next batch's IDs; sync mode, "
        f"shared memory, {batch} samples a worker's step, one torch thread a process. Local: the same model with "
        "`nn.Embedding(sparse=True)` and `torch.optim.Adagrad`, one process, the same batch size. CPU counts every "
        "worker and shard process, per sample; rounds of local and job steps in turn, medians of each round's "
        "ratio. With W workers a step trains W batches: samples/s ÷ local above 1 is the job training faster than "
        "one process.",
        "",
        *_table(header, rows),
        "",
    ]


def plot_scaling(ax: Any, ix: _Index, by: str) -> None:
    """samples/s and CPU per sample ÷ local: against workers and shards (52 tables), or against tables (2 x 2)."""
    figs = sorted((f for f in ix.section("sparse_many") if f["id"].startswith("sparse_many.cpu.")), key=_many_key)
    if by == "workers":
        figs = [f for f in figs if f["params"]["tables"] == 52]
        labels = [f"{f['params']['workers']}w x {f['params']['shards']}s" for f in figs]
        title = "52 tables: samples/s and CPU per sample ÷ local torch"
    else:
        figs = [f for f in figs if (f["params"]["workers"], f["params"]["shards"]) == (2, 2)]
        labels = [f"{f['params']['tables']} tables" for f in figs]
        title = "2 workers x 2 shards: samples/s and CPU per sample ÷ local torch, by tables"
    if not figs:
        return report_plot._empty(ax, title)
    rates = [ix.median(f["id"].replace("sparse_many.cpu.", "sparse_many.rate.", 1)) for f in figs]
    report_plot._bars(ax, labels, {"samples/s ÷ local": rates, "CPU/sample ÷ local": [f["median"] for f in figs]}, "x")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_title(title)


def sparse_peer(ix: _Index) -> list[str]:
    """The sparse_peer section's table: TorchRec DMP against the local step and ours."""
    figs = sorted(
        (f for f in ix.section("sparse_peer") if f["id"].startswith("sparse_peer.ours.")),
        key=lambda f: f["params"]["dim"],
    )
    if not figs:
        return []
    rows = []
    for f in figs:
        p, e, d = f["params"], f.get("extra", {}), f["params"]["dim"]
        step, cpu = ix.get(f"sparse_peer.torchrec.step.d{d}"), ix.get(f"sparse_peer.torchrec.cpu.d{d}")
        rows.append(
            [
                str(d),
                fmt(e.get("peer_ms")),
                fmt(step["median"] if step else None, "x"),
                fmt(cpu["median"] if cpu else None, "x"),
                fmt(e.get("ours_ms")),
                fmt(f["median"], "x"),
                report_links._target(f["median"], p.get("target")),
                fmt(e.get("ours_cpu_vs_peer"), "x"),
            ]
        )
    header = [
        "dim",
        "TorchRec ms a rank",
        "÷ local step",
        "CPU ÷ local",
        "our step ms",
        "ours ÷ TorchRec",
        "target",
        "our CPU ÷ TorchRec's",
    ]
    return [
        "## A peer: TorchRec's DistributedModelParallel on the CPU",
        "",
        "TorchRec 1.8.0 (FBGEMM 1.8.0 CPU), one 1M-row table, exact Adagrad fused into backward, table-wise sharded "
        "over 2 rank processes (gloo, one thread each), each rank stepping on its own 4,096 Zipf IDs (rank 0 on the "
        "very batches of the local step and ours). Ours: 1 worker, 2 shards, sync, shared memory. Rounds of local, "
        "ours and the peer's steps in turn.",
        "",
        *_table(header, rows),
        "",
    ]
