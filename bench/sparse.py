"""Sparse tables: a training step on a batch of 4,096 Zipf IDs through the shards, against the same step done locally.

Every figure is a ratio against a baseline measured in the same run, the two measured in turn:

- Step (per shard: 1 shard; end to end: 2 shards), for each row width and path: a worker process (1 torch thread)
  trains a model of one `SparseEmbedding(dim, num_embeddings=1M, optimizer="adagrad")` and a one-element dense
  parameter. A step is the forward pass (torch.unique of the batch; its rows came with the last push_pull, as the
  table was told to `prefetch` the batch), loss = the output's sum, backward, `client.push_pull(model)` (the dense
  gradient and the touched rows' summed gradients, and the next batch's rows, one exchange per shard). The
  baseline, in a process of its own (1 torch thread), is the same step with `nn.Embedding(1M, dim, sparse=True)`
  and `torch.optim.Adagrad`. Both sides cycle through the same pre-drawn batches (numpy's Zipf(1.1) mod 1M: about
  2,400 unique IDs of 4,096) after one warm-up pass over them, so every row the timed steps touch already exists
  on the shards. Rounds alternate: some local steps, then as many PS steps; the ratio figure's repeats are each
  round's median PS step over that round's median local step. CPU: over each round's PS steps, the worker's own
  process_time and every shard process's (bench.common.cpu_seconds), against the local process's over its steps.
  Paths: "shm" (shared memory, the default on the shards' host), "socket" (the data socket, the default from
  another host, here over loopback), "grpc" (`data_socket=False`).
- Throughput: one shard (async mode, so no worker waits for a round) and 4 worker processes each doing that step
  as fast as it can for a window; IDs/s = every worker's IDs over the window, against the local step's rate (4,096
  IDs over the local step time, 1 thread), measured between the windows. 5 processes share the machine's cores.
- Memory: a `RowTable` filled with a small and a large number of rows (bench.sparse_memory).
"""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any

from bench import sparse_memory, sparse_overlap
from bench.common import Channel, Child, Figure, Processes, cpu_seconds, log, median, ms
from bench.plan import Plan
from bench.sparse_memory import BATCH, zipf_ids

SECTION = "sparse"
TIMEOUT = 600.0
ROWS = 1_000_000  # the step's table: IDs 0..ROWS-1
LR = 0.01
MEMORY_DIM = 64  # the throughput case's row width (and the memory case's, bench.sparse_memory)
PATHS = {"shm": "shared memory", "socket": "data socket", "grpc": "gRPC"}
TARGET_STEP = 1.2  # PS step / local step, on the shm and socket paths
TARGET_CPU = 1.3  # CPU of the worker and its shards per step / the local process's


def _batches(count: int, seed: int) -> list[Any]:
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    return [torch.from_numpy(zipf_ids(rng, ROWS)) for _ in range(count)]


# -- the local baseline process ---------------------------------------------------------------------------------


