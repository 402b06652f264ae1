"""Compress: `ps-worker --compress` over links of several rates, against whole pushes in float32 and bf16 and
against gloo's all_reduce (what DDP pays there).

The lab of the link section (bench/link.py): 2 shards and the workers on hosts of their own, the workers' links
limited both ways by a tbf token bucket, set to each of `Plan.compress_rates` in turn.

- Exchange: one worker's push_pull of `Plan.link_payload` parameters as 4 square weight matrices (random
  gradients), pushes in turn, for each of WIRES; gloo's all_reduce of the same bytes between two workers.
  Interleaved, `Plan.train_repeats` rounds.
- Training, at `Plan.compress_train_rates`: the CNN on digits (1 worker, sync, batch 32, tested after every
  epoch: the time to `Plan.tta_target`, and the accuracy at the end), and `Plan.big_model` (the 25 M MLP) for
  `Plan.compress_steps` steps of 128 (samples/s), for each of TRAIN_WIRES; fresh shards for each run. The CNN
  runs keep --compress's warm-up (whole pushes first, part of the time to the target); the exchanges and the MLP's
  samples/s are compressed from the first step (`:warmup=0`).

Needs root (ip netns, tc): elsewhere the section is skipped and says why.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench import link
from bench.common import Figure, Processes, log, median
from bench.plan import Plan

SECTION = "compress"
# (wire dtype, --compress): whole pushes first, the baselines of the compressed ones.
WIRES = (("float32", ""), ("bf16", ""), ("bf16", "topk:0.01"), ("bf16", "powersgd:4"), ("float32", "topk:0.01"))
TRAIN_WIRES = (("bf16", ""), ("bf16", "topk:0.01"), ("bf16", "powersgd:4"))


def _name(wire: str, compress: str) -> str:
    return f"{wire}.{compress.replace(':', '') or 'whole'}"


def _exchanges(lab: Any, work: Path, plan: Plan, rate: str) -> list[Figure]:
    times: dict[tuple[str, str], list[float]] = {w: [] for w in WIRES}
    gloo: list[float] = []
    link._start_shards(lab, work, "sync", "--optimizer", "sgd")
    try:
        for _ in range(plan.train_repeats):
            gloo += link._gloo_once(lab, work, plan)
            for wire, compress in WIRES:
                # Timed push_pulls from the first: the compressed ones, without --compress's warm-up.
                scheme = f"{compress}:warmup=0" if compress else ""
                times[(wire, compress)] += link._exchange_once(lab, work, plan, wire, True, scheme)
    finally:
        lab.stop_all()
    label = f"{plan.link_payload * 4 / 1e6:g}MB"
    gloo_id = f"{SECTION}.{rate}.gloo"
    whole_bf16 = f"{SECTION}.{rate}.step.{_name('bf16', '')}"
    figures = [link.gloo_figure(gloo_id, SECTION, label, rate, gloo, wire="float32", compress="")]
    for (wire, compress), ms in times.items():
        fid = f"{SECTION}.{rate}.step.{_name(wire, compress)}"
        log(f"compress {rate} push_pull {label} {wire} {compress or 'whole'}: {median(ms):.1f} ms")
        figures.append(
            Figure(
                id=fid,
                section=SECTION,
                title=f"push_pull of {label} over a {rate} link, 2 shards, 1 worker, {wire}, {compress or 'whole'}",
                unit="ms",
                repeats=[round(x, 2) for x in ms],
                params={"payload": label, "wire": wire, "compress": compress, "rate": rate, "shards": 2},
                warmup=1,
                compare=[gloo_id, *([whole_bf16] if fid != whole_bf16 else [])],
            )
        )
    return figures


def _reached(m: dict[str, Any], target: float) -> float:
    """Seconds into the run of the first test at or over the target (NaN if none was)."""
    return next((e["seconds"] for e in m["eval_history"] if e.get("test_accuracy", 0) >= target), float("nan"))


def _training(lab: Any, work: Path, plan: Plan, rate: str) -> list[Figure]:
    cnn: dict[tuple[str, str], list[dict[str, Any]]] = {w: [] for w in TRAIN_WIRES}
    mlp: dict[tuple[str, str], list[dict[str, Any]]] = {w: [] for w in TRAIN_WIRES}
    for _ in range(plan.train_repeats):
        for wire, compress in TRAIN_WIRES:  # interleaved
            flags = ["--wire-dtype", wire, *(["--compress", compress] if compress else [])]
            cnn_argv = ["--model", "cnn", "--batch-size", "32", "--epochs", str(plan.compress_epochs)]
            m = link.train_once(lab, work, "sync", *cnn_argv, "--eval-every-epoch", *flags)
            cnn[(wire, compress)].append(m)
            mlp_argv = ["--model", plan.big_model, "--batch-size", "128", "--steps", str(plan.compress_steps)]
            steady = ["--compress", f"{compress}:warmup=0"] if compress else []  # samples/s compressed throughout
            big = link.train_once(lab, work, "sync", *mlp_argv, "--wire-dtype", wire, *steady)
            mlp[(wire, compress)].append(big)
            log(
                f"compress {rate} {wire} {compress or 'whole'}: cnn {_reached(m, plan.tta_target):.1f} s to "
                f"{plan.tta_target}, accuracy {m['test_accuracy']:.3f}; {plan.big_model} "
                f"{big['samples_per_second']:.0f} samples/s"
            )
    figures = []
    base_cnn, base_mlp = f"{SECTION}.{rate}.tta.{_name('bf16', '')}", f"{SECTION}.{rate}.sps.{_name('bf16', '')}"
    for (wire, compress), runs in cnn.items():
        fid = f"{SECTION}.{rate}.tta.{_name(wire, compress)}"
        params = {"rate": rate, "wire": wire, "compress": compress, "workers": 1, "mode": "sync", "shards": 2}
        figures.append(
            Figure(
                id=fid,
                section=SECTION,
                title=f"cnn on digits to {plan.tta_target} over a {rate} link, {wire}, {compress or 'whole'}",
                unit="s",
                repeats=[round(_reached(m, plan.tta_target), 2) for m in runs],
                params={**params, "model": "cnn", "epochs": plan.compress_epochs, "batch_size": 32},
                compare=[base_cnn] if fid != base_cnn else [],
                extra={
                    "test_accuracy": [round(m["test_accuracy"], 4) for m in runs],
                    "step_ms": [round(1e3 * m["seconds"] / max(1, m["steps"]), 2) for m in runs],
                },
            )
        )
        big = mlp[(wire, compress)]
        sid = f"{SECTION}.{rate}.sps.{_name(wire, compress)}"
        figures.append(
            Figure(
                id=sid,
                section=SECTION,
                title=f"{plan.big_model} samples/s over a {rate} link, {wire}, {compress or 'whole'}",
                unit="samples/s",
                repeats=[round(m["samples_per_second"], 2) for m in big],
                params={**params, "model": plan.big_model, "steps": plan.compress_steps, "batch_size": 128},
                compare=[base_mlp] if sid != base_mlp else [],
            )
        )
    return figures


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """The exchange at every rate of `Plan.compress_rates`; training at `Plan.compress_train_rates`."""
    fresh = link.lab_for(SECTION)
    if fresh is None:
        return []
    figures: list[Figure] = []
    with fresh as lab, tempfile.TemporaryDirectory(prefix="ps-bench-compress-") as tmp:
        for rate in plan.compress_rates:
            for host in ("worker-0", "worker-1"):  # worker-1 runs only gloo's second rank
                lab.limit_bandwidth(host, rate=rate, burst="256kb", latency="100ms")
            figures += _exchanges(lab, Path(tmp), plan, rate)
            if rate in plan.compress_train_rates:
                figures += _training(lab, Path(tmp), plan, rate)
    return figures
