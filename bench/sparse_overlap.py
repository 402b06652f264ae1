"""Sparse tables, async with overlap: one worker whose exchanges run while its next step computes, against the same
step done locally.

The worker and the local process are bench.sparse's (the same model, batches and warm-up). The servers run an
async job of 2 shards; the worker wraps its model in `worker.Overlap` and prefetches two batches ahead, so each
step's exchange (its rows' gradients out, the rows of the batch after next back) runs on a thread of its own while
the next forward and backward run. A step's time is from its forward pass to the return of `Overlap.step()`, which
waits for the exchange before it, so samples/s is the batch over the median step. Rounds alternate, some local
steps then as many PS steps; the figure's repeats are each round's local median step over its PS median step: the
worker's samples/s ÷ the local process's (target: at least 1.0). CPU: the worker and both shards over the round's
PS steps, against the local process's over its steps.
"""

from __future__ import annotations

from typing import Any

from bench.common import Child, Figure, Processes, log, median
from bench.plan import Plan

SHARDS = 2
TARGET = 1.0  # the overlapped worker's samples/s ÷ the local process's


def run(plan: Plan, procs: Processes, local: Child, worker: Child) -> list[Figure]:
    """For each row width and the shm and socket paths: rounds of local steps and overlapped PS steps in turn."""
    from bench.sparse import LR, PATHS, SECTION, TIMEOUT, paired_round
    from paramserver import ServerConfig

    figures: list[Figure] = []
    for dim in plan.sparse_dims:  # a cluster per width: each holds one model
        cluster = procs.cluster(ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=LR), SHARDS)
        procs.settle()
        try:
            for wire in [w for w in ("shm", "socket") if w in plan.sparse_wires]:
                worker.send(op="open", address=cluster.address, wire=wire, dim=dim, overlap=True)
                worker.expect("ready", TIMEOUT)
                ratios, cpu, ps_steps, local_steps = [], [], [], []
                pids = [p.pid for p in cluster.procs]
                n = plan.sparse_steps
                for _ in range(plan.sparse_rounds):
                    lt, local_cpu, st, r, shards_cpu = paired_round(local, worker, pids, dim, n)
                    ratios.append(median(lt) / median(st))
                    cpu.append((r["cpu"] + shards_cpu) / local_cpu)
                    ps_steps += st
                    local_steps += lt
                worker.send(op="close")
                worker.expect("closed", TIMEOUT)
                figures.append(_figure(plan, SECTION, PATHS, dim, wire, ratios, cpu, ps_steps, local_steps))
                log(
                    f"sparse async+overlap d{dim}, {SHARDS} shards, {wire}: {median(ps_steps) * 1e3:.2f} ms a step "
                    f"against local {median(local_steps) * 1e3:.2f} ms = {median(ratios):.2f}x the local samples/s; "
                    f"CPU {median(cpu):.2f}x"
                )
        finally:
            procs.stop_soon(cluster)
    return figures


def _figure(
    plan: Plan,
    section: str,
    paths: dict[str, str],
    dim: int,
    wire: str,
    ratios: list[float],
    cpu: list[float],
    ps_steps: list[float],
    local_steps: list[float],
) -> Figure:
    params: dict[str, Any] = {
        "dim": dim,
        "shards": SHARDS,
        "workers": 1,
        "wire": wire,
        "mode": "async",
        "overlap": True,
        "optimizer": "adagrad",
        "target": TARGET,
        "baseline": f"{section}.local.d{dim}",
    }
    return Figure(
        id=f"{section}.overlap.{wire}.s{SHARDS}.d{dim}",
        section=section,
        title=f"async + overlap: one worker's samples/s ÷ the local process's, dim {dim}, {SHARDS} shards, "
        f"{paths[wire]}; per round",
        unit="x",
        repeats=[round(r, 4) for r in ratios],
        params=params,
        warmup=plan.sparse_batches,
        extra={
            "step_ms": round(median(ps_steps) * 1e3, 4),
            "local_ms": round(median(local_steps) * 1e3, 4),
            "cpu_ratio": round(median(cpu), 4),
        },
    )