def _local(chan: Channel, params: dict[str, Any]) -> None:
    """nn.Embedding(sparse=True) + torch.optim.Adagrad on the batches; `n` timed steps per message."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Adagrad's sparse branch warns once that torch skips its checks of the sparse tensors it makes.
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    batches = _batches(params["batches"], params["seed"])
    state: dict[str, Any] = {"dim": None}
    i = 0
    while True:
        job = chan.recv()
        dim = job["dim"]
        if state["dim"] != dim:
            state.clear()
            gc.collect()
            emb = nn.Embedding(ROWS, dim, sparse=True)
            state.update(dim=dim, emb=emb, opt=torch.optim.Adagrad(emb.parameters(), lr=LR))
            for b in batches:  # warm-up: one pass, as the workers do
                _local_step(state["emb"], state["opt"], b)
        times = []
        cpu = time.process_time()
        for _ in range(job["n"]):
            b = batches[i % len(batches)]
            i += 1
            t0 = time.perf_counter()
            _local_step(state["emb"], state["opt"], b)
            times.append(time.perf_counter() - t0)
        chan.send("result", times=times, cpu=time.process_time() - cpu)


def _local_step(emb: Any, opt: Any, ids: Any) -> None:
    loss = emb(ids).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


# -- the worker process -----------------------------------------------------------------------------------------


def _worker(chan: Channel, params: dict[str, Any]) -> None:
    """One PSClient at a time ('open' registers and warms up; 'close' leaves); 'steps' times `n` steps, phase by
    phase; 'run' steps for `seconds` and counts them."""
    import torch
    from torch import nn

    from worker import Overlap, PSClient, SparseEmbedding

    torch.set_num_threads(1)
    torch.manual_seed(0)
    batches = _batches(params["batches"], params["seed"])

    class Model(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.table = SparseEmbedding(dim, num_embeddings=ROWS, optimizer="adagrad")
            self.bias = nn.Parameter(torch.zeros(1))  # a push always carries a dense gradient

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.table(ids).sum() + self.bias[0]

    client: PSClient | None = None
    model: Model | None = None
    overlap: Overlap[int] | None = None
    i = 0

    def step() -> tuple[float, float, float, float]:
        nonlocal i
        assert client is not None and model is not None
        b = batches[i % len(batches)]
        i += 1
        t0 = time.perf_counter()
        loss = model(b)  # torch.unique; the rows came with the last push_pull (prefetch)
        t1 = time.perf_counter()
        model.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        if overlap is None:
            model.table.prefetch(batches[i % len(batches)])  # the next batch's rows ride this push_pull
            client.push_pull(model)
        else:  # this exchange runs while the next step computes: it brings the batch after next's rows
            model.table.prefetch(batches[(i + 1) % len(batches)])
            overlap.step()
        t3 = time.perf_counter()
        return t0, t1, t2, t3

    try:
        while True:
            job = chan.recv()
            op = job["op"]
            if op == "open":
                wire = job["wire"]
                model = Model(job["dim"])
                client = PSClient(job["address"], shared_memory=wire == "shm", data_socket=wire != "grpc")
                client.register(model)
                overlap = Overlap(model, client.push_pull) if job.get("overlap") else None
                transports = sorted({type(link.transport).__name__ for link in client.links})
                for _ in range(len(batches)):  # warm-up: every row of the batches made on the shards
                    step()
                chan.send("ready", transports=transports)
            elif op == "steps":
                forward, backward, push_pull = [], [], []
                cpu = time.process_time()  # every thread of the worker: the client's fan-out too
                for _ in range(job["n"]):
                    t0, t1, t2, t3 = step()
                    forward.append(t1 - t0)
                    backward.append(t2 - t1)
                    push_pull.append(t3 - t2)
                cpu = time.process_time() - cpu
                chan.send("result", forward=forward, backward=backward, push_pull=push_pull, cpu=cpu)
            elif op == "run":
                steps, began = 0, time.time()
                deadline = time.perf_counter() + job["seconds"]
                while time.perf_counter() < deadline:
                    step()
                    steps += 1
                chan.send("result", steps=steps, began=began, ended=time.time())
            elif op == "close":
                if overlap is not None:
                    overlap.finish()
                    overlap.close()
                if client is not None:
                    client.close()
                client, model, overlap = None, None, None
                chan.send("closed")
    finally:
        if overlap is not None:
            overlap.close()
        if client is not None:
            client.close()


ROLES = {"local": _local, "worker": _worker}


# -- the parent -------------------------------------------------------------------------------------------------


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """The step cases, the throughput under 4 workers, then the RowTable's memory and its time against its size."""
    local = procs.child(SECTION, "local", {"batches": plan.sparse_batches, "seed": 0}, name="sparse-local")
    worker = procs.child(SECTION, "worker", {"batches": plan.sparse_batches, "seed": 0}, name="sparse-worker")
    figures: list[Figure] = []
    for dim in plan.sparse_dims:
        local_times: list[float] = []
        for shards in plan.sparse_shards:
            figures += _step_case(plan, procs, local, worker, dim, shards, local_times)
        figures.append(
            Figure(
                id=f"{SECTION}.local.d{dim}",
                section=SECTION,
                title=f"local step: nn.Embedding(1M, {dim}, sparse=True) + Adagrad, {BATCH} Zipf IDs, 1 thread",
                unit="ms",
                repeats=ms(local_times),
                params={"dim": dim, "batch": BATCH, "rows": ROWS, "threads": 1, "optimizer": "adagrad"},
                warmup=plan.sparse_batches,
            )
        )
    figures += sparse_overlap.run(plan, procs, local, worker)
    procs.close_children([worker])
    figures += _throughput(plan, procs, local)
    procs.close_children([local])
    figures += sparse_memory.run(plan, procs)
    return figures


def local_round(local: Child, dim: int, n: int) -> tuple[list[float], float]:
    """`n` local steps: their times, and the CPU seconds they took."""
    local.send(dim=dim, n=n)
    got = local.expect("result", TIMEOUT)
    return got["times"], got["cpu"]


def paired_round(
    local: Child, worker: Child, pids: list[int], dim: int, n: int
) -> tuple[list[float], float, list[float], dict[str, Any], float]:
    """`n` local steps, then `n` PS steps: the local times and CPU seconds, each PS step's time (forward to the
    end of its exchange), the worker's result and the CPU seconds of the shard processes `pids`."""
    lt, local_cpu = local_round(local, dim, n)
    before = cpu_seconds(pids)
    worker.send(op="steps", n=n)
    r = worker.expect("result", TIMEOUT)
    shards_cpu = cpu_seconds(pids) - before
    steps = [a + b + c for a, b, c in zip(r["forward"], r["backward"], r["push_pull"], strict=True)]
    return lt, local_cpu, steps, r, shards_cpu


