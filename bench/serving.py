"""Serving: serving copies (ps-serve's code) following a job that trains a 26-table DLRM through `ps-worker` at full
speed, on 2 shards.

Public API only: planted Criteo day files (`worker.demos.planted`), `ps-prepare --format criteo`, shard processes
(`LocalCluster`), one `ps-worker --model dlrm --batch-size 2048` process, and the serving copies started in a
child with `paramserver.serving.server.serve` (what ps-serve runs), read with `Serving.Lookup`.

- cost to training: the trainer's samples/s (the shards' versions over a window x the batch) with 2 serving copies
  attached against none, in alternating windows of the same run (off, on, off, on, ...): the ratio of the medians.
  On this 2-core machine the copies' own CPU is taken from the trainer's; so the shards' CPU per 1,000 samples is
  measured too, which is what following costs a job whose copies run elsewhere.
- freshness: every answer a copy applies carries when the oldest version in it applied on its shard (the shard's
  wall clock; FollowMessage.Header.oldest_applied); the copy's clock when it applied the answer minus that, for
  every answer of both copies during the attached windows: a push's rows are visible at most this long after the
  shard applied them (the push is acknowledged after that). Same host: one clock.
- lookup latency: 26 IDs a request (one per table, the hot IDs of the planted logs' Zipf), paced at 300 and 1,000
  requests/s from another process for a few seconds while training goes on, and at 1,000/s once it is over: p50
  and p99 of the round trip, over gRPC (Serving.Lookup) and over the lookup socket (pipelined on one connection).
- cold start: a copy of one shard of a job whose bounded table holds 10 M rows (dim 16, the model's given initial
  rows), from the copy's start to ready (a whole state taken a page of slots at a time, then the changes since).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, Channel, Figure, Processes, child_env, cpu_seconds, log, median
from bench.plan import Plan

SECTION = "serving"
TIMEOUT = 300.0
BATCH = 2048
VIAS = ("grpc", "socket")  # the Serving service, and the lookup socket ServingClient prefers


def _sizes(plan: Plan) -> dict[str, Any]:
    if plan.quick:
        return {"samples": 60_000, "window": 2.0, "rounds": 1, "load_s": 1.0, "rates": (200,), "cold_rows": 100_000}
    return {
        "samples": 1_000_000,
        "window": 12.0,
        "rounds": 3,
        "load_s": 5.0,
        "rates": (300, 1000),
        "cold_rows": 10_000_000,
    }


# -- children ---------------------------------------------------------------------------------------------------


def _copies(chan: Channel, params: dict[str, Any]) -> None:
    """Serving copies of the job at params["address"] (every shard, or params["shards"]); messages: {"do":
    "freshness"} (the samples since the last, then cleared), anything else or stdin closed: stop."""
    from paramserver.serving.server import serve

    began = time.monotonic()
    server, copies, port = serve(params["address"], shards=params.get("shards"), interval=params.get("interval", 0.1))
    try:
        if not copies.wait_ready(TIMEOUT):
            raise RuntimeError("the serving copies were not ready in time")
        chan.send(
            "ready", port=port, seconds=time.monotonic() - began, rows=sum(c.rows for c in copies.copies.values())
        )
        while chan.recv().get("do") == "freshness":
            samples = []
            for c in copies.copies.values():
                samples += list(c.freshness)
                c.freshness.clear()
            chan.send("freshness", samples=samples)
    finally:
        copies.stop()
        server.stop(0).wait()


def _load(chan: Channel, params: dict[str, Any]) -> None:
    """Lookups of one ID per table (26 IDs a request), paced at params["rate"] a second for params["seconds"], over
    params["via"]: "grpc" (the Serving service) or "socket" (the lookup socket, pipelined on one connection); sends
    the round trips (s). Open loop: each request leaves at its time, whether the ones before have been answered or
    not (a closed loop would measure the server's pace, not its latency at the offered rate)."""
    import grpc
    import numpy as np

    from paramserver.v1 import ps_pb2, ps_pb2_grpc

    rng = np.random.default_rng(0)
    with grpc.insecure_channel(params["address"]) as channel:
        stub = ps_pb2_grpc.ServingStub(channel)
        status = stub.Status(ps_pb2.ServingStatusRequest())
        bound = np.array([t.num_embeddings or 1000 for t in status.tables], dtype=np.int64)
        requests = []
        for _ in range(256):
            ids = (rng.zipf(1.2, len(bound)) % np.minimum(bound, 1000)).astype("<i8")
            entries = [
                ps_pb2.ServingIds(table=t.name, ids=ids[k : k + 1].tobytes()) for k, t in enumerate(status.tables)
            ]
            requests.append(ps_pb2.LookupRequest(tables=entries))
        n = int(params["rate"] * params["seconds"])
        if params["via"] == "socket":
            took, began = _over_socket(params["address"], status.lookup_port, requests, n, 1.0 / params["rate"])
        else:
            took, began = _over_grpc(stub, requests, n, 1.0 / params["rate"])
        chan.send("latency", seconds=took, achieved=n / (time.perf_counter() - began))


def _over_grpc(stub: Any, requests: list[Any], n: int, interval: float) -> tuple[list[float], float]:
    for r in requests[:50]:  # warm-up
        stub.Lookup(r)
    took: list[float] = []
    pending = []
    began = time.perf_counter()
    for i in range(n):
        wait = began + i * interval - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        t0 = time.perf_counter()
        call = stub.Lookup.future(requests[i % len(requests)])
        call.add_done_callback(lambda _, t0=t0: took.append(time.perf_counter() - t0))
        pending.append(call)
    for call in pending:
        call.result()
    return took, began


def _over_socket(address: str, port: int, requests: list[Any], n: int, interval: float) -> tuple[list[float], float]:
    import socket
    import struct
    import threading

    frames = [struct.pack("<I", len(b)) + b for b in (r.SerializeToString() for r in requests)]
    sock = socket.create_connection((address.rpartition(":")[0], port), timeout=TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def answer() -> None:
        (length,) = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))
        body = sock.recv(length, socket.MSG_WAITALL)
        if body[:1] != b"\x00":
            raise RuntimeError(f"the lookup socket refused a request: {body[1:]!r}")

    with sock:
        for f in frames[:50]:  # warm-up
            sock.sendall(f)
            answer()
        sent: list[float] = []
        took: list[float] = []

        def read() -> None:
            for k in range(n):
                answer()
                took.append(time.perf_counter() - sent[k])

        reader = threading.Thread(target=read)
        began = time.perf_counter()
        reader.start()
        for i in range(n):
            wait = began + i * interval - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            sent.append(time.perf_counter())
            sock.sendall(frames[i % len(frames)])
        reader.join()
    return took, began


