"""The recsys demo's last act: `ps-serve` follows the job while it trains, then the DLRM is served from it and its
predictions are checked against the model the workers saved (`ps-worker --save-model`).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import torch

from worker.client.model_file import load
from worker.client.serving import ServingClient, serve
from worker.data.stream import StreamedDataset
from worker.demos.common import stop
from worker.models.clicks import TableOptions, build_click_model

READY = "PS-SERVE-READY"


class PsServe:
    """A `ps-serve --server ADDRESS --port 0` process, started now: it waits for the job's model, then follows it."""

    def __init__(self, address: str) -> None:
        cmd = [sys.executable, "-m", "paramserver.serving.cli", "--server", address, "--port", "0", "--wait", "600"]
        print(f"$ ps-serve --server {address} --port 0", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.address = ""
        self._ready = threading.Event()
        threading.Thread(target=self._relay, name="ps-serve-stdout", daemon=True).start()

    def _relay(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(READY) and not self.address:
                self.address = f"127.0.0.1:{line.split()[1]}"
                self._ready.set()
            else:
                sys.stdout.write(line)
                sys.stdout.flush()
        self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> str:
        if not self._ready.wait(timeout) or not self.address:
            raise RuntimeError(f"ps-serve was not ready within {timeout:.0f} s (exit status {self.proc.poll()})")
        return self.address

    def stop(self) -> None:
        stop(self.proc)


def check_served(
    serving: str, job: str, dataset: str, saved: str, tables: TableOptions, seed: int, samples: int = 4096
) -> bool:
    """Predict held-out samples with the DLRM served from `serving` and with the one the workers saved; print both,
    the difference and the copies' freshness while the job trained; True when they are equal."""
    data = StreamedDataset(dataset)
    try:
        schema = data.manifest.schema
        assert schema is not None
        x, _ = next(iter(data.test_batches(samples)))
    finally:
        data.close()
    torch.manual_seed(seed)
    trained = load(build_click_model("dlrm", schema, tables), saved)
    with ServingClient(serving) as client:
        final = _job_versions(job)  # the job ended: its last version, which the copies reach within an interval
        deadline = time.monotonic() + 30
        while list(client.status().versions) != final and time.monotonic() < deadline:
            time.sleep(0.05)
        status = client.status()
        began = time.perf_counter()
        served = serve(build_click_model("dlrm", schema, tables), client)
        with torch.no_grad():
            want = torch.sigmoid(trained(x))
            got = torch.sigmoid(served(x))
        took = time.perf_counter() - began
    gap = float((got - want).abs().max())
    first = ", ".join(f"{p:.4f}" for p in got[:4].tolist())
    theirs = ", ".join(f"{p:.4f}" for p in want[:4].tolist())
    p50, p99 = status.freshness_p50 * 1e3, status.freshness_p99 * 1e3
    print(
        f"served (ps-serve at {serving}, following {job}): the first predictions {first}, the saved model's "
        f"{theirs}; max |difference| over {len(got):,} held-out samples {gap:.2e} (in {took:.2f} s with the pull); "
        f"freshness while the job trained, over {status.freshness_answers:,} answers: p50 {p50:.0f} ms, p99 "
        f"{p99:.0f} ms (a shard applied -> the copy did)",
        flush=True,
    )
    return gap <= 1e-5


def _job_versions(address: str) -> list[int]:
    """Every shard's version, asked of each shard."""
    import grpc

    from paramserver.v1 import ps_pb2, ps_pb2_grpc

    def ask(at: str) -> ps_pb2.Topology:
        with grpc.insecure_channel(at) as channel:
            return ps_pb2_grpc.ParameterServerStub(channel).GetTopology(ps_pb2.GetTopologyRequest(), timeout=10)

    return [int(ask(at).version) for at in ask(address).shards]
