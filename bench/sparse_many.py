"""Many tables: a DeepFM/DLRM-shaped model through the shards against the same model in plain torch, and how the
cost grows with workers, shards and tables.

The model: F categorical fields, each with a 16-wide table (its vector) and a 1-wide table (its linear term), and
13 dense features; a bottom MLP (13 -> 64 -> 16), the field vectors and the bottom's output concatenated into a top
MLP (-> 64 -> 1), plus the linear terms; binary cross-entropy with logits. Four fields have millions of IDs
(`plan.many_big`), the rest between 7 and 100,000; IDs are Zipf(1.1) mod the field's size, labels a fixed logistic
function of a few fields. Through the shards every table is a `SparseEmbedding(optimizer="adagrad")` told to
prefetch the next batch's IDs (so the forward pass makes no round trip), the dense part Adagrad on the shards; sync
mode, shared memory, each worker a process of its own with one torch thread and a batch of `plan.many_batch`.
Locally, `nn.Embedding(sparse=True)` tables with `torch.optim.Adagrad`, and Adagrad on the dense part, one
process, one thread, the same batch size. Both after one warm-up pass over their pre-drawn batches.

Rounds alternate: local steps, then as many job steps (every worker at once). CPU is every process's: the workers'
(their own process_time) and every shard's (bench.common.cpu_seconds), per sample, against the local process's
per sample; samples/s counts every worker's batch. Cases: the main one (26 fields = 52 tables, 2 workers x 2
shards), then workers 1, 2, 4 against shards 1, 2 (52 tables), then 1, 26 and 100 tables (2 x 2).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from bench.common import Channel, Child, Figure, Processes, cpu_seconds, log, median
from bench.plan import Plan

SECTION = "sparse_many"
TIMEOUT = 900.0
DIM = 16
DENSE = 13
ZIPF_A = 1.1
LR = 0.01
SMALL = (100, 1_000, 10_000, 100_000, 30_000, 5_000, 200, 50, 20, 7)  # the other fields' sizes, in turn
TARGET_CPU = 1.3  # the main case's CPU per sample / the local process's


def field_sizes(tables: int, big: tuple[int, ...]) -> list[tuple[int, bool]]:
    """(IDs, with a linear table) of each field: `tables` = 1 is one 16-wide table alone; else tables / 2 fields."""
    if tables == 1:
        return [(big[0], False)]
    fields = tables // 2
    sizes = [*big, *(SMALL[k % len(SMALL)] for k in range(max(0, fields - len(big))))][:fields]
    return [(n, True) for n in sizes]


def _batches(fields: list[tuple[int, bool]], count: int, batch: int, seed: int) -> list[Any]:
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = np.stack([rng.zipf(ZIPF_A, batch) % n for n, _ in fields], 1)
        dense = rng.standard_normal((batch, DENSE)).astype(np.float32)
        logit = dense[:, 0] + 0.5 * np.cos(ids[:, 0] % 7) - 0.3 * (ids[:, -1] % 3)
        label = (rng.random(batch) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        out.append((torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(label)))
    return out


def _model(fields: list[tuple[int, bool]], table: Any) -> Any:
    """The model, its tables made by table(ids, dim)."""
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vectors = nn.ModuleList([table(n, DIM) for n, _ in fields])
            self.linear = nn.ModuleList([table(n, 1) for n, lin in fields if lin])
            self.bottom = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, DIM))
            self.top = nn.Sequential(nn.Linear(DIM * (len(fields) + 1), 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            vectors = [self.bottom(dense), *(t(ids[:, f]) for f, t in enumerate(self.vectors))]
            out = self.top(torch.cat(vectors, 1)).squeeze(1)
            for f, t in enumerate(self.linear):
                out = out + t(ids[:, f]).squeeze(1)
            return out

        def tables(self) -> list[tuple[int, Any]]:
            """(field, table) of every table."""
            return [*enumerate(self.vectors), *enumerate(self.linear)]

    return Model()


def _setup(params: dict[str, Any], job: dict[str, Any]) -> tuple[list[tuple[int, bool]], list[Any]]:
    fields = field_sizes(job["tables"], tuple(params["big"]))
    return fields, _batches(fields, params["batches"], params["batch"], params["seed"] + job["tables"])


def _local(chan: Channel, params: dict[str, Any]) -> None:
    """nn.Embedding(sparse=True) tables + torch.optim.Adagrad; `n` timed steps per message of `tables` tables."""
    import gc

    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    state: dict[str, Any] = {"tables": None}
    i = 0
    loss_fn = nn.BCEWithLogitsLoss()
    while True:
        job = chan.recv()
        if state["tables"] != job["tables"]:
            state.clear()
            gc.collect()
            fields, batches = _setup(params, job)
            model = _model(fields, lambda n, d: nn.Embedding(n, d, sparse=True))
            sparse = [p for t in (*model.vectors, *model.linear) for p in t.parameters()]
            dense = [*model.bottom.parameters(), *model.top.parameters()]
            opts = [torch.optim.Adagrad(sparse, lr=LR), torch.optim.Adagrad(dense, lr=LR)]

            def step(b: Any, model: Any = model, opts: list[Any] = opts) -> None:
                loss = loss_fn(model(b[0], b[1]), b[2])
                for o in opts:
                    o.zero_grad()
                loss.backward()
                for o in opts:
                    o.step()

            state.update(tables=job["tables"], step=step, batches=batches)
            for b in batches:
                step(b)
        times, cpu = [], time.process_time()
        for _ in range(job["n"]):
            t0 = time.perf_counter()
            state["step"](state["batches"][i % len(state["batches"])])
            i += 1
            times.append(time.perf_counter() - t0)
        chan.send("result", times=times, cpu=time.process_time() - cpu)


def _worker(chan: Channel, params: dict[str, Any]) -> None:
    """One PSClient at a time ('open' registers and warms up; 'close' leaves); 'steps' times `n` steps."""
    import torch
    from torch import nn

    from worker import PSClient, SparseEmbedding

    torch.set_num_threads(1)
    torch.manual_seed(0)
    loss_fn = nn.BCEWithLogitsLoss()
    client: Any = None
    i = 0
    try:
        while True:
            job = chan.recv()
            if job["op"] == "open":
                fields, batches = _setup({**params, "seed": params["seed"] + 1000 * job["rank"]}, job)
                model = _model(fields, lambda n, d: SparseEmbedding(d, num_embeddings=n, optimizer="adagrad"))
                client = PSClient(job["address"], shared_memory=True)
                client.register(model)

                def step(model: Any = model, batches: list[Any] = batches, client: Any = client) -> None:
                    nonlocal i
                    dense, ids, label = batches[i % len(batches)]
                    i += 1
                    model.zero_grad()
                    loss_fn(model(dense, ids), label).backward()
                    coming = batches[i % len(batches)][1]
                    for f, table in model.tables():
                        table.prefetch(coming[:, f])
                    client.push_pull(model)

                for _ in batches:
                    step()
                chan.send("ready")
            elif job["op"] == "steps":
                times, cpu = [], time.process_time()
                for _ in range(job["n"]):
                    t0 = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t0)
                chan.send("result", times=times, cpu=time.process_time() - cpu)
            elif job["op"] == "close":
                client.close()
                client = None
                chan.send("closed")
    finally:
        if client is not None:
            client.close()


ROLES = {"local": _local, "worker": _worker}


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """The main case, then workers x shards, then tables."""
    params = {"big": list(plan.many_big), "batch": plan.many_batch, "batches": plan.many_batches, "seed": 0}
    local = procs.child(SECTION, "local", params, name="many-local")
    workers = [procs.child(SECTION, "worker", params, name=f"many-worker{r}") for r in range(max(plan.many_workers))]
    cases = [(52, 2, 2)]
    cases += [(52, w, s) for w in plan.many_workers for s in plan.many_shards if (w, s) != (2, 2)]
    cases += [(t, 2, 2) for t in plan.many_tables if t != 52]
    figures: list[Figure] = []
    for tables, w, s in cases:
        figures += _case(plan, procs, local, workers[:w], tables, s)
    procs.close_children([local, *workers])
    return figures


def _case(plan: Plan, procs: Processes, local: Child, workers: list[Child], tables: int, shards: int) -> list[Figure]:
    from paramserver import ServerConfig

    w, batch = len(workers), plan.many_batch
    cluster = procs.cluster(ServerConfig(mode="sync", workers=w, optimizer="adagrad", lr=LR), shards)
    procs.settle()
    pids = [p.pid for p in cluster.procs]
    got: dict[str, list[float]] = {k: [] for k in ("cpu", "step", "rate", "local_ms", "ps_ms", "local", "wk", "sh")}
    try:
        for rank, kid in enumerate(workers):
            kid.send(op="open", address=cluster.address, tables=tables, rank=rank)
        for kid in workers:
            kid.expect("ready", TIMEOUT)
        n = plan.many_steps
        for _ in range(plan.many_rounds):
            local.send(tables=tables, n=n)
            lr = local.expect("result", TIMEOUT)
            before = cpu_seconds(pids)
            for kid in workers:
                kid.send(op="steps", n=n)
            rs = [kid.expect("result", TIMEOUT) for kid in workers]
            shards_cpu = cpu_seconds(pids) - before
            local_ms, ps_ms = median(lr["times"]), median([median(r["times"]) for r in rs])
            samples = w * batch * n
            per_sample = (sum(r["cpu"] for r in rs) + shards_cpu) / samples
            local_per_sample = lr["cpu"] / (batch * n)
            got["cpu"].append(per_sample / local_per_sample)
            got["step"].append(ps_ms / local_ms)
            got["rate"].append((w * batch / ps_ms) / (batch / local_ms))
            got["local_ms"].append(local_ms)
            got["ps_ms"].append(ps_ms)
            got["local"].append(local_per_sample)
            got["wk"].append(sum(r["cpu"] for r in rs) / samples)
            got["sh"].append(shards_cpu / samples)
        for kid in workers:
            kid.send(op="close")
        for kid in workers:
            kid.expect("closed", TIMEOUT)
    finally:
        procs.stop_soon(cluster)
    key = f"t{tables}.w{w}.s{shards}"
    main = (tables, w, shards) == (52, 2, 2)
    params = {"tables": tables, "workers": w, "shards": shards, "batch": batch, "dim": DIM, "mode": "sync"}
    extra = {
        "local_ms": round(median(got["local_ms"]) * 1e3, 3),
        "ps_ms": round(median(got["ps_ms"]) * 1e3, 3),
        "local_cpu_us_per_sample": round(median(got["local"]) * 1e6, 3),
        "workers_cpu_us_per_sample": round(median(got["wk"]) * 1e6, 3),
        "shards_cpu_us_per_sample": round(median(got["sh"]) * 1e6, 3),
        "samples_per_s": round(w * batch / median(got["ps_ms"]), 1),
        "local_samples_per_s": round(batch / median(got["local_ms"]), 1),
    }
    log(
        f"sparse many {key}: CPU/sample {median(got['cpu']):.2f}x local, step {median(got['step']):.2f}x, "
        f"samples/s {median(got['rate']):.2f}x"
    )
    what = f"{tables} tables, {w} worker(s), {shards} shard(s), sync, shared memory, batch {batch} a worker"
    titles = {
        "cpu": "CPU seconds per sample of the workers and shards ÷ the local process's",
        "step": "job step ÷ local step",
        "rate": "samples/s of the job ÷ the local process's",
    }
    return [
        Figure(
            id=f"{SECTION}.{kind}.{key}",
            section=SECTION,
            title=f"{title}; {what}; per round",
            unit="x",
            repeats=[round(x, 4) for x in got[kind]],
            params={**params, "target": TARGET_CPU if main and kind == "cpu" else None},
            warmup=plan.many_batches,
            extra=extra,
        )
        for kind, title in titles.items()
    ]