def _cold_job(chan: Channel, params: dict[str, Any]) -> None:
    """A worker that registers a model with one bounded table of params["rows"] x 16 (its given initial rows), then
    waits for stdin to close."""
    import torch
    from torch import nn

    from worker import PSClient, make_sparse

    torch.manual_seed(0)
    model = make_sparse(nn.Sequential(nn.Embedding(params["rows"], 16), nn.Linear(16, 1)))
    with PSClient(params["address"]) as client:
        began = time.monotonic()
        client.register(model)
        chan.send("registered", seconds=time.monotonic() - began)
        chan.recv()


ROLES = {"copies": _copies, "load": _load, "cold_job": _cold_job}


# -- the parent -------------------------------------------------------------------------------------------------


def _prepare(tmp: Path, samples: int) -> str:
    from worker.demos.planted import make_click_logs, write_criteo

    logs = make_click_logs(samples, max(10_000, samples // 20), seed=0)
    files = write_criteo(logs, tmp / "logs")
    del logs
    out = str(tmp / "criteo")
    cmd = [sys.executable, "-m", "worker.data.prepare", *map(str, files), "--format", "criteo", "--out", out]
    subprocess.run(
        [*cmd, "--shards", "4", "--no-progress"], check=True, cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL
    )
    return out


def _versions(address: str) -> int:
    import grpc

    from paramserver.v1 import ps_pb2, ps_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return int(
            ps_pb2_grpc.ParameterServerStub(channel).GetTopology(ps_pb2.GetTopologyRequest(), timeout=10).version
        )


def _window(cluster: Any, window: float) -> tuple[float, float]:
    """The trainer's samples/s over `window` seconds (shard 0's versions: one per step), and the shards' CPU seconds
    per 1,000 samples meanwhile (what following costs the shards themselves, wherever the copies run)."""
    pids = [p.pid for p in cluster.procs]
    v0, c0, t0 = _versions(cluster.addresses[0]), cpu_seconds(pids), time.monotonic()
    time.sleep(window)
    v1, c1, t1 = _versions(cluster.addresses[0]), cpu_seconds(pids), time.monotonic()
    samples = (v1 - v0) * BATCH
    return samples / (t1 - t0), (c1 - c0) / max(samples, 1) * 1000


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """Cost to training, freshness and lookup latency of 2 serving copies beside a DLRM job; a copy's cold start."""
    from paramserver.config import ServerConfig

    sizes = _sizes(plan)
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="ps-bench-serving-") as tmp:
        log("serving: click logs and ps-prepare")
        dataset = _prepare(Path(tmp), sizes["samples"])
        cluster = procs.cluster(ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.05), shards=2)
        address = cluster.address
        trainer = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "--server", address, "--dataset", dataset, "--model", "dlrm",
             "--batch-size", str(BATCH), "--epochs", "100", "--threads", "1", "--no-progress"],
            cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + TIMEOUT
            while _versions(address) < 20:  # registered and past its first steps
                if trainer.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the trainer did not start training (status {trainer.poll()})")
                time.sleep(0.5)
            off, on, off_cpu, on_cpu, fresh = [], [], [], [], []
            latency: list[Figure] = []
            for r in range(sizes["rounds"]):
                rate, cpu = _window(cluster, sizes["window"])
                off.append(rate)
                off_cpu.append(cpu)
                copies = [
                    procs.child(SECTION, "copies", {"address": address}, name=f"serving-copies-{k}") for k in (0, 1)
                ]
                ports = [c.expect("ready", TIMEOUT)["port"] for c in copies]
                for c in copies:
                    c.send(do="freshness")  # drop the samples of the catch-up
                    c.expect("freshness", 30)
                rate, cpu = _window(cluster, sizes["window"])
                on.append(rate)
                on_cpu.append(cpu)
                if r == 0:
                    for rate in sizes["rates"]:
                        for via in VIAS:
                            latency.append(_latency(procs, ports[0], rate, sizes["load_s"], "while training", via))
                for c in copies:
                    c.send(do="freshness")
                    fresh += c.expect("freshness", 30)["samples"]
                procs.close_children(copies)
                log(f"serving: round {r}: {off[-1]:,.0f} samples/s alone, {on[-1]:,.0f} with 2 copies")
        finally:
            trainer.terminate()
            trainer.wait(timeout=30)
        idle = procs.child(SECTION, "copies", {"address": address}, name="serving-copies-idle")
        port = idle.expect("ready", TIMEOUT)["port"]
        for via in VIAS:
            latency.append(_latency(procs, port, sizes["rates"][-1], sizes["load_s"], "training over", via))
        procs.close_children([idle])
    params = {"tables": 26, "batch": BATCH, "shards": 2, "copies": 2, "window_s": sizes["window"]}
    figures.append(
        Figure(f"{SECTION}.train.alone", SECTION, "DLRM samples/s, no serving copy", "samples/s", off, params)
    )
    alone = f"{SECTION}.train.alone"
    title = "DLRM samples/s, 2 serving copies following"
    figures.append(Figure(f"{SECTION}.train.copies", SECTION, title, "samples/s", on, params, compare=[alone]))
    title = "the shards' CPU s per 1,000 samples, no serving copy"
    figures.append(Figure(f"{SECTION}.shard_cpu.alone", SECTION, title, "s", off_cpu, params))
    title = "the shards' CPU s per 1,000 samples, 2 serving copies following"
    cpu_alone = [f"{SECTION}.shard_cpu.alone"]
    figures.append(Figure(f"{SECTION}.shard_cpu.copies", SECTION, title, "s", on_cpu, params, compare=cpu_alone))
    q = statistics.quantiles(fresh, n=100) if len(fresh) >= 2 else [float("nan")] * 99
    tails = {"p99_ms": q[98] * 1e3, "max_ms": max(fresh, default=0) * 1e3}
    title = "freshness p50 (shard applied -> copy applied)"
    answers = {**params, "answers": len(fresh)}
    figures.append(
        Figure(f"{SECTION}.freshness.p50", SECTION, title, "ms", [median(fresh) * 1e3], answers, extra=tails)
    )
    figures.append(Figure(f"{SECTION}.freshness.p99", SECTION, "freshness p99", "ms", [q[98] * 1e3], params))
    figures += latency
    figures.append(_cold_start(procs, sizes["cold_rows"]))
    return figures


