"""Turn a results document (latest.json) into ratios, a markdown report and a plot.

Works on the JSON document alone, so an old latest.json can be re-rendered. matplotlib is imported only in
`plot`, and only there is it needed.
"""

from __future__ import annotations

from bench import report_links, report_loops, report_plot, report_sparse, report_summary
from bench.report_base import _PATHS, Doc, _Index, _ok, _table, fmt  # noqa: F401 - report_sparse reads them here


def add_ratios(doc: Doc) -> None:
    """Give every figure `ratios`: its median divided by the median of each baseline it names, when measured."""
    by_id = {f["id"]: f for f in doc["figures"]}
    for f in doc["figures"]:
        ratios = {}
        for base in f.get("compare", []):
            b = by_id.get(base)
            if b and _ok(b["median"]) and _ok(f["median"]) and b["median"] > 0:
                ratios[base] = round(f["median"] / b["median"], 4)
        f["ratios"] = ratios


def markdown(doc: Doc) -> str:
    """The report: one table per section, with ratios against the baselines of the same run."""
    m, plan, ix = doc["machine"], doc["plan"], _Index(doc)
    load = m.get("load_average") or []
    lines = [
        "# paramserver benchmarks",
        "",
        f"{doc['started']} · {m.get('cores')} cores ({m.get('cpu', 'cpu unknown')}) · {m.get('memory_gb', '?')} GB · "
        f"Python {m.get('python')} · torch {m.get('torch')} · grpcio {m.get('grpc')} · "
        f"GLIBC_TUNABLES: {m.get('glibc_tunables')} · load average at start {fmt(load[0] if load else None)} · "
        f"{'quick run · ' if plan['quick'] else ''}suite took {fmt(doc.get('seconds'))} s",
        "",
        f"Every figure is the median of its repeats after a warm-up ({plan['repeats']} repeats for large payloads, "
        f"4x for 1-50 MB, 10x below; {plan['train_repeats']} whole runs per training figure). Ratios compare with "
        "baselines measured in this same run; compare numbers across runs or machines only with care "
        "(shared 2-core machines vary by up to 2x between passes). MB and GB are decimal (10^6, 10^9 bytes).",
        "",
    ]
    lines += _transport(ix, doc) + _baselines(ix) + _training(ix) + _memory(ix) + report_sparse.sparse(ix)
    lines += report_sparse.sparse_many(ix) + report_sparse.sparse_peer(ix) + report_loops.third_party(ix)
    lines += (
        report_links.replication(ix)
        + report_links.link(ix)
        + report_links.compress(ix)
        + report_links.overlap_backward(ix)
        + report_links.hosts(ix)
        + report_links.stream(ix)
    )
    errors = {k: v["error"] for k, v in doc.get("sections", {}).items() if not v.get("ok")}
    if errors:
        lines += ["## Errors", ""] + [f"- **{k}**: {v}" for k, v in errors.items()] + [""]
    return "\n".join(lines).rstrip() + "\n"


