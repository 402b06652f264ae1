"""Turn a results document (latest.json) into ratios, a markdown report and a plot.

Works on the JSON document alone, so an old latest.json can be re-rendered. matplotlib is imported only in
`plot`, and only there is it needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench import report_sparse

Doc = dict[str, Any]


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


def _ok(x: Any) -> bool:
    return isinstance(x, int | float) and not math.isnan(x)


def fmt(x: Any, unit: str = "") -> str:
    """A number with about three significant digits; a dash for none."""
    if not _ok(x):
        return "—"
    a = abs(x)
    text = f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 0.1 else f"{x:.3f}"
    return text + unit


class _Index:
    def __init__(self, doc: Doc) -> None:
        self.by_id = {f["id"]: f for f in doc["figures"]}

    def get(self, fid: str) -> dict[str, Any] | None:
        return self.by_id.get(fid)

    def median(self, fid: str) -> float | None:
        f = self.by_id.get(fid)
        return f["median"] if f else None

    def ratio(self, fid: str, base: str) -> float | None:
        f = self.by_id.get(fid)
        return f.get("ratios", {}).get(base) if f else None

    def section(self, name: str) -> list[dict[str, Any]]:
        return [f for f in self.by_id.values() if f["section"] == name]


_PATHS = {
    "shm": "shared memory",
    "socket": "data socket",
    "socket-bf16": "data socket, bf16 wire",
    "float32": "gRPC",
    "bf16": "gRPC, bf16 wire",
    "socket-tls": "data socket, TLS",
    "float32-tls": "gRPC, TLS",
}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


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
    lines += report_sparse.sparse_many(ix) + report_sparse.sparse_peer(ix)
    lines += _replication(ix) + _link(ix) + _stream(ix)
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


def _target(value: Any, limit: float | None) -> str:
    """A target and whether this run met it: "≤ 1.0x: met"; empty for no target."""
    if limit is None:
        return ""
    verdict = "" if not _ok(value) else (": met" if value <= limit else ": not met")
    return f"≤ {limit}x{verdict}"


_REPLICATION_PATHS = {"shm": "shared memory", "socket": "data socket"}


def _replication(ix: _Index) -> list[str]:
    figs = ix.section("replication")
    if not figs:
        return []
    lines = [
        "## Replication: --replicas 2 (a hot standby beside each primary)",
        "",
        "One shard, one worker process, sync mode (SGD); the shard's two copies are processes, their roles in a real "
        "etcd on loopback. A push with replicas is acknowledged once the backup answered for it. Cost: the same "
        "exchange against a job with --replicas 1, both jobs up at once and their rounds interleaved (r1, r2, then "
        "r2, r1, ...); ÷ is the ratio of the medians, paired the median of each pair of rounds' ratio. "
        "--checkpoint-dir: the write-ahead log on both sides (--wal-sync write, no checkpoint while timed).",
        "",
    ]
    cost = sorted(
        (f for f in figs if f["id"].startswith("replication.rt.") and f["params"]["replicas"] == 2),
        key=lambda f: (-f["params"]["bytes"], f["params"]["wal"], f["params"]["wire"]),
    )
    if cost:
        rows = []
        for f in cost:
            p, e = f["params"], f.get("extra", {})
            base_id = f["compare"][0] if f["compare"] else ""
            base = ix.get(base_id)
            r = ix.ratio(f["id"], base_id)
            rows.append(
                [
                    p["payload"],
                    _REPLICATION_PATHS.get(p["wire"], p["wire"]),
                    "yes" if p["wal"] else "no",
                    fmt(base["median"] if base else None),
                    fmt(f["median"]),
                    fmt(r, "x"),
                    fmt(e.get("paired_ratio_median"), "x"),
                    f"{fmt((base or {}).get('extra', {}).get('push_ms'))} / {fmt(e.get('push_ms'))}",
                    f"{fmt((base or {}).get('extra', {}).get('pull_ms'))} / {fmt(e.get('pull_ms'))}",
                    _target(r, e.get("target")),
                ]
            )
        header = [
            "payload",
            "path",
            "--checkpoint-dir",
            "push+pull ms, r1",
            "r2",
            "r2 ÷ r1",
            "paired",
            "push ms r1 / r2",
            "pull ms r1 / r2",
            "target",
        ]
        lines += [*_table(header, rows), ""]
    fail = [f for f in figs if f["id"].startswith("replication.failover.")]
    for f in fail:
        p, e = f["params"], f.get("extra", {})
        lines += [
            f"Failover, {p['payload']} model, 1 worker pushing (push_pull) as fast as it can on shared memory: the "
            f"primary SIGKILLed {len(f['repeats'])} times at random moments (restarted 0.5 s later, it comes back "
            "as the backup; the next kill once both copies are in sync); from the SIGKILL to the first acknowledged "
            f"push sent after it ({e.get('pushes', 0):,} pushes meanwhile).",
            "",
            *_table(
                ["kills", "min ms", "median ms", "p90 ms", "max ms"],
                [
                    [
                        str(len(f["repeats"])),
                        fmt(e.get("min_ms")),
                        fmt(e.get("median_ms")),
                        fmt(e.get("p90_ms")),
                        fmt(e.get("max_ms")),
                    ]
                ],
            ),
            "",
        ]
    catch = [f for f in figs if f["id"].startswith("replication.catchup.")]
    if catch:
        rows = []
        for f in sorted(catch, key=lambda f: (-f["params"]["bytes"], f["params"].get("pushing", False))):
            p, e, xs = f["params"], f.get("extra", {}), f["repeats"]
            serving = e.get("serving_to_in_sync_s") or []
            start = e.get("process_start_s") or []
            late = e.get("not_in_sync", 0)
            rows.append(
                [
                    p["payload"],
                    p.get("killed", ""),
                    "pushing" if p.get("pushing") else "idle",
                    str(len(xs)) + (f" (+{late} not in sync within {fmt(e.get('limit_s'))} s)" if late else ""),
                    f"{fmt(f['median'])} ({fmt(min(xs))}-{fmt(max(xs))})" if xs else "—",
                    f"{fmt(_median(serving))} ({fmt(min(serving))}-{fmt(max(serving))})" if serving else "—",
                    fmt(_median(start)),
                ]
            )
        lines += [
            "Catch-up of a restarted copy: it comes back as the backup, takes the primary's whole state, then the "
            "updates made meanwhile, and is in sync once etcd's in-sync set holds both copies again. Large model: "
            "its backup SIGKILLed and restarted, the worker idle or pushing as fast as it can; small model: the "
            "restarts of the failover runs. The process start (Python, torch, gRPC) is the same for any model.",
            "",
            *_table(
                [
                    "payload",
                    "copy killed",
                    "worker",
                    "restarts",
                    "restart → in sync s (min-max)",
                    "serving → in sync s (min-max)",
                    "process start s",
                ],
                rows,
            ),
            "",
        ]
    return lines


def _median(xs: list[float]) -> float | None:
    s = sorted(xs)
    if not s:
        return None
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _link(ix: _Index) -> list[str]:
    figs = ix.section("link")
    if not figs:
        return []
    rate = figs[0]["params"]["rate"]
    lines = [
        f"## Link (1 worker and 2 shards, each on a host of its own: network namespaces; the worker's link {rate} "
        "both ways, tbf)",
        "",
        "Where the link, not the cores, is the limit: what pushes in turn (the default over a network) and "
        "ps-worker --overlap are for.",
        "",
    ]
    steps = [f for f in figs if f["id"].startswith("link.step.")]
    if steps:
        gloo = next((f for f in figs if f["id"].startswith("link.gloo.")), None)
        rows = [["all_reduce (gloo, 2 workers)", "float32", "", fmt(gloo["median"]), "", ""]] if gloo else []
        for f in steps:
            p, ratios = f["params"], f.get("ratios", {})
            at_once = next((r for b, r in ratios.items() if b.endswith(".at-once")), None)
            rows.append(
                [
                    f"push_pull {p['payload']}",
                    p["wire"],
                    "in turn" if p["in_turn"] else "at once",
                    fmt(f["median"]),
                    fmt(at_once, "x") if at_once is not None else "",
                    fmt(next((r for b, r in ratios.items() if b.startswith("link.gloo.")), None), "x"),
                ]
            )
        lines += [*_table(["exchange", "wire", "pushes", "ms", "× at once", "× gloo"], rows), ""]
    runs = [f for f in figs if f["id"].startswith("link.sps.")]
    if runs:
        rows = []
        for f in runs:
            p = f["params"]
            acc = f.get("extra", {}).get("test_accuracy") or []
            rows.append(
                [
                    f"{p['model']} on {p['dataset']}",
                    p["mode"],
                    "yes" if p["overlap"] else "no",
                    f"{p['batch_size']}",
                    f"{p['epochs']}",
                    fmt(f["median"]),
                    fmt(next(iter(f.get("ratios", {}).values()), None), "x") if p["overlap"] else "",
                    fmt(sorted(acc)[len(acc) // 2] if acc else None),
                ]
            )
        header = ["training", "mode", "--overlap", "batch", "epochs", "samples/s", "× without", "test accuracy"]
        lines += [
            "Training: each run gets fresh shards; samples/s is the worker's rate, test accuracy after the same "
            "epochs (an overlapped gradient is one step staler).",
            "",
            *_table(header, rows),
            "",
        ]
    return lines


_STREAM_READERS = {
    "local": "local disk, prefetch 2",
    "prefetch": "HTTP, prefetch 2",
    "sequential": "HTTP, no prefetch (read a shard, then compute)",
    "slow": "HTTP, prefetch 2",
}


def _stream(ix: _Index) -> list[str]:
    figs = ix.section("stream")
    if not figs:
        return []
    p = figs[0]["params"]
    lines = [
        f"## Stream (CNN steps on {p['sample']} samples, batch {p['batch_size']}, one CPU thread, fed from "
        f"{p['shards']} Parquet shards; storage and worker on hosts of their own: network namespaces, the storage "
        "link limited by tbf)",
        "",
        f"Does prefetching hide the storage? The consumer takes {fmt(p['calibration_sps'])} samples/s from local disk "
        f"in a calibration run, {fmt(p['data_rate_mbit'])} Mbit/s of shards at {fmt(p['bytes_per_sample'] / 1e3)} KB "
        "a sample; the storage links are set to multiples of that. Target: streamed over a link that allows it "
        f"≥ {p['target']}x local disk.",
        "",
    ]
    rows = []
    for f in figs:
        q, e = f["params"], f.get("extra", {})
        r = next(iter(f.get("ratios", {}).values()), None)
        rate = f"{q['rate']} ({q['rate_x']:g}x)" if q.get("rate") else "—"
        steady = e.get("ratio_after_first_batch")
        after = f" ({fmt(steady, 'x')} after the first batch)" if steady else ""
        rows.append(
            [
                _STREAM_READERS.get(q["run"], q["run"]),
                rate,
                fmt(f["median"]),
                (fmt(r, "x") if r is not None else "") + after,
                fmt(_median(e.get("first_batch_s", [])), " s"),
                fmt(_median(e.get("waited_s", [])), " s"),
                fmt(_median(e.get("cpu_s", [])), " s"),
                fmt(e.get("link_use_median"), "x") if q.get("rate") else "",
            ]
        )
    header = ["reader", "storage link", "samples/s", "÷ local disk", "first batch", "step waited", "CPU", "link use"]
    slow_world = max(f["params"].get("world", 1) for f in figs)
    lines += [
        *_table(header, rows),
        "",
        f"Each pass: {p['samples']} samples (over the slower link: rank 0's of {slow_world}), timed whole from the "
        "reader's start; medians of "
        f"{len(figs[0]['repeats'])} interleaved passes. Step waited: time the steps spent waiting for data (the "
        "first batch included); CPU: the consumer process's CPU time in the pass (all its threads); link use: shard "
        "bytes per second over the link's rate (TCP/IP and HTTP headers take a few percent of it).",
        "",
    ]
    return lines


# The targets of the performance issue, as (label, figure id, how to read it, target, whether lower is better).
README_BEGIN = "<!-- bench:summary:begin (written by `make bench` from bench/results/latest.json) -->"
README_END = "<!-- bench:summary:end -->"


# The paths the README's summary names: same host, another host (the default, then without a data socket).
_SUMMARY_PATHS = (
    ("shm", "shared memory"),
    ("socket", "data socket"),
    ("float32", "gRPC"),
    ("socket-bf16", "data socket, bf16 wire"),
    ("bf16", "gRPC, bf16 wire"),
)


def summary(doc: Doc) -> str:
    """The README's table: each performance target against the figure of this run that answers it."""
    ix = _Index(doc)
    rows: list[list[str]] = []

    def ratio(fid: str, base: str) -> float | None:
        return ix.ratio(fid, base)

    def row(what: str, value: float | None, unit: str, target: str, ok: bool | None) -> None:
        verdict = "—" if ok is None else ("met" if ok else "not met")
        rows.append([what, fmt(value, unit), target, verdict])

    def check(value: float | None, limit: float, lower: bool = True) -> bool | None:
        if value is None or not _ok(value):
            return None
        return value <= limit if lower else value >= limit

    for wire, name in _SUMMARY_PATHS:
        fid = f"transport.rt.100MB.s2.w1.{wire}"
        if ix.get(fid) is None:
            continue
        bf16 = wire.endswith("bf16")
        limit = 0.6 if bf16 else 1.0
        g = ratio(fid, "baselines.gloo.100MB")
        row(f"100 MB push + pull, 2 shards, 1 worker, {name} ÷ gloo all_reduce", g, "x", f"≤ {limit}x", check(g, limit))
        if not bf16:
            r = ratio(fid, "baselines.rpc.rt.100MB.w1")
            row("the same ÷ torch.distributed.rpc PS", r, "x", "≤ 0.67x (1.5x faster)", check(r, 1 / 1.5))
        if wire in ("socket", "float32"):
            for what, base in (("push", "up"), ("pull", "down")):
                t = ratio(f"transport.{what}.100MB.s2.w1.{wire}", f"baselines.tcp.{base}.100MB")
                row(f"{what} GB/s, {name} ÷ raw TCP", t, "x", "≥ 0.7x", check(t, 0.7, lower=False))
    for wire, name in (("socket", "data socket"), ("float32", "gRPC")):
        r = ratio(f"transport.rt.100MB.s2.w1.{wire}-tls", f"transport.rt.100MB.s2.w1.{wire}")
        if r is not None:
            row(f"100 MB push + pull, 2 shards, 1 worker, {name} with TLS ÷ in the clear", r, "x", "", None)
    for wire, name in _SUMMARY_PATHS[:3]:
        fid = f"transport.rt.340KB.s2.w1.{wire}"
        if ix.get(fid) is not None:
            v = ix.median(fid)
            row(f"digits MLP (340 KB) push + pull, 2 shards, {name}", v, " ms", "≤ 1.5 ms", check(v, 1.5))
            v = ix.median(f"transport.step.340KB.s2.w1.{wire}")
            row("the same as one push_pull call", v, " ms", "", None)
    for wire, name in _SUMMARY_PATHS[:3]:
        fid = f"transport.rt.100MB.s2.w2.{wire}"
        if ix.get(fid) is not None:
            g = ratio(fid, "baselines.gloo.100MB")
            row(f"100 MB sync round, 2 workers, {name} ÷ gloo all_reduce", g, "x", "≤ 2.0x", check(g, 2.0))
    for mode in ("sync", "async"):
        fid = f"training.sps.mlp.digits.w2.{mode}"
        if ix.get(fid) is not None:
            r = ratio(fid, "training.sps.mlp.digits.local")
            row(f"digits MLP training, 2 workers, {mode}, samples/s ÷ local", r, "x", "≥ 0.4x", check(r, 0.4, False))
    fid = "training.sps.mlp25m.synthetic.w2.sync"
    if ix.get(fid) is not None:
        r = ratio(fid, "training.sps.mlp25m.synthetic.local")
        row("25 M-parameter MLP training, 2 workers, sync, ÷ local", r, "x", "≥ 0.8x", check(r, 0.8, lower=False))
    fid = "training.sps.mlp25m.synthetic.w1.async+overlap"
    if ix.get(fid) is not None:
        r = ratio(fid, "training.sps.mlp25m.synthetic.w1.async")
        row("25 M-parameter MLP training, 1 worker, async, with --overlap ÷ without", r, "x", "", None)
    for f in ix.section("link"):
        p = f["params"]
        if f["id"].startswith("link.step.") and p["in_turn"]:
            ratios = f.get("ratios", {})
            at_once = next((r for b, r in ratios.items() if b.endswith(".at-once")), None)
            where = f"{p['payload']} push_pull, 2 shards, 1 worker, {p['rate']} link, {p['wire']}, pushes in turn"
            row(f"{where} ÷ at once", at_once, "x", "", None)
            gloo = next((r for b, r in ratios.items() if b.startswith("link.gloo.")), None)
            limit = 0.6 if p["wire"] == "bf16" else 1.0
            row("the same ÷ gloo all_reduce over such links", gloo, "x", f"≤ {limit}x", check(gloo, limit))
    fid = "link.sps.cnn.w1.async+overlap"
    if ix.get(fid) is not None:
        rate = ix.get(fid)["params"]["rate"]  # type: ignore[index]
        r = ratio(fid, "link.sps.cnn.w1.async")
        row(f"CNN training over a {rate} link, 1 worker, async, with --overlap ÷ without", r, "x", "", None)
    fid = "stream.sps.prefetch"
    if ix.get(fid) is not None:
        p = ix.get(fid)["params"]  # type: ignore[index]
        r = ratio(fid, "stream.sps.local")
        what = f"CNN steps fed over HTTP through a {p['rate']} link ({p['rate_x']:g}x their data rate), prefetch"
        row(f"{what}, samples/s ÷ from local disk", r, "x", f"≥ {p['target']}x", check(r, p["target"], lower=False))
        r = ratio("stream.sps.sequential", "stream.sps.local")
        row("the same without prefetch ÷ from local disk", r, "x", "", None)
    for f in ix.section("replication"):
        p = f["params"]
        if f["id"].startswith("replication.rt.") and p["replicas"] == 2 and f["compare"]:
            r = ratio(f["id"], f["compare"][0])
            wal = ", --checkpoint-dir" if p["wal"] else ""
            what = f"{p['payload']} push + pull, 1 shard, {_REPLICATION_PATHS.get(p['wire'], p['wire'])}{wal}"
            row(f"{what}, --replicas 2 ÷ --replicas 1", r, "x", "≤ 1.3x", check(r, 1.3))
        elif f["id"].startswith("replication.failover."):
            e = f.get("extra", {})
            row(
                f"failover after a SIGKILL of the primary, median of {len(f['repeats'])}",
                e.get("median_ms"),
                " ms",
                "",
                None,
            )
    fid = "training.tta.cnn.w2.sync"
    if ix.get(fid) is not None:
        row("CNN time to 0.95 accuracy, 2 workers, sync, ÷ local", ratio(fid, "training.tta.cnn.local"), "x", "", None)
    for wire, name in _SUMMARY_PATHS[:3]:
        figs = [f for f in ix.section("memory") if f["unit"] == "x" and f["params"].get("wire") == wire]
        if figs:
            top = max(figs, key=lambda f: (f["params"]["workers"], f["extra"]["over_working"]))
            w = top["params"]["workers"]
            v = max(f["extra"]["over_working"] for f in figs if f["params"]["workers"] == w)
            row(
                f"shard memory (anon) with {w} workers, {name}, ÷ (params + SGD state)",
                v,
                "x",
                "≤ 1.1x",
                check(v, 1.1),
            )
    for wire, name in _SUMMARY_PATHS[:2]:
        for shards, scope in ((1, "1 shard"), (2, "2 shards")):
            fid = f"sparse.step.{wire}.s{shards}.d64"
            if ix.get(fid) is not None:
                v = ix.median(fid)
                what = f"sparse step, 4,096 Zipf IDs, dim 64, {scope}, {name}, ÷ local nn.Embedding(sparse) step"
                row(what, v, "x", "≤ 1.2x", check(v, 1.2))
            fid = f"sparse.cpu.{wire}.s{shards}.d64"
            if ix.get(fid) is not None:
                v = ix.median(fid)
                what = f"sparse step's CPU (worker + shards), dim 64, {scope}, {name}, ÷ the local process's"
                row(what, v, "x", "≤ 1.3x", check(v, 1.3))
    peer = ix.get("sparse_peer.ours.d64")
    if peer is not None:
        what = "sparse step, dim 64, 2 shards, shared memory, ÷ TorchRec DMP's step (2 CPU ranks)"
        row(what, peer["median"], "x", "≤ 0.33x", check(peer["median"], 1 / 3))
    main = ix.get("sparse_many.cpu.t52.w2.s2")
    if main is not None:
        what = "52-table model, 2 workers x 2 shards, sync: CPU per sample ÷ local torch's"
        row(what, main["median"], "x", "≤ 1.3x", check(main["median"], 1.3))
    for f in ix.section("sparse"):
        p = f["params"]
        if f["id"].startswith("sparse.throughput."):
            what = f"sparse IDs/s, 1 shard, {p['workers']} workers, {report_sparse.PATHS.get(p['wire'], p['wire'])}"
            row(f"{what}, ÷ the local step's (1 thread)", f["median"], "x", "", None)
    held = [f for f in ix.section("sparse") if f["id"].startswith("sparse.bytes.")]
    if held:
        top = max(held, key=lambda f: f["params"]["rows"])
        v = top["median"]
        what = f"sparse table memory, {top['params']['rows']:,} rows, dim {top['params']['dim']}, ÷ (value + state)"
        row(what, v, "x", "≤ 1.3x", check(v, 1.3))
    for f in ix.section("sparse"):
        if f["id"].startswith("sparse.scale."):
            small, large = f["params"]["rows"]
            what = f"sparse table time per batch, {large:,} rows ÷ {small:,} rows, dim {f['params']['dim']}"
            row(what, f["median"], "x", "≤ 1.5x", check(f["median"], 1.5))
    m = doc["machine"]
    head = (
        f"From `make bench` on {doc['started']} ({m.get('cores')} cores, GLIBC_TUNABLES: "
        f"{m.get('glibc_tunables')}); ratios against baselines of the same run. Full tables: "
        "`bench/results/latest.md`."
    )
    return "\n".join([head, "", *_table(["what", "this run", "target", ""], rows)]) + "\n"


