"""A peer in the same run: TorchRec's DistributedModelParallel on 2 CPU processes (gloo) against our step and the
local step, on the sparse section's table and batches.

The peer: one `EmbeddingBagCollection` table of 1M rows x dim (sum pooling of one ID a bag: the row itself),
torch.optim.Adagrad fused into its backward (`apply_optimizer_in_backward`: FBGEMM's exact Adagrad), sharded by
TorchRec's planner (table-wise on the CPU: row-wise pooled sharding is CUDA-only), two rank processes with one
torch thread each, gloo on 127.0.0.1. Each rank steps on its own batch of 4,096 Zipf(1.1) IDs, rank 0 on the very
batches the local step and our worker use (bench.sparse's), so a rank's step is the same work as ours. Ours: the
sparse section's worker (1 process, 2 shard processes, sync, shared memory, the next batch prefetched). Rounds of
local, ours and the peer's steps in turn; medians of each round's ratio.

TorchRec and FBGEMM are not among the project's dependencies: `make bench-peers` installs fbgemm-gpu-cpu 1.8.0 and
torchrec 1.8.0 (the versions that load with torch 2.13.0; 1.7 and 1.9 fail with undefined symbols) without their
dependencies, so no other torch build comes with them. Without them the section is skipped and says why.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

from bench.common import Channel, Child, Figure, Processes, cpu_seconds, free_port, log, median, ms
from bench.plan import Plan

SECTION = "sparse_peer"
TIMEOUT = 600.0
ROWS = 1_000_000
LR = 0.01
TARGET = 1 / 3  # our step ÷ the peer's


def unavailable() -> str | None:
    """Why the peer cannot run here (None: it can)."""
    missing = [m for m in ("torchrec", "fbgemm_gpu") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (make bench-peers)"
    return None


def _rank(chan: Channel, params: dict[str, Any]) -> None:
    """One TorchRec rank: DMP over one table; `n` timed steps per message, in step with the other rank."""
    import torch
    import torch.distributed as dist

    from bench.sparse import _batches

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(params["port"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=params["rank"], world_size=params["world"])
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_configs import PoolingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    batches = _batches(params["batches"], params["rank"])  # rank 0: bench.sparse's batches (seed 0)
    models: dict[int, Any] = {}
    try:
        while True:
            job = chan.recv()
            dim = job["dim"]
            if dim not in models:
                models.clear()
                table = EmbeddingBagConfig(
                    name="t", embedding_dim=dim, num_embeddings=ROWS, feature_names=["f"], pooling=PoolingType.SUM
                )
                ebc = EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
                apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": LR})
                models[dim] = DistributedModelParallel(ebc, device=torch.device("cpu"))
            model = models[dim]
            ones = torch.ones(len(batches[0]), dtype=torch.int64)

            def step(ids: Any, model: Any = model, ones: Any = ones) -> None:
                model(KeyedJaggedTensor(keys=["f"], values=ids, lengths=ones)).values().sum().backward()

            if job.get("warm"):
                for b in batches:
                    step(b)
            times, cpu = [], time.process_time()
            for i in range(job["n"]):
                t0 = time.perf_counter()
                step(batches[i % len(batches)])
                times.append(time.perf_counter() - t0)
            chan.send("result", times=times, cpu=time.process_time() - cpu)
    finally:
        dist.destroy_process_group()


ROLES = {"rank": _rank}


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """Local, ours and the peer's steps in turn, for each of the sparse section's row widths."""
    why = unavailable()
    if why is not None:
        log(f"section {SECTION} skipped: {why}")
        return []
    from paramserver import ServerConfig

    batches = {"batches": plan.sparse_batches, "seed": 0}
    local = procs.child("sparse", "local", batches, name="peer-local")
    ours = procs.child("sparse", "worker", batches, name="peer-ours")
    port = free_port()
    ranks = [
        procs.child(SECTION, "rank", {**batches, "rank": r, "world": 2, "port": port}, name=f"torchrec{r}")
        for r in range(2)
    ]
    figures: list[Figure] = []
    try:
        for dim in plan.sparse_dims:
            # A cluster of its own for each width: a shard holds one model.
            cluster = procs.cluster(ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=LR), 2)
            try:
                figures += _dim(plan, local, ours, ranks, cluster, dim)
            finally:
                procs.stop_soon(cluster)
                procs.settle()
    finally:
        procs.close_children([local, ours, *ranks])
    return figures


def _steps(kids: list[Child], n: int, **extra: Any) -> list[dict[str, Any]]:
    for kid in kids:
        kid.send(n=n, **extra)
    return [kid.expect("result", TIMEOUT) for kid in kids]


def _dim(plan: Plan, local: Child, ours: Child, ranks: list[Child], cluster: Any, dim: int) -> list[Figure]:
    n = plan.sparse_steps
    ours.send(op="open", address=cluster.address, wire="shm", dim=dim)
    ours.expect("ready", TIMEOUT)
    _steps(ranks, 1, dim=dim, warm=True)
    pids = [p.pid for p in cluster.procs]
    keys = ("peer", "ours_vs_peer", "peer_cpu", "ours_cpu_vs_peer", "peer_ms", "ours_ms")
    got: dict[str, list[float]] = {k: [] for k in keys}
    peer_all: list[float] = []
    for _ in range(plan.sparse_rounds):
        lr = _steps([local], n, dim=dim)[0]
        before = cpu_seconds(pids)
        ours.send(op="steps", n=n)
        mine = ours.expect("result", TIMEOUT)
        ours_cpu = mine["cpu"] + cpu_seconds(pids) - before
        phases = zip(mine["forward"], mine["backward"], mine["push_pull"], strict=True)
        ours_ms = median([a + b + c for a, b, c in phases])
        peer = _steps(ranks, n, dim=dim)
        peer_ms = median([median(r["times"]) for r in peer])  # each rank's step: the same work as ours
        peer_all += peer[0]["times"]
        got["peer"].append(peer_ms / median(lr["times"]))
        got["ours_vs_peer"].append(ours_ms / peer_ms)
        peer_cpu = sum(r["cpu"] for r in peer) / 2  # per rank: a rank does the work of our worker and shards
        got["peer_cpu"].append(peer_cpu / lr["cpu"])
        got["ours_cpu_vs_peer"].append(ours_cpu / peer_cpu)
        got["peer_ms"].append(peer_ms)
        got["ours_ms"].append(ours_ms)
    ours.send(op="close")
    ours.expect("closed", TIMEOUT)
    params = {"dim": dim, "rows": ROWS, "batch": 4096, "ranks": 2, "optimizer": "exact adagrad (fused)"}
    extra = {
        "peer_ms": round(median(got["peer_ms"]) * 1e3, 3),
        "ours_ms": round(median(got["ours_ms"]) * 1e3, 3),
        "ours_cpu_vs_peer": round(median(got["ours_cpu_vs_peer"]), 4),
    }
    log(
        f"sparse peer d{dim}: TorchRec DMP {extra['peer_ms']:.2f} ms a rank ({median(got['peer']):.2f}x local); "
        f"ours {extra['ours_ms']:.2f} ms = {median(got['ours_vs_peer']):.2f}x TorchRec's"
    )
    return [
        Figure(
            id=f"{SECTION}.torchrec.ms.d{dim}",
            section=SECTION,
            title=f"TorchRec DMP step per rank, 2 CPU ranks (gloo), 4,096 Zipf IDs a rank, dim {dim}",
            unit="ms",
            repeats=ms(peer_all),
            params=params,
            warmup=plan.sparse_batches,
            extra=extra,
        ),
        *(
            Figure(
                id=f"{SECTION}.{fid}.d{dim}",
                section=SECTION,
                title=f"{title}, dim {dim}; per round",
                unit="x",
                repeats=[round(x, 4) for x in got[kind]],
                params={**params, "target": round(TARGET, 4)} if fid == "ours" else params,
                warmup=plan.sparse_batches,
                extra=extra,
            )
            for fid, kind, title in (
                ("torchrec.step", "peer", "TorchRec DMP step per rank ÷ the local step (nn.Embedding sparse, Adagrad)"),
                ("torchrec.cpu", "peer_cpu", "TorchRec DMP CPU per rank-step ÷ the local step's"),
                ("ours", "ours_vs_peer", "our step (1 worker, 2 shards, sync, shared memory) ÷ TorchRec's per rank"),
            )
        ),
    ]