def _transport(ix: _Index, doc: Doc) -> list[str]:
    figs = [f for f in ix.section("transport") if f["id"].startswith("transport.rt.")]
    if not figs:
        return []
    rows = []
    order = list(_PATHS)
    for f in sorted(
        figs,
        key=lambda f: (
            f["params"]["bytes"],
            f["params"]["shards"],
            f["params"]["workers"],
            order.index(f["params"]["wire"]) if f["params"]["wire"] in order else len(order),
        ),
    ):
        p = f["params"]
        label, w = p["payload"], p["workers"]
        key = f["id"].removeprefix("transport.rt.")
        cells = []
        for what, base in (("push", "up"), ("pull", "down")):
            fid, bid = f"transport.{what}.{key}", f"baselines.tcp.{base}.{label}"
            r = ix.ratio(fid, bid)
            cells.append(fmt(ix.median(fid)) + (f" ({r:.0%} of TCP)" if r is not None else ""))
        rows.append(
            [
                label,
                str(p["shards"]),
                str(w),
                _PATHS.get(p["wire"], p["wire"]),
                fmt(f["median"]),
                fmt(ix.median(f"transport.step.{key}")),
                *cells,
                fmt(ix.ratio(f["id"], f"baselines.tcp.rt.{label}"), "x"),
                fmt(ix.ratio(f["id"], f"baselines.rpc.rt.{label}.w{w}"), "x"),
                fmt(ix.ratio(f["id"], f"baselines.gloo.{label}"), "x"),
            ]
        )
    header = [
        "payload",
        "shards",
        "workers",
        "path",
        "push+pull ms",
        "push_pull ms",
        "push GB/s",
        "pull GB/s",
        "÷ raw TCP round trip",
        "÷ torch rpc PS",
        "÷ gloo all_reduce",
    ]
    return [
        "## Transport: one push + pull of a dense float32 model (sync mode, SGD on the shards)",
        "",
        "Shards are processes (`LocalCluster(processes=True)`); every worker is a process. The model is 4 equal "
        "tensors (at 100 MB each is sliced across the shards; at 4 MB each is placed whole); 340KB is the digits "
        "MLP. Paths: shared memory (a worker on the shards' host: memfd segments plus the Unix-socket "
        "doorbell); data socket (what a worker on another host uses: raw tensor bytes over the shard's TCP data "
        "socket, here over loopback); gRPC (the Push and Pull streams, or one unary call for a small model: a "
        "shard without a reachable data socket). push+pull: a push "
        "call, then a pull call; push_pull: the fused call a training step makes (one exchange per shard). Push "
        "and pull GB/s (float32 model bytes, even on the bf16 wire) are timed separately with 1 worker; "
        "a push returns once the shards have applied the SGD step. "
        "Ratios divide our time by the baseline's (above 1 = slower than the baseline); with 2 workers each round "
        "waits for both.",
        "",
        *_table(header, rows),
        "",
    ]


def _baselines(ix: _Index) -> list[str]:
    figs = ix.section("baselines")
    if not figs:
        return []
    rows = []
    for f in sorted(figs, key=lambda f: (f["id"].split(".")[1], f["params"]["bytes"], f["params"].get("workers", 0))):
        kind, p = f["id"].split(".")[1], f["params"]
        label = p["payload"]
        if kind == "tcp" and f["id"].startswith("baselines.tcp.rt."):
            rows.append(
                [
                    "raw TCP, 2 processes",
                    label,
                    "1",
                    fmt(f["median"]),
                    fmt(ix.median(f"baselines.tcp.up.{label}")),
                    fmt(ix.median(f"baselines.tcp.down.{label}")),
                ]
            )
        elif kind == "gloo":
            rows.append(["gloo all_reduce, 2 processes", label, "2", fmt(f["median"]), "", ""])
        elif kind == "rpc":
            rows.append(["torch.distributed.rpc PS (TCP)", label, str(p["workers"]), fmt(f["median"]), "", ""])
    return [
        "## Baselines, same run, same machine (127.0.0.1)",
        "",
        "Raw TCP: send N bytes (the server answers one byte when it has them), then receive N bytes into a "
        "preallocated buffer. gloo: one all_reduce of the tensor, what DDP pays per step. rpc PS: a server process "
        "applies SGD to each pushed gradient; workers `rpc_sync` a push, then a pull that returns the tensor. "
        "When the transport cases run too, every baseline is measured both before and after them and its median "
        "is taken over both passes, so a drift of the machine's speed meanwhile weighs on both sides of a ratio.",
        "",
        *_table(["baseline", "payload", "workers", "ms", "send GB/s", "receive GB/s"], rows),
        "",
    ]


