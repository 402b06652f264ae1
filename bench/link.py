"""Link: a worker whose link, not its cores, is the limit: what pushes in turn and `ps-worker --overlap` are for.

The shards and the worker run on hosts of their own: network namespaces on a bridge (deploy/netns/netlab.py, the
lab of the multi-host tests), with the worker's link limited both ways by a tbf token bucket (`Plan.link_rate`).

- Exchange: one worker's push_pull of a dense model (`Plan.link_payload`) against 2 shards, its pushes to the data
  sockets in turn and at once, float32 and bf16 (`python bench/link.py exchange ...` runs in the worker's host);
  against gloo's all_reduce of the same tensor between two such workers (both links limited alike: what DDP pays
  per step there; `python bench/link.py gloo ...`).
- Training: one worker trains the CNN on digits against 2 shards in async mode, without and with --overlap; each
  run gets fresh shards (started with --exit-when-done, so they end with the run).

Needs root (ip netns, tc): elsewhere the section is skipped and says why.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Figure, Processes, log, median
from bench.plan import Plan

SECTION = "link"
MODEL = "cnn"
TIMEOUT = 600.0
ROOT = Path(__file__).resolve().parents[1]
PEERS = "shard-0:50051,shard-1:50051"
SETUPS = (("async", False), ("async", True))
WIRES = (("float32", False), ("float32", True), ("bf16", False), ("bf16", True))  # (wire dtype, in turn)


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


def _start_shards(lab: Any, work: Path, mode: str, *extra: str) -> list[subprocess.Popen[bytes]]:
    bin_dir = Path(sys.executable).parent
    shards = []
    for i in range(2):
        argv = [
            str(bin_dir / "ps-server"), "--shard-index", str(i), "--peers", PEERS, "--host", "0.0.0.0",
            "--port", "50051", "--mode", mode, "--workers", "1", *extra,
        ]  # fmt: skip
        shards.append(lab.popen(f"shard-{i}", argv, work / f"shard-{i}.log", env={"PYTHONUNBUFFERED": "1"}))
    for i, proc in enumerate(shards):
        _wait_ready(proc, work / f"shard-{i}.log")
    return shards


def lab_for(section: str) -> Any | None:
    """A fresh lab for a section (the namespaces of dead runs removed first), or None where this machine cannot run
    one (the log says why)."""
    why = unavailable()
    if why is not None:
        log(f"section {section} skipped: {why}")
        return None
    netlab = _netlab()
    netlab.cleanup_stale()
    return netlab.Lab()


def start_worker(lab: Any, host: str, work: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    """ps-worker in `host` against the lab's shards, its output in work/<name>.log. No shared memory: the namespaces
    share one kernel, so it would reach across them, and the link is the point."""
    argv = [
        str(Path(sys.executable).parent / "ps-worker"), "--server", "shard-0:50051", "--no-progress",
        "--no-shared-memory", *args,
    ]  # fmt: skip
    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}  # PYTHONPATH: bench.models' factories
    return lab.popen(host, argv, work / f"{name}.log", env=env)


def finish_worker(proc: subprocess.Popen[bytes], work: Path, name: str) -> None:
    """Wait for a ps-worker start_worker started; RuntimeError with its log's tail unless it succeeded."""
    if proc.wait(timeout=TIMEOUT) != 0:
        raise RuntimeError(f"ps-worker {name} failed:\n{(work / f'{name}.log').read_text(errors='replace')[-2000:]}")


def _exchange_once(lab: Any, work: Path, plan: Plan, wire: str, in_turn: bool, compress: str = "") -> list[float]:
    """Milliseconds of each timed push_pull of one worker process in the worker's host."""
    argv = [
        sys.executable, str(Path(__file__).resolve()), "exchange", "--numel", str(plan.link_payload),
        "--repeats", str(plan.repeats), "--dtype", wire, "--push-in-turn", "on" if in_turn else "off",
        *(["--compress", compress] if compress else []),
    ]  # fmt: skip
    out = work / "exchange.log"
    proc = lab.popen("worker-0", argv, out, env={"PYTHONPATH": str(ROOT)})
    if proc.wait(timeout=TIMEOUT) != 0:
        raise RuntimeError(f"the exchange worker failed:\n{out.read_text(errors='replace')[-2000:]}")
    return json.loads(out.read_text().strip().splitlines()[-1])["ms"]


