"""The benchmark summary of docs/performance.md: a few lines per section, written between markers by `make bench`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.report import Doc

from bench import report_links, report_sparse
from bench.report_base import Doc, _Index, _ok, _table, fmt

README_BEGIN = "<!-- bench:summary:begin (written by `make bench` from bench/results/latest.json) -->"
README_END = "<!-- bench:summary:end -->"


# The paths the summary names: same host, another host (the default, then without a data socket).
_SUMMARY_PATHS = (
    ("shm", "shared memory"),
    ("socket", "data socket"),
    ("float32", "gRPC"),
    ("socket-bf16", "data socket, bf16 wire"),
    ("bf16", "gRPC, bf16 wire"),
)


def summary(doc: Doc) -> str:
    """The summary table: each performance target against the figure of this run that answers it."""
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
            what = (
                f"{p['payload']} push + pull, 1 shard, {report_links._REPLICATION_PATHS.get(p['wire'], p['wire'])}{wal}"
            )
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
    """Replace the summary between the page's markers; return False when the markers are missing."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(head + README_BEGIN + "\n" + summary(doc) + README_END + tail)
    return True
