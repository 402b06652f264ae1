"""Training: samples/s of real training against 2 shard processes, against the same model trained locally.

Each worker is a process of its own that runs `worker.train.trainer.train(TrainConfig(...))`, the loop ps-worker runs,
with one torch thread. Worker processes start (imports, data, three warm-up steps) while the shards start, and
serve several runs each; every run gets fresh shards, so it starts from the same initial weights. The local
baseline is a plain torch loop in one process: the same data pipeline, batch size 32, Adam lr 1e-3 with torch's
fused kernel (the servers run the same), one torch thread. Times are training time as the trainer reports it
(after joining and registering, before the final evaluation).
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import Channel, Child, Figure, Processes, log, median
from bench.plan import Plan

SECTION = "training"
TIMEOUT = 900.0
BATCH = 32
SHARDS = 2
LR = 1e-3


# -- the worker process -----------------------------------------------------------------------------------------


def _trainer(chan: Channel, params: dict[str, Any]) -> None:
    """Warm up, then run each 'ps' (train against the servers) or 'local' (plain torch) request."""
    import torch
    import torch.nn.functional as F

    import worker.train.trainer  # noqa: F401 - imported now, not inside the first timed run
    from worker.data.datasets import load_dataset
    from worker.models.builtin import build_model

    torch.set_num_threads(1)
    data = load_dataset(params["dataset"])
    model = build_model(params["model"], in_shape=data.in_shape, num_classes=data.num_classes)
    for i in range(3):  # warm-up: first-call costs of torch's kernels and allocator stay out of every timing
        batch = slice(i * BATCH, (i + 1) * BATCH)
        model.zero_grad()
        F.cross_entropy(model(data.x_train[batch]), data.y_train[batch]).backward()
    chan.send("ready", parameters=sum(p.numel() for p in model.parameters()))
    del model
    while True:
        msg = chan.recv()
        if msg["op"] == "ps":
            chan.send("result", metrics=_ps_run(data, params, msg))
        else:
            chan.send("result", metrics=_local_run(data, params, msg))


def _ps_run(data: Any, params: dict[str, Any], msg: dict[str, Any]) -> dict[str, Any]:
    from worker.train.trainer import TrainConfig, train

    config = TrainConfig(
        server=msg["server"],
        model=params["model"],
        dataset=params["dataset"],
        epochs=msg.get("epochs") or 1,
        steps=msg.get("steps"),
        batch_size=BATCH,
        device="cpu",
        threads=1,
        overlap=msg.get("overlap", False),
        progress=False,
    )
    metrics = train(config, dataset=data)
    keep = ("rank", "steps", "samples", "seconds", "started_at", "finished_at", "samples_per_second", "test_accuracy")
    keep += ("final_loss", "mode")
    return {k: metrics[k] for k in keep}


def _local_run(data: Any, params: dict[str, Any], msg: dict[str, Any]) -> dict[str, Any]:
    """Plain torch training in this process; `target` also records when test accuracy first reaches it."""
    import torch
    import torch.nn.functional as F

    from worker.data.datasets import batches, shard_for_rank, steps_per_epoch
    from worker.models.builtin import build_model
    from worker.train.gradients import accuracy_of

    torch.manual_seed(0)  # the same initial weights as a ps run (seed 0)
    model = build_model(params["model"], in_shape=data.in_shape, num_classes=data.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    x, y = shard_for_rank(data.x_train, data.y_train, 0, 1)
    total = msg.get("steps") or (msg.get("epochs") or 1) * steps_per_epoch(len(x), BATCH)
    target, cpu = msg.get("target"), torch.device("cpu")
    step, samples, seconds, epoch, reached = 0, 0, 0.0, 0, None
    loss = torch.zeros(())
    while step < total:
        start = time.perf_counter()
        for xb, yb in batches(x, y, BATCH, seed=0, epoch=epoch):
            if step >= total:
                break
            optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            samples += len(xb)
        seconds += time.perf_counter() - start
        epoch += 1
        if target is not None and reached is None:  # evaluation time is not training time
            accuracy = accuracy_of(model, data.x_test, data.y_test, cpu)
            if accuracy >= target:
                reached = {"epochs": epoch, "seconds": seconds, "test_accuracy": accuracy}
                break
    return {
        "steps": step,
        "samples": samples,
        "seconds": seconds,
        "samples_per_second": samples / seconds if seconds > 0 else 0.0,
        "test_accuracy": accuracy_of(model, data.x_test, data.y_test, cpu),
        "final_loss": float(loss.detach()),
        "reached": reached,
    }


ROLES = {"trainer": _trainer}


# -- the parent -------------------------------------------------------------------------------------------------


class _Runs:
    """Worker processes of one (model, dataset), reused across setups; results cached by setup and length."""

    def __init__(self, procs: Processes, model: str, dataset: str, workers: int) -> None:
        self.procs, self.model, self.dataset = procs, model, dataset
        spec = {"model": model, "dataset": dataset}
        self.kids = [procs.child(SECTION, "trainer", spec, name=f"{_short(model)}-worker{r}") for r in range(workers)]
        self._ready: set[int] = set()
        self.parameters = 0
        self.cache: dict[tuple[str, int, int | None, int | None], list[dict[str, Any]]] = {}

    def _wait_ready(self, kids: list[Child]) -> None:
        for k in kids:
            if id(k) not in self._ready:
                self.parameters = k.expect("ready", TIMEOUT)["parameters"]
                self._ready.add(id(k))

    def ps(self, mode: str, workers: int, epochs: int | None, steps: int | None, repeats: int) -> list[dict[str, Any]]:
        """`repeats` runs of `workers` workers against fresh shards; each run's totals over its workers. `mode` is
        the job's, with `+overlap` when the workers run ps-worker --overlap."""
        from paramserver import ServerConfig

        key = (mode, workers, epochs, steps)
        runs = self.cache.setdefault(key, [])
        kids = self.kids[:workers]
        job, _, extra = mode.partition("+")
        while len(runs) < repeats:
            config = ServerConfig(mode=job, workers=workers, optimizer="adam", lr=LR)
            cluster = self.procs.cluster(config, SHARDS)
            self.procs.settle()
            try:
                self._wait_ready(kids)
                for k in kids:
                    k.send(op="ps", server=cluster.address, epochs=epochs, steps=steps, overlap=extra == "overlap")
                per_worker = [k.expect("result", TIMEOUT)["metrics"] for k in kids]
            finally:
                self.procs.stop_soon(cluster)
            # The job's throughput: every worker's samples over the span from the first start to the last end (a
            # sum of per-worker rates would count a worker that ran alone for a while as if the others ran too).
            span = max(m["finished_at"] for m in per_worker) - min(m["started_at"] for m in per_worker)
            runs.append(
                {
                    "samples_per_second": sum(m["samples"] for m in per_worker) / span,
                    "seconds": span,
                    "test_accuracy": sum(m["test_accuracy"] for m in per_worker) / len(per_worker),
                    "steps": max(m["steps"] for m in per_worker),
                    "per_worker": per_worker,
                }
            )
            log(
                f"training {self.model} {mode} {workers} worker(s) {epochs or steps} {'epochs' if epochs else 'steps'}:"
                f" {runs[-1]['samples_per_second']:.0f} samples/s, accuracy {runs[-1]['test_accuracy']:.3f}"
            )
        return runs[:repeats]

    def local(self, epochs: int | None, steps: int | None, repeats: int, target: float | None = None) -> list[dict]:
        kid = self.kids[0]
        self._wait_ready([kid])
        runs = []
        for _ in range(repeats):
            kid.send(op="local", epochs=epochs, steps=steps, target=target)
            runs.append(kid.expect("result", TIMEOUT)["metrics"])
        log(f"training {self.model} local: {median([r['samples_per_second'] for r in runs]):.0f} samples/s")
        return runs

    def close(self) -> None:
        self.procs.close_children(self.kids)


