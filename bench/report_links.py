"""The markdown tables of the sections about the links between processes: replication (what a backup costs,
failover, catch-up), a link of limited rate between a worker and the shards (compressed pushes, pushes that follow
backward), and streaming a prepared dataset."""

from __future__ import annotations

from typing import Any

from bench.report_base import _Index, _ok, _table, fmt


def _target(value: Any, limit: float | None) -> str:
    """A target and whether this run met it: "≤ 1.0x: met"; empty for no target."""
    if limit is None:
        return ""
    verdict = "" if not _ok(value) else (": met" if value <= limit else ": not met")
    return f"≤ {limit}x{verdict}"


_REPLICATION_PATHS = {"shm": "shared memory", "socket": "data socket"}


def replication(ix: _Index) -> list[str]:
    figs = ix.section("replication")
    if not figs:
        return []
    lines = [
        "## Replication: --replicas 2 (a hot standby beside each primary)",
        "",
        "One shard, one worker process, sync mode (SGD); the shard's two copies are processes, their roles in a real "
        "etcd on loopback. An exchange (push_pull) with replicas is answered once the backup answered for its "
        "update, which the primary forwards as the push arrives or while it applies it. Cost: the same "
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
                    _target(r, e.get("target")),
                ]
            )
        header = [
            "payload",
            "path",
            "--checkpoint-dir",
            "push_pull ms, r1",
            "r2",
            "r2 ÷ r1",
            "paired",
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


def link(ix: _Index) -> list[str]:
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


def compress(ix: _Index) -> list[str]:
    figs = ix.section("compress")
    if not figs:
        return []
    lines = [
        "## Compress: --compress over links of several rates (1 worker and 2 shards on hosts of their own, tbf)",
        "",
        "Exchange: one push_pull of 4 square weight matrices (random gradients), pushes in turn; gloo: all_reduce of "
        "the same float32 bytes between 2 workers on such links (what DDP pays a step). Target (issue 29): at most "
        "0.5x gloo at 400mbit.",
        "",
    ]
    rates = list(dict.fromkeys(f["params"]["rate"] for f in figs))
    rows = []
    for rate in rates:
        gloo = ix.get(f"compress.{rate}.gloo")
        if gloo is not None:
            rows.append(
                [rate, f"all_reduce (gloo) {gloo['params']['payload']}", "float32", "", fmt(gloo["median"]), "", ""]
            )
        for f in figs:
            p = f["params"]
            if p["rate"] != rate or ".step." not in f["id"]:
                continue
            ratios = f.get("ratios", {})
            rows.append(
                [
                    rate,
                    f"push_pull {p['payload']}",
                    p["wire"],
                    p["compress"] or "whole",
                    fmt(f["median"]),
                    fmt(ratios.get(f"compress.{rate}.gloo"), "x"),
                    fmt(ratios.get(f"compress.{rate}.step.bf16.whole"), "x"),
                ]
            )
    lines += [*_table(["link", "exchange", "wire", "compress", "ms", "× gloo", "× bf16 whole"], rows), ""]
    tta = [f for f in figs if ".tta." in f["id"]]
    if tta:
        rows = []
        for f in tta:
            p, e = f["params"], f.get("extra", {})
            rate = p["rate"]
            sps = ix.get(f["id"].replace(".tta.", ".sps."))
            base = "compress.{}.{}.bf16.whole"
            rows.append(
                [
                    rate,
                    p["wire"],
                    p["compress"] or "whole",
                    fmt(f["median"]),
                    fmt(f.get("ratios", {}).get(base.format(rate, "tta")), "x"),
                    fmt(_median(e.get("test_accuracy") or [])),
                    fmt(_median(e.get("step_ms") or [])),
                    fmt(sps["median"]) if sps else "—",
                    fmt((sps or {}).get("ratios", {}).get(base.format(rate, "sps")), "x"),
                ]
            )
        p0 = tta[0]["params"]
        big = next((f for f in figs if ".sps." in f["id"]), None)
        header = ["link", "wire", "compress", "s to target", "× bf16", "accuracy", "step ms", "MLP samples/s", "× bf16"]
        lines += [
            f"Training, 1 worker, sync, fresh shards each run: the CNN on digits (batch {p0['batch_size']}, "
            f"{p0['epochs']} epochs, tested after each: seconds until the first test at the target, the accuracy at "
            f"the end, ms a step) and {big['params']['model'] if big else 'the MLP'} (batch 128, "
            f"{big['params']['steps'] if big else '?'} steps: samples/s).",
            "",
            *_table(header, rows),
            "",
        ]
    return lines


def overlap_backward(ix: _Index) -> list[str]:
    figs = ix.section("overlap_backward")
    if not figs:
        return []
    rows = []
    for f in figs:
        p = f["params"]
        if p["overlap_backward"]:
            continue
        on = ix.get(f["id"].removesuffix(".off") + ".on")
        ratio = (on or {}).get("ratios", {}).get(f["id"])
        cnn = p["model"] == "cnn"
        accuracy = [fmt((g or {}).get("extra", {}).get("accuracy_median")) for g in (f, on)] if cnn else ["", ""]
        rows.append(
            [
                p["rate"],
                f"{p['model']}, batch {p['batch_size']}",
                p["wire"],
                f"{'yes' if p['follows_backward'] else 'no'} (largest part {fmt(p['part_bytes'] / 1e6)} MB)",
                "ms a step" if cnn else "samples/s",
                fmt(f["median"]),
                fmt(on["median"]) if on else "—",
                fmt(ratio, "x"),
                " → ".join(accuracy) if cnn else "",
            ]
        )
    cnn_p: dict[str, Any] = next((f["params"] for f in figs if f["params"]["model"] == "cnn"), {})
    big: dict[str, Any] = next((f["params"] for f in figs if f["params"]["model"] != "cnn"), {})
    header = ["link", "model", "wire", "follows backward", "unit", "off", "on", "on ÷ off", "CNN accuracy off → on"]
    return [
        "## Overlap backward: ps-worker --overlap-backward over links of several rates (1 worker, sync, 2 shards on "
        "hosts of their own, tbf)",
        "",
        "Off: --no-overlap-backward (the exchange after backward); on: each shard's push sends its pieces last first, "
        "each once backward has made it. Fresh shards each run, the two settings interleaved. "
        f"{big.get('model', 'The MLP')} for {big.get('steps', '?')} steps (samples/s: above 1x is faster), the CNN "
        f"on digits for {cnn_p.get('epochs', '?')} epochs, tested after each (ms a step, tests included: below 1x is "
        "faster). A push follows backward only where a shard's part is over one message (1 MiB on the wire): "
        "where it is not, the flag changes nothing and about 1.0x is the answer.",
        "",
        *_table(header, rows),
        "",
    ]


def hosts(ix: _Index) -> list[str]:
    figs = ix.section("hosts")
    if not figs:
        return []
    p = figs[0]["params"]
    rows = []
    for name in ("separate", "reduced"):
        size, step = ix.get(f"hosts.bytes.{name}"), ix.get(f"hosts.step.{name}")
        if size is None or step is None:
            continue
        e = size.get("extra", {})
        rows.append(
            [
                "one member a host (--host-reduce)" if name == "reduced" else "2 workers a host (--no-host-reduce)",
                fmt(size["median"]),
                fmt(_median(e.get("sent_mb") or [])),
                fmt(_median(e.get("received_mb") or [])),
                fmt(next(iter(size.get("ratios", {}).values()), None), "x"),
                fmt(step["median"]),
                fmt(next(iter(step.get("ratios", {}).values()), None), "x"),
                fmt(_median(step.get("extra", {}).get("test_accuracy") or [])),
            ]
        )
    header = ["setup", "MB a step a host", "sent", "received", "× separate", "ms a step", "× separate", "accuracy"]
    return [
        f"## Hosts: ps-worker --nproc 2 on each of 2 hosts, {p['rate']} links (tbf), sync, 2 shards",
        "",
        f"{p['model']} on digits, batch {p['batch_size']} a process, {p['steps']} steps; MB: the host link's "
        "token-bucket counters over the run (TCP/IP headers and the first pull included) a step.",
        "",
        *_table(header, rows),
        "",
    ]


_STREAM_READERS = {
    "local": "local disk, prefetch 2",
    "prefetch": "HTTP, prefetch 2",
    "sequential": "HTTP, no prefetch (read a shard, then compute)",
    "slow": "HTTP, prefetch 2",
}


def stream(ix: _Index) -> list[str]:
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
