"""The results as a figure (latest.png): round trips, throughput, training and memory. matplotlib is imported
here only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import report_sparse
from bench.report_base import _PATHS, Doc, _Index, _ok


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