def _short(model: str) -> str:
    return model.rsplit(":", 1)[-1]


def _throughput(
    runs: list[dict[str, Any]], model: str, dataset: str, who: str, params: dict[str, Any], compare: list[str]
) -> Figure:
    key = f"{_short(model)}.{dataset}.{who}"
    return Figure(
        id=f"{SECTION}.sps.{key}",
        section=SECTION,
        title=f"training samples/s, {_short(model)} on {dataset}, {who}",
        unit="samples/s",
        repeats=[round(r["samples_per_second"], 2) for r in runs],
        params=params,
        compare=compare,
        extra={
            "test_accuracy": [round(r["test_accuracy"], 4) for r in runs],
            "seconds": [round(r["seconds"], 3) for r in runs],
            "steps": runs[0]["steps"],
        },
    )


def _model_figures(plan: Plan, procs: Processes, model: str, dataset: str, setups: list[tuple[int, str]], length: dict):
    """Local and ps throughput of one model; the time to the target accuracy when it is the plan's tta model."""
    figures = []
    runs = _Runs(procs, model, dataset, max(w for w, _ in setups))
    try:
        local_id = f"{SECTION}.sps.{_short(model)}.{dataset}.local"
        for workers, mode in setups:
            r = runs.ps(mode, workers, length.get("epochs"), length.get("steps"), plan.train_repeats)
            params = {"model": model, "dataset": dataset, "workers": workers, "mode": mode, "shards": SHARDS, **length}
            job, plus, _ = mode.partition("+")
            without = [f"{SECTION}.sps.{_short(model)}.{dataset}.w{workers}.{job}"] if plus else []
            figures.append(_throughput(r, model, dataset, f"w{workers}.{mode}", params, [local_id, *without]))
        local = runs.local(length.get("epochs"), length.get("steps"), plan.train_repeats)
        params = {"model": model, "dataset": dataset, "workers": 1, "mode": "local", **length}
        figures.append(_throughput(local, model, dataset, "local", params, []))
        for f in figures:
            f.params["parameters"] = runs.parameters
        if model == plan.tta_model and dataset == "digits":
            figures += _time_to_accuracy(plan, runs)
    finally:
        runs.close()
    return figures