def _gloo_once(lab: Any, work: Path, plan: Plan) -> list[float]:
    """Milliseconds of each timed all_reduce of rank 0, ranks in worker-0 and worker-1."""
    procs = []
    for rank in (0, 1):
        argv = [
            sys.executable, str(Path(__file__).resolve()), "gloo", "--rank", str(rank), "--numel",
            str(plan.link_payload), "--repeats", str(plan.repeats),
        ]  # fmt: skip
        env = {"PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth0"}  # the lab's link, not loopback
        procs.append(lab.popen(f"worker-{rank}", argv, work / f"gloo-{rank}.log", env=env))
    for rank, proc in enumerate(procs):
        if proc.wait(timeout=TIMEOUT) != 0:
            raise RuntimeError(f"gloo rank {rank} failed:\n{(work / f'gloo-{rank}.log').read_text()[-2000:]}")
    return json.loads((work / "gloo-0.log").read_text().strip().splitlines()[-1])["ms"]


def gloo_figure(fid: str, section: str, label: str, rate: str, gloo: list[float], **params: Any) -> Figure:
    """The figure of gloo's all_reduce of `label` (ms, each repeat) between 2 workers on `rate` links."""
    log(f"{section} {rate} gloo all_reduce {label}: {median(gloo):.1f} ms")
    return Figure(
        id=fid,
        section=section,
        title=f"gloo all_reduce of {label} float32 between 2 workers, each on a {rate} link",
        unit="ms",
        repeats=[round(x, 2) for x in gloo],
        params={"payload": label, "rate": rate, "workers": 2, **params},
        warmup=1,
    )


def _exchange_figures(lab: Any, work: Path, plan: Plan) -> list[Figure]:
    """The push_pull of `Plan.link_payload` parameters over the link, in turn and at once, and gloo's all_reduce of
    the same bytes (interleaved)."""
    times: dict[tuple[str, bool], list[float]] = {w: [] for w in WIRES}
    gloo: list[float] = []
    _start_shards(lab, work, "sync", "--optimizer", "sgd")
    try:
        for _ in range(plan.train_repeats):
            gloo += _gloo_once(lab, work, plan)
            for wire, in_turn in WIRES:
                times[(wire, in_turn)] += _exchange_once(lab, work, plan, wire, in_turn)
    finally:
        lab.stop_all()
    label = f"{plan.link_payload * 4 / 1e6:g}MB"
    gloo_id = f"{SECTION}.gloo.{label}"
    figures = [gloo_figure(gloo_id, SECTION, label, plan.link_rate, gloo)]
    for (wire, in_turn), ms in times.items():
        way = "in-turn" if in_turn else "at-once"
        log(f"link {plan.link_rate} push_pull {label} {wire}, pushes {way}: {median(ms):.1f} ms")
        figures.append(
            Figure(
                id=f"{SECTION}.step.{label}.s2.w1.{wire}.{way}",
                section=SECTION,
                title=f"push_pull of {label} over a {plan.link_rate} link, 2 shards, 1 worker, {wire}, pushes {way}",
                unit="ms",
                repeats=[round(x, 2) for x in ms],
                params={"payload": label, "wire": wire, "in_turn": in_turn, "rate": plan.link_rate, "shards": 2},
                warmup=1,
                compare=[gloo_id, *([f"{SECTION}.step.{label}.s2.w1.{wire}.at-once"] if in_turn else [])],
            )
        )
    return figures