def _step_case(
    plan: Plan, procs: Processes, local: Child, worker: Child, dim: int, shards: int, local_all: list[float]
) -> list[Figure]:
    """One cluster of `shards` shards; each path in turn, its PS steps in rounds alternating with local steps."""
    from paramserver import ServerConfig

    cluster = procs.cluster(ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=LR), shards)
    procs.settle()
    figures = []
    try:
        for wire in plan.sparse_wires:
            worker.send(op="open", address=cluster.address, wire=wire, dim=dim)
            ready = worker.expect("ready", TIMEOUT)
            ps: list[float] = []
            phases: dict[str, list[float]] = {"forward": [], "backward": [], "push_pull": []}
            local_here: list[float] = []
            ratios = []
            cpu: dict[str, list[float]] = {"ratio": [], "worker": [], "shards": [], "local": []}
            pids = [p.pid for p in cluster.procs]
            n = plan.sparse_steps
            for _ in range(plan.sparse_rounds):
                lt, local_cpu, st, r, shards_cpu = paired_round(local, worker, pids, dim, n)
                for key in phases:
                    phases[key] += r[key]
                ps += st
                local_here += lt
                ratios.append(median(st) / median(lt))
                # CPU of the whole job (the worker and every shard) per step against the local process's.
                cpu["ratio"].append((r["cpu"] + shards_cpu) / local_cpu)
                for key, value in (("worker", r["cpu"]), ("shards", shards_cpu), ("local", local_cpu)):
                    cpu[key].append(value / n)
            worker.send(op="close")
            worker.expect("closed", TIMEOUT)
            local_all += local_here
            figures += _step_figures(plan, dim, shards, wire, ps, phases, local_here, ratios, ready["transports"])
            figures.append(_cpu_figure(plan, dim, shards, wire, cpu))
            log(
                f"sparse step d{dim}, {shards} shard(s), {wire}: {median(ps) * 1e3:.2f} ms against local "
                f"{median(local_here) * 1e3:.2f} ms = {median(ratios):.2f}x; CPU {median(cpu['ratio']):.2f}x"
            )
    finally:
        procs.stop_soon(cluster)
    return figures


def _cpu_figure(plan: Plan, dim: int, shards: int, wire: str, cpu: dict[str, list[float]]) -> Figure:
    scope = "per shard" if shards == 1 else "end to end"
    return Figure(
        id=f"{SECTION}.cpu.{wire}.s{shards}.d{dim}",
        section=SECTION,
        title=f"CPU seconds per step of the worker and its {shards} shard(s) ÷ the local process's, dim {dim}, "
        f"{PATHS[wire]}; per round",
        unit="x",
        repeats=[round(r, 4) for r in cpu["ratio"]],
        params={
            "dim": dim,
            "shards": shards,
            "wire": wire,
            "scope": scope,
            "target": TARGET_CPU if wire in ("shm", "socket") else None,
            "baseline": f"{SECTION}.local.d{dim}",
        },
        warmup=plan.sparse_batches,
        extra={f"{k}_cpu_ms": round(median(cpu[k]) * 1e3, 4) for k in ("worker", "shards", "local")},
    )


def _step_figures(
    plan: Plan,
    dim: int,
    shards: int,
    wire: str,
    ps: list[float],
    phases: dict[str, list[float]],
    local: list[float],
    ratios: list[float],
    transports: list[str],
) -> list[Figure]:
    key = f"{wire}.s{shards}.d{dim}"
    scope = "per shard" if shards == 1 else "end to end"
    params = {
        "dim": dim,
        "shards": shards,
        "wire": wire,
        "batch": BATCH,
        "rows": ROWS,
        "mode": "sync",
        "workers": 1,
        "optimizer": "adagrad",
        "scope": scope,
        "baseline": f"{SECTION}.local.d{dim}",
    }
    extra = {
        "forward_ms": round(median(phases["forward"]) * 1e3, 4),
        "backward_ms": round(median(phases["backward"]) * 1e3, 4),
        "push_pull_ms": round(median(phases["push_pull"]) * 1e3, 4),
        "local_ms": round(median(local) * 1e3, 4),
        "transports": transports,
    }
    return [
        Figure(
            id=f"{SECTION}.ms.{key}",
            section=SECTION,
            title=f"PS step (lookup + backward + push_pull), {BATCH} Zipf IDs, dim {dim}, {shards} shard(s), "
            f"{PATHS[wire]}",
            unit="ms",
            repeats=ms(ps),
            params=params,
            warmup=plan.sparse_batches,
            compare=[f"{SECTION}.local.d{dim}"],
            extra=extra,
        ),
        Figure(
            id=f"{SECTION}.step.{key}",
            section=SECTION,
            title=f"PS step ÷ local step (nn.Embedding sparse + Adagrad), dim {dim}, {shards} shard(s) ({scope}), "
            f"{PATHS[wire]}; per round, medians of rounds taken in turn",
            unit="x",
            repeats=[round(r, 4) for r in ratios],
            params={**params, "target": TARGET_STEP if wire in ("shm", "socket") else None},
            warmup=plan.sparse_batches,
            extra=extra,
        ),
    ]