def _latency(procs: Processes, port: int, rate: int, seconds: float, when: str, via: str) -> Figure:
    """Lookups of 26 IDs offered at `rate` a second to the copies on `port` over `via` (grpc, socket): their p99
    (p50 and the rate the generator reached in `extra`)."""
    params = {"address": f"127.0.0.1:{port}", "rate": rate, "seconds": seconds, "via": via}
    got = procs.child(SECTION, "load", params).expect("latency", TIMEOUT)
    took = got["seconds"]
    q = statistics.quantiles(took, n=100) if len(took) >= 2 else [float("nan")] * 99
    extra = {"p50_ms": median(took) * 1e3, "offered_per_s": got["achieved"]}
    key = "training" if when == "while training" else "idle"
    title = f"Lookup of 26 IDs at {rate}/s over {'gRPC' if via == 'grpc' else 'the lookup socket'}, {when}, p99"
    figure_params = {"rate": rate, "via": via}
    return Figure(
        f"{SECTION}.lookup.{via}.{key}.{rate}", SECTION, title, "ms", [q[98] * 1e3], figure_params, extra=extra
    )


def _cold_start(procs: Processes, rows: int) -> Figure:
    from paramserver.config import ServerConfig

    # One shard: the table's rows all on it. The limit on table memory raised to hold 10 M rows of dim 16 with
    # their Adagrad state.
    cluster = procs.cluster(ServerConfig(mode="async", workers=1, optimizer="adagrad", max_table_bytes=8 << 30), 1)
    job = procs.child(SECTION, "cold_job", {"address": cluster.address, "rows": rows}, name="serving-cold-job")
    registered = job.expect("registered", TIMEOUT)["seconds"]
    copy = procs.child(SECTION, "copies", {"address": cluster.address}, name="serving-cold-copy")
    began = time.monotonic()
    ready = copy.expect("ready", TIMEOUT)
    seconds = time.monotonic() - began
    log(f"serving: cold start of {ready['rows']:,} rows: {seconds:.1f} s (the job registered them: {registered:.1f} s)")
    procs.close_children([copy, job])
    return Figure(
        f"{SECTION}.cold_start", SECTION, f"a copy of {rows:,} rows (dim 16) ready", "s", [seconds],
        {"rows": rows, "dim": 16}, extra={"in_process_s": ready["seconds"], "register_s": registered},
    )  # fmt: skip
