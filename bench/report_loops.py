"""The report's section on other people's loops (bench/third_party.py): deepctr-torch's fit() through make_sparse and
PSOptimizer against the same fit() locally, in the same run."""

from __future__ import annotations

from typing import Any

from bench.report_base import _Index, _ok, _table, fmt

# Which way each figure's target points: CPU per sample at most, samples/s and AUC at least.
_AT_MOST = {"cpu": True, "rate": False, "auc": False}


def _verdict(kind: str, value: Any, target: float | None) -> str:
    if target is None:
        return ""
    at_most = _AT_MOST[kind]
    unit = "" if kind == "auc" else "x"
    if not _ok(value):
        return f"{'≤' if at_most else '≥'} {target}{unit}"
    met = value <= target if at_most else value >= target
    return f"{'≤' if at_most else '≥'} {target}{unit}: {'met' if met else 'not met'}"


def third_party(ix: _Index) -> list[str]:
    """One row per variant (grouped lookups, prefetching): CPU per sample and samples/s against local, and the held-out
    AUC against local's, each with its target."""
    figs = ix.section("third_party")
    variants = sorted({f["id"].split(".")[2] for f in figs if f["id"].startswith("third_party.deepfm.")})
    if not variants:
        return []
    local = next((f.get("extra", {}).get("local_auc") for f in figs), None)
    rows = []
    for variant in variants:
        row = [variant]
        for kind in ("cpu", "rate", "auc"):
            f = ix.get(f"third_party.deepfm.{variant}.{kind}")
            value = f["median"] if f else None
            row += [
                fmt(value, "" if kind == "auc" else "x"),
                _verdict(kind, value, f["params"].get("target") if f else None),
            ]
        rows.append(row + [fmt(local)])
    p = figs[0]["params"]
    header = ["loop", "CPU per sample ÷ local", "target", "samples/s ÷ local", "target", "AUC - local", "target"]
    return [
        "## Other people's loops: deepctr-torch's fit() through the servers",
        "",
        f"deepctr-torch 0.3.0's DeepFM ({p.get('fields')} fields, the four largest unbounded), trained by its own "
        "fit() through make_sparse + PSOptimizer: 2 workers x 2 shards, sync, one process; against the same fit() "
        "locally "
        f"on the same {p.get('samples')} samples, {p.get('rounds')} interleaved rounds, medians of per-round ratios "
        "(bench/third_party.py).",
        "",
        *_table(header + ["local AUC"], rows),
        "",
    ]