def _throughput(plan: Plan, procs: Processes, local: Child) -> list[Figure]:
    """One shard, async, `sparse_workers` workers stepping at once for windows, local rounds between windows."""
    from paramserver import ServerConfig

    dim, workers = MEMORY_DIM, plan.sparse_workers
    kids = [
        procs.child(SECTION, "worker", {"batches": plan.sparse_batches, "seed": 100 + r}, name=f"sparse-tput{r}")
        for r in range(workers)
    ]
    cluster = procs.cluster(ServerConfig(mode="async", workers=workers, optimizer="adagrad", lr=LR), 1)
    procs.settle()
    figures: list[Figure] = []
    local_rates: list[float] = []
    try:
        for wire in [w for w in ("shm", "socket") if w in plan.sparse_wires]:
            for k in kids:
                k.send(op="open", address=cluster.address, wire=wire, dim=dim)
            for k in kids:
                k.expect("ready", TIMEOUT)
            rates, ratios, per_worker = [], [], []
            for _ in range(plan.sparse_rounds):
                lt, _ = local_round(local, dim, plan.sparse_steps)
                local_rates += [BATCH / t / 1e6 for t in lt]
                for k in kids:
                    k.send(op="run", seconds=plan.sparse_seconds)
                got = [k.expect("result", TIMEOUT) for k in kids]
                span = max(g["ended"] for g in got) - min(g["began"] for g in got)
                rate = sum(g["steps"] for g in got) * BATCH / span / 1e6
                rates.append(rate)
                ratios.append(rate / (BATCH / median(lt) / 1e6))
                per_worker.append([g["steps"] for g in got])
            for k in kids:
                k.send(op="close")
            for k in kids:
                k.expect("closed", TIMEOUT)
            params = {
                "dim": dim,
                "shards": 1,
                "workers": workers,
                "wire": wire,
                "mode": "async",
                "optimizer": "adagrad",
                "batch": BATCH,
                "seconds": plan.sparse_seconds,
                "baseline": f"{SECTION}.local.rate.d{dim}",
            }
            extra = {"steps_per_worker": per_worker}
            figures += [
                Figure(
                    id=f"{SECTION}.ids.{wire}.s1.w{workers}.d{dim}",
                    section=SECTION,
                    title=f"IDs per second one shard sustains, {workers} workers at once, dim {dim}, {PATHS[wire]}",
                    unit="M IDs/s",
                    repeats=[round(r, 4) for r in rates],
                    params=params,
                    warmup=plan.sparse_batches,
                    compare=[f"{SECTION}.local.rate.d{dim}"],
                    extra=extra,
                ),
                Figure(
                    id=f"{SECTION}.throughput.{wire}.s1.w{workers}.d{dim}",
                    section=SECTION,
                    title=f"IDs/s of one shard under {workers} workers ÷ the local step's IDs/s (1 thread), "
                    f"dim {dim}, {PATHS[wire]}; per window",
                    unit="x",
                    repeats=[round(r, 4) for r in ratios],
                    params=params,
                    warmup=plan.sparse_batches,
                    extra=extra,
                ),
            ]
            log(
                f"sparse throughput, 1 shard, {workers} workers, {wire}: {median(rates):.2f} M IDs/s = "
                f"{median(ratios):.2f}x the local step's rate"
            )
    finally:
        procs.close_children(kids)
        procs.stop_soon(cluster)
        procs.settle()
    figures.append(
        Figure(
            id=f"{SECTION}.local.rate.d{dim}",
            section=SECTION,
            title=f"local step's IDs per second (nn.Embedding sparse + Adagrad, 1 thread), dim {dim}",
            unit="M IDs/s",
            repeats=[round(r, 4) for r in local_rates],
            params={"dim": dim, "batch": BATCH, "rows": ROWS, "threads": 1, "optimizer": "adagrad"},
            warmup=plan.sparse_batches,
        )
    )
    return figures
