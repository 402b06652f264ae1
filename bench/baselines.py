"""Baselines measured in the same run on the same machine, every one between processes on 127.0.0.1.

- tcp: plain loopback sockets; the client sends N bytes (the server answers one byte once it has them all) and
  asks for N bytes back, received with recv_into a preallocated buffer: the line rate any transport can reach.
- gloo: torch.distributed all_reduce of one float32 tensor over 2 processes, what DDP pays per step.
- rpc: a parameter server on torch.distributed.rpc (TensorPipe over TCP): one server process holds the tensor and
  applies SGD to each pushed gradient; 1 or 2 worker processes rpc_sync a push, then a pull that returns it.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import warnings
from datetime import timedelta
from typing import Any

from bench.common import Channel, Figure, Processes, free_port, gbps, log, ms, schedule
from bench.plan import MLP_PARAMS, Plan

SECTION = "baselines"
TIMEOUT = 600.0
LR = 0.01
_HEADER = struct.Struct("<cQ")  # op (b"U" upload, b"D" download, b"Q" quit), byte count


def _sizes(plan: Plan) -> list[tuple[str, int]]:
    """(label, float32 elements) of every payload the transport section measures."""
    sizes = list(plan.payloads.items())
    if plan.small_model:
        sizes.insert(0, ("340KB", MLP_PARAMS))
    return sizes


def _jobs(plan: Plan) -> list[list[Any]]:
    """(label, bytes, warmup, n) per payload, for the children."""
    return [[label, 4 * numel, *schedule(4 * numel, plan.repeats)] for label, numel in _sizes(plan)]


# -- raw TCP ----------------------------------------------------------------------------------------------------


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False on a clean end of stream before the first byte."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"stream ended after {got} of {len(view)} bytes")
        got += n
    return True


def _tcp_server(chan: Channel, params: dict[str, Any]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        chan.send("port", port=server.getsockname()[1])
        conn, _ = server.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(params["max_bytes"]))
        header = memoryview(bytearray(_HEADER.size))
        while _recv_exact(conn, header):
            op, n = _HEADER.unpack(header)
            if op == b"U":
                _recv_exact(conn, buf[:n])
                conn.sendall(b"k")
            elif op == b"D":
                conn.sendall(buf[:n])
            else:
                break


def _tcp_client(chan: Channel, params: dict[str, Any]) -> None:
    results = {}
    with socket.create_connection(("127.0.0.1", params["port"])) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(max(job[1] for job in params["jobs"])))
        ack = memoryview(bytearray(1))
        for label, nbytes, warmup, n in params["jobs"]:
            up, down = [], []
            for i in range(warmup + n):
                t0 = time.perf_counter()
                conn.sendall(_HEADER.pack(b"U", nbytes))
                conn.sendall(buf[:nbytes])
                _recv_exact(conn, ack)
                t1 = time.perf_counter()
                conn.sendall(_HEADER.pack(b"D", nbytes))
                _recv_exact(conn, buf[:nbytes])
                t2 = time.perf_counter()
                if i >= warmup:
                    up.append(t1 - t0)
                    down.append(t2 - t1)
            results[label] = {"up": up, "down": down}
        conn.sendall(_HEADER.pack(b"Q", 0))
    chan.send("result", results=results)


def _tcp(plan: Plan, procs: Processes) -> list[Figure]:
    jobs = _jobs(plan)
    server = procs.child(SECTION, "tcp_server", {"max_bytes": max(j[1] for j in jobs)}, name="tcp-server")
    port = server.expect("port", TIMEOUT)["port"]
    client = procs.child(SECTION, "tcp_client", {"port": port, "jobs": jobs}, name="tcp-client")
    results = client.expect("result", TIMEOUT)["results"]
    procs.close_children([client, server])
    figures = []
    for label, nbytes, warmup, _ in jobs:
        up, down = results[label]["up"], results[label]["down"]
        params = {"payload": label, "bytes": nbytes}
        figures.append(
            Figure(
                f"{SECTION}.tcp.rt.{label}",
                SECTION,
                f"raw TCP, send {label} and receive {label} back",
                "ms",
                ms([a + b for a, b in zip(up, down, strict=True)]),
                params,
                warmup,
            )
        )
        for way, times, what in (("up", up, "send (client to server)"), ("down", down, "receive (server to client)")):
            figures.append(
                Figure(
                    f"{SECTION}.tcp.{way}.{label}",
                    SECTION,
                    f"raw TCP, {what}, {label}",
                    "GB/s",
                    gbps(nbytes, times),
                    params,
                    warmup,
                )
            )
        log(f"baseline tcp {label}: {figures[-3].median:.2f} ms round trip")
    return figures


# -- gloo all_reduce --------------------------------------------------------------------------------------------


def _gloo(chan: Channel, params: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _quiet()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{params['port']}",
        rank=params["rank"],
        world_size=2,
        timeout=timedelta(seconds=TIMEOUT),
    )
    results = {}
    try:
        for label, nbytes, warmup, n in params["jobs"]:
            t = torch.full((nbytes // 4,), 0.5)
            times = []
            for i in range(warmup + n):
                dist.barrier()  # both ranks start each all_reduce together
                t0 = time.perf_counter()
                dist.all_reduce(t)
                dt = time.perf_counter() - t0
                t.mul_(0.5)
                if i >= warmup:
                    times.append(dt)
            results[label] = times
    finally:
        dist.destroy_process_group()
    chan.send("result", results=results)


def _gloo_figures(plan: Plan, procs: Processes) -> list[Figure]:
    jobs, port = _jobs(plan), free_port()
    ranks = [procs.child(SECTION, "gloo", {"port": port, "rank": r, "jobs": jobs}, name=f"gloo{r}") for r in (0, 1)]
    results = [r.expect("result", TIMEOUT)["results"] for r in ranks]
    procs.close_children(ranks)
    figures = []
    for label, nbytes, warmup, _ in jobs:
        figures.append(
            Figure(
                f"{SECTION}.gloo.{label}",
                SECTION,
                f"torch.distributed all_reduce (gloo, 2 processes), {label} float32",
                "ms",
                ms(results[0][label]),
                {"payload": label, "bytes": nbytes, "processes": 2},
                warmup,
            )
        )
        log(f"baseline gloo {label}: {figures[-1].median:.2f} ms")
    return figures


# -- a parameter server on torch.distributed.rpc ---------------------------------------------------------------

_PS: dict[str, Any] = {}  # the server's tensors by payload label
_LOCK = threading.Lock()
_BARRIER: list[threading.Barrier] = []


def _ps_push(label: str, grad: Any) -> None:
    """Apply SGD with a pushed gradient (runs on the server)."""
    with _LOCK:
        _PS[label].add_(grad, alpha=-LR)


def _ps_pull(label: str) -> Any:
    """Return the current tensor (runs on the server; serialised without a copy, as the cheapest PS would)."""
    return _PS[label]


def _ps_barrier() -> None:
    """Hold each worker until all have arrived, so the workers start each payload together."""
    _BARRIER[0].wait(timeout=TIMEOUT)


def _quiet() -> None:
    """Silence torch.distributed's deprecation warnings about its own internals (rpc.shutdown triggers one)."""
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")


