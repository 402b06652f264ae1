"""Transport (ours): one push + pull round trip of a dense float32 model against real shard processes.

Public API only: `LocalCluster(ServerConfig(mode="sync", ...), shards=S, processes=True)` and `PSClient`. Every
worker is a process of its own (`worker` role below), started while the shards start, so its imports cost no
wall time; all workers register, then start together on the parent's "go".

Each case runs on three paths, all measured on this one machine: "shm" (the default for a worker on the shards'
host: shared memory plus the Unix-socket doorbell); "socket" (the default for a worker on another host: the
shard's TCP data socket, `PSClient(shared_memory=False)`, here over loopback); and the gRPC streams ("float32",
`PSClient(shared_memory=False, data_socket=False)`: a shard that serves no data socket, or a port not opened).
"socket-bf16" and "bf16" are the last two with the bf16 wire; "socket-tls" and "float32-tls" are the same two on
shards that serve TLS (a throwaway PKI from `paramserver.testing.make_pki`): what encryption costs each path.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from bench.common import Channel, Figure, Processes, gbps, log, median, ms, schedule
from bench.plan import MLP_PARAMS, Plan

SECTION = "transport"
WIRES = ("shm", "socket", "float32")  # every case; the bf16 wires on one
PATHS = {
    "shm": "shared memory + doorbell",
    "socket": "data socket (TCP), float32 wire",
    "socket-bf16": "data socket (TCP), bf16 wire",
    "float32": "gRPC streams, float32 wire",
    "bf16": "gRPC streams, bf16 wire",
    "socket-tls": "data socket (TCP) with TLS, float32 wire",
    "float32-tls": "gRPC streams with TLS, float32 wire",
}
TLS_WIRES = ("socket-tls", "float32-tls")
LR = 0.01
TIMEOUT = 600.0


def dense_tensors(numel: int, parts: int = 4) -> list[tuple[str, int]]:
    """A dense model of `numel` float32 parameters as `parts` equal named tensors (the last takes the rest)."""
    size = numel // parts
    return [(f"layer{i}.weight", size if i < parts - 1 else numel - size * (parts - 1)) for i in range(parts)]


# -- the worker process -----------------------------------------------------------------------------------------


def _worker(chan: Channel, params: dict[str, Any]) -> None:
    """Register a model, then time `n` push + pull rounds after `warmup` rounds, once per job message."""
    import torch

    from worker import PSClient

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if params.get("model") == "mlp":
        from worker.models.builtin import build_model

        net = build_model("mlp", in_shape=(1, 8, 8), num_classes=10)
        model = {name: p.detach().clone() for name, p in net.named_parameters()}
    else:
        model = {name: torch.randn(n) for name, n in params["tensors"]}
    grads = {name: torch.full_like(t, 1e-3) for name, t in model.items()}
    while True:
        job = chan.recv()
        push, pull, fused = [], [], []
        wire = job["wire"]
        with PSClient(
            job["address"],
            dtype="bf16" if wire.endswith("bf16") else "float32",
            shared_memory=wire == "shm",
            data_socket=wire.startswith("socket"),
            tls_ca=job.get("tls_ca"),
        ) as client:
            client.register(model)
            chan.send("registered", rank=client.rank)
            chan.recv()  # go: every worker has registered
            for i in range(job["warmup"] + job["n"]):
                t0 = time.perf_counter()
                client.push(grads)
                t1 = time.perf_counter()
                client.pull(model)
                t2 = time.perf_counter()
                if i >= job["warmup"]:
                    push.append(t1 - t0)
                    pull.append(t2 - t1)
            for _ in range(job["n"]):  # what a training step does: push_pull, one exchange per shard
                t0 = time.perf_counter()
                client.push_pull(grads)
                fused.append(time.perf_counter() - t0)
        chan.send("result", push=push, pull=pull, fused=fused)


ROLES = {"worker": _worker}


# -- the parent -------------------------------------------------------------------------------------------------


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """Measure every payload x shards x workers case, the bf16 wire, TLS, and the digits MLP."""
    figures: list[Figure] = []
    for label, numel in plan.payloads.items():
        for shards in plan.transport_shards:
            for workers in plan.transport_workers:
                dtypes = list(WIRES)
                special = label == plan.bf16_payload and shards == 2 and workers == 1
                if special:
                    dtypes += ["socket-bf16", "bf16"]  # the same cluster and model, further clients
                spec = {"tensors": dense_tensors(numel)}
                figures += _case(procs, plan, label, numel, spec, shards, workers, dtypes)
                if special:
                    with tempfile.TemporaryDirectory(prefix="bench-pki-") as d:
                        figures += _case(procs, plan, label, numel, spec, shards, workers, list(TLS_WIRES), d)
    if plan.small_model:
        figures += _case(procs, plan, "340KB", MLP_PARAMS, {"model": "mlp"}, 2, 1, list(WIRES))
    return figures


def _case(
    procs: Processes,
    plan: Plan,
    label: str,
    numel: int,
    spec: dict[str, Any],
    shards: int,
    workers: int,
    dtypes: list[str],
    pki_dir: str | None = None,
) -> list[Figure]:
    """One cluster and its workers, timed on each of `dtypes` in turn; with `pki_dir`, the shards serve TLS with a
    throwaway PKI written there."""
    from paramserver import ServerConfig
    from paramserver.testing import make_pki

    nbytes = 4 * numel
    warmup, n = schedule(nbytes, plan.repeats)
    config = ServerConfig(mode="sync", workers=workers, optimizer="sgd", lr=LR)
    tls: dict[str, str] = {}
    if pki_dir is not None:
        pki = make_pki(pki_dir)
        config = config.replace(tls_cert=pki["server_cert"], tls_key=pki["server_key"])
        tls = {"tls_ca": pki["ca"]}
    kids = [procs.child(SECTION, "worker", spec, name=f"transport-worker{r}") for r in range(workers)]
    cluster = procs.cluster(config, shards)
    procs.settle()
    figures = []
    try:
        for dtype in dtypes:
            for k in kids:
                k.send(address=cluster.address, wire=dtype, warmup=warmup, n=n, **tls)
            for k in kids:
                k.expect("registered", TIMEOUT)
            for k in kids:
                k.send(go=True)
            results = [k.expect("result", TIMEOUT) for k in kids]
            case = _figures(label, nbytes, shards, workers, dtype, warmup, results)
            figures += case
            log(f"transport {label}, {shards} shard(s), {workers} worker(s), {dtype}: {case[0].median:.2f} ms")
    finally:
        procs.close_children(kids)
        procs.stop_soon(cluster)
    return figures


def _figures(
    label: str, nbytes: int, shards: int, workers: int, dtype: str, warmup: int, results: list[dict[str, Any]]
) -> list[Figure]:
    params = {"payload": label, "bytes": nbytes, "shards": shards, "workers": workers, "wire": dtype, "mode": "sync"}
    key = f"{label}.s{shards}.w{workers}.{dtype}"
    plain = key.removesuffix("-tls")  # a TLS path compares with the same path in the clear, too
    also = [] if plain == key else [plain]
    per_worker = [[p + q for p, q in zip(r["push"], r["pull"], strict=True)] for r in results]
    rounds = [t for ts in per_worker for t in ts]  # each worker's own round trips, all of them
    path = PATHS[dtype]
    rt = Figure(
        id=f"{SECTION}.rt.{key}",
        section=SECTION,
        title=f"push + pull round trip, {label}, {shards} shard(s), {workers} worker(s), {path}",
        unit="ms",
        repeats=ms(rounds),
        params=params,
        warmup=warmup,
        compare=[
            f"baselines.tcp.rt.{label}",
            f"baselines.rpc.rt.{label}.w{workers}",
            f"baselines.gloo.{label}",
            *(f"{SECTION}.rt.{k}" for k in also),
        ],
        extra={"per_worker_ms": [ms(ts) for ts in per_worker]} if workers > 1 else {},
    )
    fused = Figure(
        id=f"{SECTION}.step.{key}",
        section=SECTION,
        title=f"push_pull (one exchange per shard), {label}, {shards} shard(s), {workers} worker(s), {path}",
        unit="ms",
        repeats=ms([t for r in results for t in r["fused"]]),
        params=params,
        warmup=0,
        compare=[f"baselines.gloo.{label}", *(f"{SECTION}.step.{k}" for k in also)],
    )
    if workers > 1:
        return [rt, fused]
    push, pull = results[0]["push"], results[0]["pull"]
    wire_bytes = nbytes // 2 if dtype.endswith("bf16") else nbytes
    extra = {"model_bytes": nbytes, "wire_bytes": wire_bytes}
    figures = [rt, fused]
    for what, times, base in (("push", push, "up"), ("pull", pull, "down")):
        figures.append(
            Figure(
                id=f"{SECTION}.{what}.{key}",
                section=SECTION,
                title=f"{what} alone, float32 model bytes per second, {label}, {shards} shard(s), {path}",
                unit="GB/s",
                repeats=gbps(nbytes, times),
                params=params,
                warmup=warmup,
                compare=[f"baselines.tcp.{base}.{label}", *(f"{SECTION}.{what}.{k}" for k in also)],
                extra={**extra, "ms": ms(times), "wire_gb_per_s": median(gbps(wire_bytes, times))},
            )
        )
    return figures
