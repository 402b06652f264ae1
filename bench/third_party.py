"""Someone else's loop: deepctr-torch 0.3.0's DeepFM trained by its own `fit()` through `make_sparse` and
`PSOptimizer`, against the same `fit()` locally (issue 37's setup, smaller).

The model: 26 categorical fields (four of 1-2 M IDs made unbounded, the rest 4 to 10,000), 13 dense features,
`embedding_dim` 8, DNN (256, 128), `init_std` 1e-4, no penalty on the tables; Adagrad lr 0.05, summed loss
(`loss_reduction="sum"`). IDs are
Zipf(1.2) per field, labels Bernoulli of a planted logit. Through the shards: 2 workers x 2 shards, sync, each
worker a thread with its own client, the shards threads too (one process: its CPU time is all of them), batches of
`BATCH` per worker. Locally: one `fit()` over the same samples in batches of 2 x `BATCH`, torch's Adagrad, the tables
`sparse=True`. One torch
thread each. Rounds alternate local and job; figures are the medians of per-round ratios: CPU per sample and
samples/s against local, and the held-out AUC minus local's. With deepctr-torch missing the section is skipped.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from unittest import mock

from bench.common import Channel, Figure, Processes, log, median
from bench.plan import Plan

SECTION = "third_party"
TIMEOUT = 900.0
BATCH = 1000
WORKERS = 2
LR = 0.05
BIG = (2_000_000, 1_000_000, 1_000_000, 1_500_000)
SMALL = (4, 7, 12, 20, 30, 50, 100, 300, 1_000, 3_000, 10_000)
TARGETS = {"cpu": 1.5, "rate": 1.0, "auc": -0.003}  # issue 37: CPU at most, samples/s and AUC - local at least


def _data(fields: int, rows: int, seed: int) -> tuple[dict[str, Any], Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = [*BIG, *(SMALL[k % len(SMALL)] for k in range(fields - len(BIG)))][:fields]
    x: dict[str, Any] = {}
    logit = np.full(rows, -1.0)
    for f, size in enumerate(sizes):
        ids = (rng.zipf(1.2, rows) * 2_654_435_761 + f) % size
        x[f"C{f}"] = ids
        logit += np.sin(ids * (0.37 + f)) * (0.6 if f < 8 else 0.2) / np.sqrt(1 + ids / 50)
    for d in range(13):
        x[f"I{d}"] = rng.standard_normal(rows).astype(np.float32)
        logit += 0.3 * x[f"I{d}"] if d < 3 else 0.0
    return x, (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)


def _model(deepctr: Any, x: dict[str, Any]) -> Any:
    from deepctr_torch.inputs import DenseFeat, SparseFeat

    columns = [
        SparseFeat(k, BIG[int(k[1:])] if k in _big_names() else int(v.max()) + 1, embedding_dim=8)
        for k, v in x.items()
        if k.startswith("C")
    ]
    columns += [DenseFeat(k, 1) for k in x if k.startswith("I")]
    return deepctr.models.DeepFM(
        columns,
        columns,
        task="binary",
        dnn_hidden_units=(256, 128),
        init_std=1e-4,
        seed=1024,
        device="cpu",
        l2_reg_embedding=0.0,  # a sparse table takes no dense penalty (and make_sparse's tables none at all)
        l2_reg_linear=0.0,  # the linear part's tables too
    )


def _big_names() -> set[str]:
    return {f"C{f}" for f in range(len(BIG))}


def _import_deepctr() -> Any:
    before = set(threading.enumerate())
    with mock.patch("requests.get", side_effect=OSError("no network here")):  # its version check on import
        import deepctr_torch

        for thread in set(threading.enumerate()) - before:
            thread.join(10)
    return deepctr_torch


def _local(deepctr: Any, x: dict[str, Any], y: Any, test: dict[str, Any]) -> tuple[float, float, Any]:
    """fit() locally, its tables sparse (torch's Adagrad then updates only the rows a batch touched, as the shards do;
    deepctr's dense tables would update every row of the millions at each step)."""
    import torch
    from torch import nn

    model = _model(deepctr, x)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.sparse = True
    model.compile(torch.optim.Adagrad(model.parameters(), lr=LR), "binary_crossentropy")
    t0, c0 = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=WORKERS * BATCH, epochs=1, verbose=0, shuffle=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, model.predict(test, batch_size=4096)


def _job(deepctr: Any, x: dict[str, Any], y: Any, test: dict[str, Any], grouped: bool) -> tuple[float, float, Any]:
    """Two workers' fit() through 2 shards; `grouped` False: each table looks its rows up alone (before issue 37)."""
    from torch import nn

    from paramserver.config import ServerConfig
    from paramserver.server.cluster import LocalCluster
    from worker import PSClient, PSOptimizer, make_sparse
    from worker.train import optimizer as ps_optimizer

    cluster = LocalCluster(ServerConfig(mode="sync", workers=WORKERS, optimizer="adagrad", lr=LR), 2).start()
    models = [_model(deepctr, x) for _ in range(WORKERS)]
    rows = len(y) // WORKERS
    got: dict[int, Any] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(WORKERS + 1)
    done = threading.Barrier(WORKERS + 1)

    def run(index: int) -> None:
        try:
            model = models[index]
            big = [
                p for p, m in model.named_modules() if isinstance(m, nn.Embedding) and p.split(".")[-1] in _big_names()
            ]
            model = make_sparse(model, unbounded=big)
            with PSClient(cluster.address) as client:
                model.compile(PSOptimizer(model, client, loss_reduction="sum"), "binary_crossentropy")
                mine = slice(client.rank * rows, (client.rank + 1) * rows)
                part = {k: v[mine] for k, v in x.items()}
                started.wait(60)
                model.fit(part, y[mine], batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
                done.wait(600)
                got[client.rank] = model.predict(test, batch_size=4096)
                client.leave(finished=True)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the round
            errors.append(exc)
            started.abort()
            done.abort()

    keep = ps_optimizer.grouped_lookups
    if not grouped:
        ps_optimizer.grouped_lookups = lambda model: model  # type: ignore[assignment]
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(WORKERS)]
    try:
        for t in threads:
            t.start()
        started.wait(120)
        t0, c0 = time.perf_counter(), time.process_time()
        done.wait(TIMEOUT)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for t in threads:
            t.join(120)
    except threading.BrokenBarrierError:
        raise errors[0] if errors else RuntimeError("a worker did not finish") from None
    finally:
        ps_optimizer.grouped_lookups = keep  # type: ignore[assignment]
        cluster.stop()
    if errors:
        raise errors[0]
    return wall, cpu, got[0]


def _measure(chan: Channel, params: dict[str, Any]) -> None:
    """Rounds of local fit() then each variant's job; per-round ratios and AUCs back to the parent."""
    import numpy as np
    import torch
    from sklearn.metrics import roc_auc_score

    torch.set_num_threads(1)
    deepctr = _import_deepctr()
    samples = params["samples"]
    x, y = _data(params["fields"], samples + 5000, seed=0)
    train, test = {k: v[:samples] for k, v in x.items()}, {k: v[samples:] for k, v in x.items()}
    # The local batch k is the workers' step-k batches one after the other: the samples a sync round combines.
    half, steps = samples // WORKERS, samples // (WORKERS * BATCH)
    order = np.concatenate(
        [np.arange(r * half + k * BATCH, r * half + (k + 1) * BATCH) for k in range(steps) for r in range(WORKERS)]
    )
    out: dict[str, list[float]] = {}
    for _ in range(params["rounds"]):
        wall, cpu, pred = _local(deepctr, {k: v[order] for k, v in train.items()}, y[order], test)
        local_auc = roc_auc_score(y[samples:], pred)
        for variant in params["variants"]:
            pwall, pcpu, ppred = _job(deepctr, train, y[:samples], test, variant == "grouped")
            out.setdefault(f"{variant}.cpu", []).append(pcpu / cpu)  # same samples both sides
            out.setdefault(f"{variant}.rate", []).append(wall / pwall)
            out.setdefault(f"{variant}.auc", []).append(roc_auc_score(y[samples:], ppred) - local_auc)
        out.setdefault("local.auc", []).append(local_auc)
    chan.send("result", figures=out)


ROLES = {"measure": _measure}


def params_of(plan: Plan) -> dict[str, Any]:
    """The sizes of a run: issue 37's model at 60k samples a round, or a miniature for the smoke test."""
    if plan.quick:
        return {"fields": 8, "samples": 4_000, "rounds": 1, "variants": ["grouped"]}
    return {"fields": 26, "samples": 60_000, "rounds": 3, "variants": ["grouped"]}


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """The section: figures of CPU per sample, samples/s and AUC against local."""
    try:
        import deepctr_torch  # noqa: F401
    except ImportError:
        log("deepctr-torch is not installed (make install): third_party skipped")
        return []
    params = params_of(plan)
    child = procs.child("third_party", "measure", params)
    got = child.expect("result", TIMEOUT)["figures"]
    titles = {
        "cpu": "CPU per sample (workers and shards) / local fit()'s",
        "rate": "samples/s / local fit()'s",
        "auc": "held-out AUC - local fit()'s",
    }
    base = "deepctr-torch DeepFM, its fit() through make_sparse + PSOptimizer, 2 workers x 2 shards, sync"
    figures = []
    for variant in params["variants"]:
        for kind, title in titles.items():
            values = got[f"{variant}.{kind}"]
            figures.append(
                Figure(
                    id=f"{SECTION}.deepfm.{variant}.{kind}",
                    section=SECTION,
                    title=f"{base}; {title}",
                    unit="x" if kind != "auc" else "AUC",
                    repeats=[round(v, 4) for v in values],
                    params={**params, "target": TARGETS.get(kind)},
                    extra={"median": round(median(values), 4), "local_auc": got["local.auc"]},
                )
            )
    return figures