def _training(ix: _Index) -> list[str]:
    figs = [f for f in ix.section("training") if f["id"].startswith("training.sps.")]
    lines: list[str] = []
    if figs:
        rows = []
        for f in figs:
            p = f["params"]
            local = f"training.sps.{f['id'].split('.')[2]}.{p['dataset']}.local"
            r = ix.ratio(f["id"], local) if p["mode"] != "local" else 1.0
            length = f"{p['epochs']} epochs" if p.get("epochs") else f"{p.get('steps')} steps"
            acc = f.get("extra", {}).get("test_accuracy") or []
            rows.append(
                [
                    p["model"],
                    f"{p.get('parameters', 0):,}",
                    p["dataset"],
                    length,
                    str(p["workers"]),
                    p["mode"],
                    fmt(f["median"]),
                    fmt(r, "x"),
                    fmt(sorted(acc)[len(acc) // 2] if acc else None),
                ]
            )
        header = ["model", "parameters", "data", "length", "workers", "mode", "samples/s", "× local", "test accuracy"]
        lines += [
            "## Training (2 shard processes, Adam lr 1e-3 on the shards; batch 32 per worker; 1 torch thread)",
            "",
            "samples/s is the job's: every worker's samples over the span from the first worker's start to the "
            "last one's end. Local: the same model, data pipeline and batch size in one "
            "process with torch.optim.Adam (its fused kernel, as on the shards). The 25 M-parameter MLP trains on "
            "synthetic data (64 features).",
            "",
            *_table(header, rows),
            "",
        ]
    tta = [f for f in ix.section("training") if f["id"].startswith("training.tta.") and f["params"]["mode"] != "local"]
    for f in tta:
        p, extra = f["params"], f.get("extra", {})
        local_id = f["compare"][0] if f["compare"] else ""
        local = ix.get(local_id)
        reached = extra.get("reached")
        tried = ", ".join(
            f"{t['epochs']} epochs: {t['test_accuracy']:.3f} in {t['seconds']:.1f} s" for t in extra["tried"]
        )
        local_epochs = (local or {}).get("extra", {}).get("epochs") or []
        rows = [
            [
                f"{p['workers']} workers, {p['mode']}",
                str(reached["epochs"]) if reached else f"not within {extra['tried'][-1]['epochs']}",
                fmt(f["median"]),
                fmt(ix.ratio(f["id"], local_id), "x"),
            ],
            [
                "local",
                str(local_epochs[0]) if local_epochs else "not reached",
                fmt(local["median"] if local else None),
                "",
            ],
        ]
        lines += [
            f"### Time to {p['target']} test accuracy, {p['model']} on digits",
            "",
            f"Runs of growing length (fresh shards each), the first to reach the target counts: {tried}. "
            "Seconds are training time (after register, before evaluation); local evaluates after every epoch.",
            "",
            *_table(["setup", "epochs", "seconds", "× local"], rows),
            "",
        ]
    return lines


def _memory(ix: _Index) -> list[str]:
    figs = [f for f in ix.section("memory") if f["unit"] == "x"]
    if not figs:
        return []
    rows = []
    for f in sorted(figs, key=lambda f: (f["params"].get("wire", ""), f["params"]["workers"], f["params"]["shard"])):
        p, e = f["params"], f["extra"]
        rows.append(
            [
                _PATHS.get(p.get("wire", "float32"), p.get("wire", "")),
                str(p["workers"]),
                str(p["shard"]),
                fmt(p["params_plus_state_mb"]),
                fmt(e["peak_rss_mb"]),
                fmt(e["peak_shared_mb"]),
                fmt(e["peak_file_mb"]),
                fmt(e["idle_anon_mb"]),
                fmt(e["peak_anon_mb"]),
                fmt(f["median"], "x"),
                fmt(e["working_anon_mb"]),
                fmt(e["over_working"], "x"),
            ]
        )
    first = figs[0]["params"]
    header = [
        "path",
        "workers",
        "shard",
        "params + SGD state MB",
        "peak RSS MB",
        "of which workers' segments MB",
        "of which library code MB",
        "idle anon MB",
        "peak anon MB",
        "(anon − idle) ÷ state",
        "working-shard anon MB",
        "(anon − working) ÷ state",
    ]
    return [
        f"## Memory: peak RSS per shard (sync, SGD, {first['parameters']:,} parameters on {first['shards']} shards)",
        "",
        "RSS sampled every 20 ms (and the kernel's VmHWM). anon = the shard's own memory (RssAnon: heap, buffers, "
        "the model); RSS also counts the pages of shared-memory segments (on the shm path each same-host worker's "
        "segment, two regions the size of the shard's part created by the worker, is mapped into the shard as "
        "well) and file-backed pages (the code of Python, torch and gRPC, shared by every process that loads it), "
        "shown apart. idle = the same process before any model. params + state "
        "= the shard's parameters and one gradient-sized buffer (1.00x would be the minimum). Working shard: a "
        "shard process holding a 64-element model after a few rounds, i.e. what every shard pays once whatever its "
        "model (torch._dynamo, which torch's first optimizer imports, is in the idle figure too: a shard process "
        "imports it before it serves).",
        "",
        *_table(header, rows),
        "",
    ]


# Where they lived before this module was split; run.py and the tests call them here.
summary = report_summary.summary
update_readme = report_summary.update_readme
plot = report_plot.plot