def _rpc_options(port: int) -> Any:
    import torch.distributed.rpc as rpc

    # TCP only (uv transport, basic channel): the same kind of path as gRPC, not shared memory.
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        num_worker_threads=16,
        rpc_timeout=TIMEOUT,
        _transports=["uv"],
        _channels=["basic"],
    )


def _rpc_server(chan: Channel, params: dict[str, Any]) -> None:
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    _quiet()
    for label, nbytes, _, _ in params["jobs"]:
        _PS[label] = torch.zeros(nbytes // 4)
    _BARRIER.append(threading.Barrier(params["workers"]))
    rpc.init_rpc("ps", rank=0, world_size=params["workers"] + 1, rpc_backend_options=_rpc_options(params["port"]))
    rpc.shutdown()  # graceful: returns once every worker has shut down


def _rpc_worker(chan: Channel, params: dict[str, Any]) -> None:
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    _quiet()
    rank, world = params["rank"], params["workers"] + 1
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=_rpc_options(params["port"]))
    results = {}
    try:
        for label, nbytes, warmup, n in params["jobs"]:
            grad = torch.full((nbytes // 4,), 1e-3)
            rpc.rpc_sync("ps", _ps_barrier)
            push, pull = [], []
            for i in range(warmup + n):
                t0 = time.perf_counter()
                rpc.rpc_sync("ps", _ps_push, args=(label, grad))
                t1 = time.perf_counter()
                weights = rpc.rpc_sync("ps", _ps_pull, args=(label,))
                t2 = time.perf_counter()
                assert weights.numel() == grad.numel()
                if i >= warmup:
                    push.append(t1 - t0)
                    pull.append(t2 - t1)
            results[label] = {"push": push, "pull": pull}
    finally:
        rpc.shutdown()
    chan.send("result", results=results)


def _rpc_figures(plan: Plan, procs: Processes, workers: int) -> list[Figure]:
    jobs, port = _jobs(plan), free_port()
    common = {"port": port, "workers": workers, "jobs": jobs}
    kids = [procs.child(SECTION, "rpc_server", common, name="rpc-ps")]
    for rank in range(1, 1 + workers):
        kids.append(procs.child(SECTION, "rpc_worker", {**common, "rank": rank}, name=f"rpc-worker{rank}"))
    results = [k.expect("result", TIMEOUT)["results"] for k in kids[1:]]
    procs.close_children(kids)
    figures = []
    for label, nbytes, warmup, _ in jobs:
        per_worker = [[a + b for a, b in zip(r[label]["push"], r[label]["pull"], strict=True)] for r in results]
        rounds = [t for ts in per_worker for t in ts]  # each worker's own round trips, all of them
        figures.append(
            Figure(
                f"{SECTION}.rpc.rt.{label}.w{workers}",
                SECTION,
                f"torch.distributed.rpc parameter server, push (SGD) + pull, {label}, {workers} worker(s)",
                "ms",
                ms(rounds),
                {"payload": label, "bytes": nbytes, "workers": workers, "transport": "tensorpipe uv (TCP)"},
                warmup,
                extra={"per_worker_ms": [ms(ts) for ts in per_worker]} if workers > 1 else {},
            )
        )
        log(f"baseline rpc {label}, {workers} worker(s): {figures[-1].median:.2f} ms")
    return figures


ROLES = {
    "tcp_server": _tcp_server,
    "tcp_client": _tcp_client,
    "gloo": _gloo,
    "rpc_server": _rpc_server,
    "rpc_worker": _rpc_worker,
}


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """Raw TCP, gloo all_reduce and the rpc parameter server, on the payloads of the transport section."""
    figures = _tcp(plan, procs)
    figures += _gloo_figures(plan, procs)
    for workers in plan.rpc_workers:
        figures += _rpc_figures(plan, procs, workers)
    return figures
