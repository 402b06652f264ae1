"""Hosts: `ps-worker --nproc 2` on each of 2 hosts, its processes one member of the job (one push per host, the
default) against 2 separate workers (`--no-host-reduce`): the bytes each host's link carries a step, and the step
time.

The lab of the link section (bench/link.py): 2 shards and 2 worker hosts, each worker host's link limited both ways
by a tbf token bucket at `Plan.link_rate`; the bytes are its counters. Sync mode, `Plan.hosts_model` on digits,
batch 64 a process, `Plan.hosts_steps` steps; fresh shards each run, the two setups interleaved.

Needs root (ip netns, tc): elsewhere the section is skipped and says why.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from bench import link
from bench.common import Figure, Processes, log, median
from bench.plan import Plan

SECTION = "hosts"
HOSTS = ("worker-0", "worker-1")
SETUPS = (("reduced", True), ("separate", False))  # (name, --host-reduce)


def _run_once(lab: Any, work: Path, plan: Plan, reduce: bool) -> dict[str, Any]:
    """One sync job: ps-worker --nproc 2 on each worker host; the link's bytes and every process's metrics."""
    try:
        members = len(HOSTS) * (1 if reduce else 2)
        # --workers counts hosts with --host-reduce, processes without (the last --workers given is the one)
        shards = link._start_shards(lab, work, "sync", "--exit-when-done", "--workers", str(members))
        before = {h: lab.link_bytes(h) for h in HOSTS}
        args = [
            "--nproc", "2", "--model", plan.hosts_model, "--batch-size", "64", "--steps", str(plan.hosts_steps),
            "--threads", "1", "--host-reduce" if reduce else "--no-host-reduce",
        ]  # fmt: skip
        launchers = [link.start_worker(lab, h, work, h, *args, "--metrics-out", str(work / f"{h}.json")) for h in HOSTS]
        for h, proc in zip(HOSTS, launchers, strict=True):
            link.finish_worker(proc, work, h)
        after = {h: lab.link_bytes(h) for h in HOSTS}
        for proc in shards:
            proc.wait(timeout=60)
        metrics = [json.loads((work / f"{h}-{i}.json").read_text()) for h in HOSTS for i in range(2)]
        moved = {h: [a - b for a, b in zip(after[h], before[h], strict=True)] for h in HOSTS}
        return {"bytes": moved, "metrics": metrics}
    finally:
        lab.stop_all()


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """The two setups, interleaved, `Plan.train_repeats` times each."""
    fresh = link.lab_for(SECTION)
    if fresh is None:
        return []
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in SETUPS}
    with fresh as lab, tempfile.TemporaryDirectory(prefix="ps-bench-hosts-") as tmp:
        for host in HOSTS:
            lab.limit_bandwidth(host, rate=plan.link_rate, burst="256kb", latency="100ms")
        for _ in range(plan.train_repeats):
            for name, reduce in SETUPS:
                r = _run_once(lab, Path(tmp), plan, reduce)
                runs[name].append(r)
                steps = plan.hosts_steps
                mb = [sum(r["bytes"][h]) / steps / 1e6 for h in HOSTS]
                step_ms = [1e3 * m["seconds"] / max(1, m["steps"]) for m in r["metrics"]]
                log(f"hosts {name}: {median(mb):.2f} MB a step a host, {median(step_ms):.0f} ms a step")
    figures = []
    for name, reduce in SETUPS:
        done = runs[name]
        per_step = [sum(r["bytes"][h]) / plan.hosts_steps / 1e6 for r in done for h in HOSTS]
        params = {"hosts": len(HOSTS), "nproc": 2, "host_reduce": reduce, "rate": plan.link_rate}
        params |= {"model": plan.hosts_model, "steps": plan.hosts_steps, "batch_size": 64, "mode": "sync"}
        base = f"{SECTION}.{{}}.separate"
        figures.append(
            Figure(
                id=f"{SECTION}.bytes.{name}",
                section=SECTION,
                title=f"MB a step on each worker host's link (both ways), 2 hosts x 2 processes, {name}",
                unit="MB",
                repeats=[round(x, 3) for x in per_step],
                params=params,
                compare=[base.format("bytes")] if reduce else [],
                extra={
                    "sent_mb": [round(r["bytes"][h][0] / plan.hosts_steps / 1e6, 3) for r in done for h in HOSTS],
                    "received_mb": [round(r["bytes"][h][1] / plan.hosts_steps / 1e6, 3) for r in done for h in HOSTS],
                },
            )
        )
        figures.append(
            Figure(
                id=f"{SECTION}.step.{name}",
                section=SECTION,
                title=f"ms a step, 2 hosts x 2 processes over {plan.link_rate} links, {name}",
                unit="ms",
                repeats=[round(1e3 * m["seconds"] / max(1, m["steps"]), 2) for r in done for m in r["metrics"]],
                params=params,
                compare=[base.format("step")] if reduce else [],
                extra={"test_accuracy": [round(m["test_accuracy"], 4) for r in done for m in r["metrics"]]},
            )
        )
    return figures
