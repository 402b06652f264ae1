"""The JavaScript client (clients/js/), written from ps.proto, SPEC.md and vectors.json alone, trains against real
shards; the weights it ends with are those the Python client then pulls from the shards.

Runs only with PS_JS=1 (`make js-test`, which installs node and the client's packages); then `node` must exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster

pytestmark = [
    pytest.mark.skipif(os.environ.get("PS_JS") != "1", reason="the JavaScript client runs with PS_JS=1 (make js-test)"),
    pytest.mark.timeout(300),
]

JS = Path(__file__).resolve().parent.parent / "clients" / "js"
LR = 0.1
STEPS = 50
SGD = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR)
# The tensors clients/js/train.js trains: names and shapes (and, with --big, one sliced over the shards).
MODEL = {"w": (8, 1), "b": (1,)}
BIG = ('emb.é"\\😀', (1_100_000,))
NODE_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.fail("PS_JS=1 but there is no `node` on PATH (make js-test installs nodejs)")
    if not (JS / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail(f"{JS}/node_modules is missing: run `npm ci` there (make js-test does)")
    return path


def run_node(node: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a script of clients/js; the process is killed on timeout and on any failure here."""
    proc = subprocess.Popen(
        [node, *args], cwd=JS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8"
    )
    try:
        out, err = proc.communicate(timeout=NODE_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def train(node: str, cluster: LocalCluster, *flags: str, steps: int = STEPS) -> dict[str, Any]:
    result = run_node(node, "train.js", "--server", cluster.address, "--steps", str(steps), "--timeout", "30", *flags)
    assert result.returncode == 0, f"train.js {flags} failed:\n{result.stderr}\n{result.stdout}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def pull_with_python(cluster: LocalCluster, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The shards' weights, pulled by the reference client (which computes placement and digest itself)."""
    from worker.client import PSClient

    tensors = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
    with PSClient(cluster.address, join=False) as client:
        assert client.pull(tensors) == STEPS
    return {name: t.reshape(-1).numpy() for name, t in tensors.items()}


def as_received(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as a client receives them in a wire dtype (SPEC.md section 4)."""
    if dtype == "bf16":
        return torch.from_numpy(values).bfloat16().float().numpy()
    if dtype == "fp16":
        return values.astype(np.float16).astype(np.float32)
    return values


def held_digests(cluster: LocalCluster) -> set[str]:
    return {server.shard.describe().digest for server in cluster.servers}


def test_check_vectors(node: str) -> None:
    result = run_node(node, "check_vectors.js")
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stdout.strip().endswith(" passed, 0 failed")


@pytest.mark.parametrize(
    ("flags", "transport"),
    [
        ((), "inline"),
        (("--streams",), "streams"),
        (("--dtype", "bf16"), "inline"),
        (("--dtype", "fp16", "--streams"), "streams"),
    ],
    ids=["inline", "streams", "inline-bf16", "streams-fp16"],
)
def test_js_client_trains(
    node: str, ps_cluster_factory: Callable[..., LocalCluster], flags: tuple[str, ...], transport: str
) -> None:
    cluster = ps_cluster_factory(SGD, shards=2)
    out = train(node, cluster, *flags)
    dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags else "float32"

    assert out["init"] == ["initialised", "initialised"]
    assert out["transport"] == [transport, transport]
    assert out["steps"] == STEPS and out["final_version"] == STEPS and out["versions"] == [STEPS, STEPS]
    assert out["final_loss"] * 10 <= out["initial_loss"], out
    assert out["mode"] == "SYNC" and out["rank"] == 0 and out["world_size"] == 1
    assert held_digests(cluster) == {out["digest"]}
    assert sorted(out["shard_elements"]) == [1, 8]  # w and b, whole, on different shards

    pulled = pull_with_python(cluster, MODEL)
    for name, values in pulled.items():
        js = np.array(out["weights"][name], dtype=np.float32)
        assert np.array_equal(js, as_received(values, dtype)), name
        if dtype == "float32":
            assert hashlib.sha256(values.tobytes()).hexdigest() == out["weights_sha256"][name]


def test_js_client_trains_a_tensor_sliced_over_the_shards(
    node: str, ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    """A tensor above the servers' slice size (1048576 elements) is cut over both shards; its parts are over the
    inline limit, so the client streams them; a name that needs every kind of escape in the digest."""
    cluster = ps_cluster_factory(SGD, shards=2)
    out = train(node, cluster, "--big")
    assert out["transport"] == ["streams", "streams"]
    assert out["shard_elements"] == [550_000 + 8, 550_000 + 1]
    assert out["final_version"] == STEPS
    assert out["final_loss"] * 10 <= out["initial_loss"], out
    assert held_digests(cluster) == {out["digest"]}

    pulled = pull_with_python(cluster, {**MODEL, BIG[0]: BIG[1]})
    for name, values in pulled.items():
        assert hashlib.sha256(values.tobytes()).hexdigest() == out["weights_sha256"][name], name
    for name in MODEL:
        assert np.array_equal(np.array(out["weights"][name], dtype=np.float32), pulled[name])


def test_init_with_a_wrong_digest_is_refused(node: str, ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(SGD, shards=2)
    out = train(node, cluster, "--bad-digest")
    assert [r["status"] for r in out["bad_digest"]] == ["FAILED_PRECONDITION", "FAILED_PRECONDITION"]
    assert [r["ps_error"] for r in out["bad_digest"]] == ["ModelMismatch", "ModelMismatch"]
    assert not any(server.shard.describe().initialized for server in cluster.servers)
    assert all(not server.shard.describe().live_workers for server in cluster.servers)  # it left