def update_readme(doc: Doc, readme: Path) -> bool:
    """Replace the summary between the README's markers; return False when the markers are missing."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(head + README_BEGIN + "\n" + summary(doc) + README_END + tail)
    return True


def plot(doc: Doc, path: Path) -> bool:
    """Draw latest.png (six panels); return False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ix = _Index(doc)
    fig, axes = plt.subplots(3, 2, figsize=(14, 13))
    _plot_round_trips(axes[0][0], ix, doc)
    _plot_throughput(axes[0][1], ix, doc)
    _plot_training(axes[1][0], ix)
    _plot_memory(axes[1][1], ix)
    report_sparse.plot_scaling(axes[2][0], ix, "workers")
    report_sparse.plot_scaling(axes[2][1], ix, "tables")
    fig.suptitle(f"paramserver benchmarks, {doc['started']}, {doc['machine'].get('cores')} cores")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    tmp.replace(path)
    return True


def _payloads(doc: Doc) -> list[str]:
    labels = (["340KB"] if doc["plan"].get("small_model") else []) + list(doc["plan"]["payloads"])
    return labels


def _bars(ax: Any, groups: list[str], series: dict[str, list[float | None]], ylabel: str, log: bool = False) -> None:
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if _ok(v) else 0 for v in values], width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _empty(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _plot_round_trips(ax: Any, ix: _Index, doc: Doc) -> None:
    title = "push + pull round trip, 1 worker (ms, log scale)"
    labels = _payloads(doc)
    shards = 2 if 2 in doc["plan"]["transport_shards"] else doc["plan"]["transport_shards"][0]
    ours = {w: [ix.median(f"transport.rt.{p}.s{shards}.w1.{w}") for p in labels] for w in ("shm", "socket", "float32")}
    if not any(_ok(v) for vs in ours.values() for v in vs) and not ix.section("baselines"):
        return _empty(ax, title)
    series = {
        **{f"paramserver, {_PATHS[w]} ({shards} shards)": vs for w, vs in ours.items()},
        "torch rpc PS": [ix.median(f"baselines.rpc.rt.{p}.w1") for p in labels],
        "gloo all_reduce": [ix.median(f"baselines.gloo.{p}") for p in labels],
        "raw TCP": [ix.median(f"baselines.tcp.rt.{p}") for p in labels],
    }
    _bars(ax, labels, series, "ms", log=True)
    ax.set_title(title)


def _plot_throughput(ax: Any, ix: _Index, doc: Doc) -> None:
    title = "payload GB/s, 1 worker (push / pull vs raw TCP send / receive)"
    labels = [p for p in _payloads(doc) if p != "340KB"]
    shards = 2 if 2 in doc["plan"]["transport_shards"] else doc["plan"]["transport_shards"][0]
    series = {
        **{
            f"{what}, {_PATHS[w]}": [ix.median(f"transport.{what}.{p}.s{shards}.w1.{w}") for p in labels]
            for w in ("socket", "float32")
            for what in ("push", "pull")
        },
        "TCP send": [ix.median(f"baselines.tcp.up.{p}") for p in labels],
        "TCP receive": [ix.median(f"baselines.tcp.down.{p}") for p in labels],
    }
    if not any(_ok(v) for vs in series.values() for v in vs):
        return _empty(ax, title)
    _bars(ax, labels, series, "GB/s")
    ax.set_title(title)


def _plot_training(ax: Any, ix: _Index) -> None:
    title = "training samples/s ÷ local"
    figs = [f for f in ix.section("training") if f["id"].startswith("training.sps.") and f["params"]["mode"] != "local"]
    if not figs:
        return _empty(ax, title)
    names = [f"{_name(f['params']['model'])}\n{f['params']['workers']}w {f['params']['mode']}" for f in figs]
    values = [next(iter(f.get("ratios", {}).values()), 0.0) for f in figs]
    ax.bar(range(len(figs)), values, color="tab:green")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(figs)), names, fontsize=7)
    ax.set_ylabel("× local samples/s")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)


def _name(model: str) -> str:
    return model.rsplit(":", 1)[-1]


def _plot_memory(ax: Any, ix: _Index) -> None:
    title = "shard 0 memory: (peak anon − idle or working anon RSS) ÷ (params + SGD state)"
    figs = [f for f in ix.section("memory") if f["unit"] == "x"]
    if not figs:
        return _empty(ax, title)
    workers = sorted({f["params"]["workers"] for f in figs})
    series: dict[str, list[float | None]] = {}
    for wire in sorted({f["params"].get("wire", "float32") for f in figs}):
        found = [ix.get(f"memory.overhead.{wire}.w{w}.shard0") for w in workers]
        name = _PATHS.get(wire, wire)
        series[f"{name}, from idle"] = [f["median"] if f else None for f in found]
        series[f"{name}, from working"] = [f["extra"].get("over_working") if f else None for f in found]
    _bars(ax, [f"{w} worker(s)" for w in workers], series, "× params + state")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_title(title)
