"""Overlap backward: `ps-worker --overlap-backward` (each shard's push sends its pieces last first, each as soon as
backward has made that layer's gradient, as DDP's buckets do) against `--no-overlap-backward` (the exchange after
backward), over links of several rates.

The lab of the link section (bench/link.py): 2 shards and the worker on hosts of their own, the worker's link
limited both ways by a tbf token bucket, set to each of `Plan.overlap_backward_rates` in turn.

- Training, 1 worker, sync, fresh shards each run, for each of `Plan.overlap_backward_wires`: `Plan.big_model`
  (the 25 M MLP) for `Plan.compress_steps` steps of 128 (samples/s), and the CNN on digits (batch 32,
  `Plan.compress_epochs` epochs, tested after each: ms a step, tests included as in the compress section, and the
  accuracy at the end); each without and with the flag. `Plan.train_repeats` rounds, the two settings side by side
  in each (their order alternating from round to round), so that the machine's drift weighs on both.

A push follows backward only where a shard's part is over one message (1 MiB on the wire): the digits CNN's is not,
so the flag changes nothing for it (about 1.0x is the expected answer there); each figure's params say whether it
applies (`follows_backward`, from the model's placement on 2 shards).

Needs root (ip netns, tc): elsewhere the section is skipped and says why.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench import link
from bench.common import Figure, Processes, log, median
from bench.plan import Plan

SECTION = "overlap_backward"
SETTINGS = (False, True)  # --no-overlap-backward, --overlap-backward
DIGITS = (1, 8, 8), 10  # in_shape and classes of ps-worker's default dataset, which both models train on here


def _flag(on: bool) -> str:
    return "--overlap-backward" if on else "--no-overlap-backward"


def _largest_part(model: str, wire: str) -> int:
    """Bytes on the wire of the largest shard's part of `model` on 2 shards (what PSClient weighs before a push
    follows backward)."""
    import torch

    from paramserver.placement import TensorSpec, place
    from worker.client.binding import tensors_of
    from worker.models.builtin import build_model

    with torch.device("meta"):  # shapes only: no 100 MB of weights in the parent
        module = build_model(model, in_shape=DIGITS[0], num_classes=DIGITS[1])
    names, tensors, buffer = tensors_of(module)
    specs = [TensorSpec(n, tuple(t.shape), b) for n, t, b in zip(names, tensors, buffer, strict=True)]
    placement = place(specs, 2)
    itemsize = 2 if wire == "bf16" else 4
    return max(placement.shard_elements(k) for k in range(2)) * itemsize


def _follows(model: str, wire: str) -> dict[str, Any]:
    from worker.client.transports import INLINE_BYTES

    part = _largest_part(model, wire)
    return {"part_bytes": part, "follows_backward": part > INLINE_BYTES}


def _step_ms(m: dict[str, Any]) -> float:
    return 1e3 * m["seconds"] / max(1, m["steps"])


def _training(lab: Any, work: Path, plan: Plan, rate: str) -> list[Figure]:
    keys = [(w, on) for w in plan.overlap_backward_wires for on in SETTINGS]
    cnn: dict[tuple[str, bool], list[dict[str, Any]]] = {k: [] for k in keys}
    mlp: dict[tuple[str, bool], list[dict[str, Any]]] = {k: [] for k in keys}
    for r in range(plan.train_repeats):
        for wire in plan.overlap_backward_wires:
            order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]  # interleaved, the first of a pair alternating
            mlp_argv = ["--model", plan.big_model, "--batch-size", "128", "--steps", str(plan.compress_steps)]
            for on in order:
                big = link.train_once(lab, work, "sync", *mlp_argv, "--wire-dtype", wire, _flag(on))
                mlp[(wire, on)].append(big)
                log(f"overlap_backward {rate} {wire} {_flag(on)}: {plan.big_model} {big['samples_per_second']:.0f} "
                    "samples/s")  # fmt: skip
            cnn_argv = ["--model", "cnn", "--batch-size", "32", "--epochs", str(plan.compress_epochs)]
            for on in order:
                m = link.train_once(lab, work, "sync", *cnn_argv, "--eval-every-epoch", "--wire-dtype", wire, _flag(on))
                cnn[(wire, on)].append(m)
                log(f"overlap_backward {rate} {wire} {_flag(on)}: cnn {_step_ms(m):.1f} ms a step, accuracy "
                    f"{m['test_accuracy']:.3f}")  # fmt: skip
    figures = []
    for wire, on in keys:
        state = "on" if on else "off"
        base = {"rate": rate, "wire": wire, "overlap_backward": on, "workers": 1, "mode": "sync", "shards": 2}
        sid, sbase = f"{SECTION}.{rate}.sps.mlp.{wire}.{state}", f"{SECTION}.{rate}.sps.mlp.{wire}.off"
        mlp_runs = mlp[(wire, on)]
        figures.append(
            Figure(
                id=sid,
                section=SECTION,
                title=f"{plan.big_model} samples/s over a {rate} link, sync, {wire}, {_flag(on)}",
                unit="samples/s",
                repeats=[round(m["samples_per_second"], 2) for m in mlp_runs],
                params={
                    **base,
                    **_follows(plan.big_model, wire),
                    "model": plan.big_model,
                    "steps": plan.compress_steps,
                    "batch_size": 128,
                },
                compare=[sbase] if on else [],
                extra={"step_ms": [round(_step_ms(m), 2) for m in mlp_runs]},
            )
        )
        cid, cbase = f"{SECTION}.{rate}.step.cnn.{wire}.{state}", f"{SECTION}.{rate}.step.cnn.{wire}.off"
        runs = cnn[(wire, on)]
        accuracy = [round(m["test_accuracy"], 4) for m in runs]
        figures.append(
            Figure(
                id=cid,
                section=SECTION,
                title=f"cnn on digits, ms a step over a {rate} link, sync, {wire}, {_flag(on)}",
                unit="ms",
                repeats=[round(_step_ms(m), 2) for m in runs],
                params={
                    **base,
                    **_follows("cnn", wire),
                    "model": "cnn",
                    "epochs": plan.compress_epochs,
                    "batch_size": 32,
                },
                compare=[cbase] if on else [],
                extra={
                    "test_accuracy": accuracy,
                    "accuracy_median": median(accuracy),
                    "samples_per_second": [round(m["samples_per_second"], 2) for m in runs],
                },
            )
        )
    return figures


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """Training with and without --overlap-backward at every rate of `Plan.overlap_backward_rates`."""
    fresh = link.lab_for(SECTION)
    if fresh is None:
        return []
    figures: list[Figure] = []
    with fresh as lab, tempfile.TemporaryDirectory(prefix="ps-bench-overlap-backward-") as tmp:
        for rate in plan.overlap_backward_rates:
            lab.limit_bandwidth("worker-0", rate=rate, burst="256kb", latency="100ms")
            figures += _training(lab, Path(tmp), plan, rate)
    return figures