def _time_to_accuracy(plan: Plan, runs: _Runs) -> list[Figure]:
    """Runs of growing length, 2 workers in sync mode, until one reaches the target test accuracy."""
    target, tried, reached = plan.tta_target, [], None
    for epochs in plan.tta_epochs:
        r = runs.ps("sync", 2, epochs, None, 1)
        accuracy, seconds = median([x["test_accuracy"] for x in r]), median([x["seconds"] for x in r])
        tried.append({"epochs": epochs, "test_accuracy": round(accuracy, 4), "seconds": round(seconds, 3)})
        if accuracy >= target:
            reached = tried[-1]
            break
    local = runs.local(max(plan.tta_epochs), None, plan.train_repeats, target=target)
    hits = [x["reached"] for x in local if x["reached"]]
    name = _short(runs.model)
    base = {"model": runs.model, "dataset": "digits", "target": target}
    return [
        Figure(
            id=f"{SECTION}.tta.{name}.w2.sync",
            section=SECTION,
            title=f"seconds to {target} test accuracy, {name} on digits, 2 workers, sync",
            unit="s",
            repeats=[reached["seconds"]] if reached else [],
            params={**base, "workers": 2, "mode": "sync", "shards": SHARDS},
            compare=[f"{SECTION}.tta.{name}.local"],
            extra={"reached": reached, "tried": tried},
        ),
        Figure(
            id=f"{SECTION}.tta.{name}.local",
            section=SECTION,
            title=f"seconds to {target} test accuracy, {name} on digits, local",
            unit="s",
            repeats=[round(h["seconds"], 3) for h in hits],
            params={**base, "workers": 1, "mode": "local"},
            extra={"reached": hits, "epochs": [h["epochs"] for h in hits]},
        ),
    ]


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """Digits models in every setup, the ~25 M-parameter MLP for a few steps (sync; and async with one worker,
    without and with ps-worker --overlap), and the time to 0.95 accuracy."""
    figures: list[Figure] = []
    for model in plan.train_models:
        figures += _model_figures(plan, procs, model, "digits", list(plan.train_setups), {"epochs": plan.train_epochs})
    # Overlap pays where the exchange and the compute can run at once: one worker leaves a core to the shards.
    big_setups = [(w, "sync") for w in plan.big_workers] + [(1, "async"), (1, "async+overlap")]
    figures += _model_figures(plan, procs, plan.big_model, "synthetic", big_setups, {"steps": plan.big_steps})
    return figures
