"""Link: training over a bandwidth-limited link, the setting `ps-worker --overlap` is for.

The shards and the worker run on hosts of their own: network namespaces on a bridge (deploy/netns/netlab.py, the
lab of the multi-host tests), with the worker's link limited both ways by a tbf token bucket (`Plan.link_rate`).
One worker trains the CNN on digits against 2 shards in async mode, without and with --overlap; each run gets fresh
shards (started with --exit-when-done, so they end with the run). Needs root (ip netns, tc): elsewhere the section
is skipped and says why.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Figure, Plan, Processes, log, median

SECTION = "link"
MODEL = "cnn"
TIMEOUT = 600.0
ROOT = Path(__file__).resolve().parents[1]
PEERS = "shard-0:50051,shard-1:50051"
SETUPS = (("async", False), ("async", True))


def _netlab() -> Any:
    spec = importlib.util.spec_from_file_location("netlab", ROOT / "deploy" / "netns" / "netlab.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("netlab", module)
    spec.loader.exec_module(module)
    return module


def unavailable() -> str | None:
    """Why this machine cannot run the section, or None."""
    why = _netlab().netns_available()
    if why is None and shutil.which("tc") is None:
        why = "tc (iproute2) is not installed"
    return why


def _wait_ready(proc: subprocess.Popen[bytes], log_file: Path) -> None:
    deadline = time.monotonic() + 90
    while "PARAMSERVER-READY" not in log_file.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"a shard did not start:\n{log_file.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)


def _run_once(lab: Any, work: Path, plan: Plan, mode: str, overlap: bool) -> dict[str, Any]:
    """One training run of one worker against fresh shards; its ps-worker metrics."""
    bin_dir = Path(sys.executable).parent
    env = {"PYTHONUNBUFFERED": "1"}
    shards = []
    for i in range(2):
        argv = [
            str(bin_dir / "ps-server"), "--shard-index", str(i), "--peers", PEERS, "--host", "0.0.0.0",
            "--port", "50051", "--mode", mode, "--workers", "1", "--exit-when-done",
        ]  # fmt: skip
        shards.append(lab.popen(f"shard-{i}", argv, work / f"shard-{i}.log", env=env))
    try:
        for i, proc in enumerate(shards):
            _wait_ready(proc, work / f"shard-{i}.log")
        metrics = work / "worker.json"
        argv = [
            str(bin_dir / "ps-worker"), "--server", "shard-0:50051", "--no-progress", "--model", MODEL,
            "--batch-size", str(plan.link_batch), "--epochs", str(plan.link_epochs), "--metrics-out", str(metrics),
            # The namespaces share one kernel, so shared memory would reach across them: the link is the point.
            "--no-shared-memory", "--overlap" if overlap else "--no-overlap",
        ]  # fmt: skip
        worker = lab.popen("worker-0", argv, work / "worker.log", env=env)
        if worker.wait(timeout=TIMEOUT) != 0:
            raise RuntimeError(f"ps-worker failed:\n{(work / 'worker.log').read_text(errors='replace')[-2000:]}")
        for proc in shards:
            proc.wait(timeout=60)  # --exit-when-done: the shards end with the job
        return json.loads(metrics.read_text())
    finally:
        lab.stop_all()


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """CNN training samples/s over the limited link, async, without and with --overlap."""
    why = unavailable()
    if why is not None:
        log(f"section {SECTION} skipped: {why}")
        return []
    netlab = _netlab()
    netlab.cleanup_stale()
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {s: [] for s in SETUPS}
    with netlab.Lab() as lab, tempfile.TemporaryDirectory(prefix="ps-bench-link-") as tmp:
        lab.limit_bandwidth("worker-0", rate=plan.link_rate, burst="256kb", latency="100ms")
        for _ in range(plan.train_repeats):
            for mode, overlap in SETUPS:  # interleaved, so that the machine's drift weighs on both
                m = _run_once(lab, Path(tmp), plan, mode, overlap)
                runs[(mode, overlap)].append(m)
                log(
                    f"link {plan.link_rate} {mode}{' --overlap' if overlap else ''}: {m['samples_per_second']:.0f} "
                    f"samples/s, accuracy {m['test_accuracy']:.3f}"
                )
    figures = []
    for (mode, overlap), done in runs.items():
        who = f"w1.{mode}{'+overlap' if overlap else ''}"
        figures.append(
            Figure(
                id=f"{SECTION}.sps.{MODEL}.{who}",
                section=SECTION,
                title=f"training samples/s, {MODEL} on digits over a {plan.link_rate} link, 1 worker, {mode}"
                + (", --overlap" if overlap else ""),
                unit="samples/s",
                repeats=[round(m["samples_per_second"], 2) for m in done],
                params={
                    "model": MODEL,
                    "dataset": "digits",
                    "workers": 1,
                    "mode": mode,
                    "overlap": overlap,
                    "shards": 2,
                    "rate": plan.link_rate,
                    "batch_size": plan.link_batch,
                    "epochs": plan.link_epochs,
                },
                compare=[f"{SECTION}.sps.{MODEL}.w1.{mode}"] if overlap else [],
                extra={
                    "test_accuracy": [round(m["test_accuracy"], 4) for m in done],
                    "seconds": [round(m["seconds"], 3) for m in done],
                    "accuracy_median": median([m["test_accuracy"] for m in done]),
                },
            )
        )
    return figures