def train_once(lab: Any, work: Path, mode: str, *args: str) -> dict[str, Any]:
    """One ps-worker run (`args`) in worker-0 against fresh shards of a 1-worker `mode` job; its metrics."""
    try:
        shards = _start_shards(lab, work, mode, "--exit-when-done")
        metrics = work / "worker.json"
        finish_worker(
            start_worker(lab, "worker-0", work, "worker", "--metrics-out", str(metrics), *args), work, "worker"
        )
        for proc in shards:
            proc.wait(timeout=60)  # --exit-when-done: the shards end with the job
        return json.loads(metrics.read_text())
    finally:
        lab.stop_all()


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """push_pull over the limited link in turn and at once; CNN training over it, async, without and with
    --overlap."""
    fresh = lab_for(SECTION)
    if fresh is None:
        return []
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {s: [] for s in SETUPS}
    with fresh as lab, tempfile.TemporaryDirectory(prefix="ps-bench-link-") as tmp:
        for host in ("worker-0", "worker-1"):  # worker-1 runs only gloo's second rank
            lab.limit_bandwidth(host, rate=plan.link_rate, burst="256kb", latency="100ms")
        figures = _exchange_figures(lab, Path(tmp), plan)
        for _ in range(plan.train_repeats):
            for mode, overlap in SETUPS:  # interleaved, so that the machine's drift weighs on both
                m = train_once(
                    lab, Path(tmp), mode, "--model", MODEL, "--batch-size", str(plan.link_batch),
                    "--epochs", str(plan.link_epochs), "--overlap" if overlap else "--no-overlap",
                )  # fmt: skip
                runs[(mode, overlap)].append(m)
                log(
                    f"link {plan.link_rate} {mode}{' --overlap' if overlap else ''}: {m['samples_per_second']:.0f} "
                    f"samples/s, accuracy {m['test_accuracy']:.3f}"
                )
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


# -- the worker's side of the exchange figures: runs in the worker's host ---------------------------------------------


def _exchange_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/link.py exchange")
    parser.add_argument("--address", default="shard-0:50051")
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--push-in-turn", choices=("on", "off"), required=True)
    parser.add_argument("--compress", default=None)
    args = parser.parse_args(argv)
    import torch

    from bench.transport import dense_tensors
    from worker import PSClient

    torch.set_num_threads(1)
    # Weight matrices as near-square as their size allows (what PowerSGD factors), gradients of mixed magnitudes
    # (what top-k chooses among).
    model = {name: torch.randn(_matrix(n)) for name, n in dense_tensors(args.numel)}
    grads = {name: torch.randn_like(t).mul_(1e-3) for name, t in model.items()}
    with PSClient(
        args.address,
        dtype=args.dtype,
        shared_memory=False,
        push_in_turn=args.push_in_turn == "on",
        compress=args.compress,
    ) as c:
        c.register(model)
        ms = []
        for i in range(1 + args.repeats):  # the first one is a warm-up
            t0 = time.perf_counter()
            c.push_pull(grads)
            if i:
                ms.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"ms": ms}), flush=True)
    return 0


def _matrix(n: int) -> tuple[int, int]:
    """The most nearly square (rows, cols) of n elements."""
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    return rows, n // rows


def _gloo_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/link.py gloo")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", default="worker-0:29500")
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    args = parser.parse_args(argv)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=2, timeout=timedelta(seconds=TIMEOUT)
    )
    try:
        t = torch.full((args.numel,), 0.5)
        ms = []
        for i in range(1 + args.repeats):  # the first one is a warm-up
            dist.barrier()  # both ranks start each all_reduce together
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if i:
                ms.append((time.perf_counter() - t0) * 1e3)
            t.mul_(0.5)
    finally:
        dist.destroy_process_group()
    print(json.dumps({"ms": ms}), flush=True)
    return 0


if __name__ == "__main__":
    roles = {"exchange": _exchange_main, "gloo": _gloo_main}
    if sys.argv[1:2] == [] or sys.argv[1] not in roles:
        sys.exit("usage: python bench/link.py exchange|gloo ... (run by the link section, in the lab's hosts)")
    sys.exit(roles[sys.argv[1]](sys.argv[2:]))
