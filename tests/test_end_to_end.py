"""End to end: real shards (threads and processes), real workers, the real commands."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.jobs import in_threads, shard_versions, start_ps_server, stop_job

from paramserver import LocalCluster, ServerConfig
from paramserver.placement import SLICE_ELEMENTS
from paramserver.server.cluster import PORT_LINE, READY_LINE
from paramserver.shard.optimizers import make_optimizer
from worker import PSClient
from worker.models.builtin import build_model

ROOT = Path(__file__).resolve().parents[1]


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # The first layer has more than SLICE_ELEMENTS weights, so it is cut across both shards.
    assert 1024 * 1100 > SLICE_ELEMENTS
    return torch.nn.Sequential(torch.nn.Linear(1024, 1100), torch.nn.Tanh(), torch.nn.Linear(1100, 10))


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw", "adagrad"])
def test_sync_two_workers_equal_local_training_on_the_combined_batch(ps_cluster_factory, optimizer):
    config = ServerConfig(mode="sync", workers=2, optimizer=optimizer, lr=0.05, weight_decay=0.01)
    cluster = ps_cluster_factory(config, shards=2)
    steps, batch = 4, 16
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(2 * batch, 1024, generator=gen), torch.randint(0, 10, (2 * batch,), generator=gen))
        for _ in range(steps)
    ]

    models = [_mlp(seed=0), _mlp(seed=0)]  # built here: torch's global RNG is not per thread

    def worker(rank: int) -> Callable[[], None]:
        def run() -> None:
            model = models[rank]
            with PSClient(cluster.address) as client:
                client.register(model)
                for x, y in data:
                    part = slice(rank * batch, (rank + 1) * batch)
                    model.zero_grad()
                    torch.nn.functional.cross_entropy(model(x[part]), y[part]).backward()
                    client.push(model)
                    client.pull(model)
                finals[rank] = {k: v.detach().clone() for k, v in model.state_dict().items()}

        return run

    finals: dict[int, dict[str, torch.Tensor]] = {}
    in_threads([worker(0), worker(1)])

    def combined_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, split: bool) -> torch.Tensor:
        if not split:
            return torch.nn.functional.cross_entropy(model(x), y)
        # The same mean over the combined batch, summed per half as the workers do: equal in exact arithmetic,
        # and equal in float too, which Adam's g / sqrt(v) needs for near-zero gradients.
        halves = [slice(0, batch), slice(batch, 2 * batch)]
        return sum(0.5 * torch.nn.functional.cross_entropy(model(x[h]), y[h]) for h in halves)

    def local_training(split: bool) -> torch.nn.Module:
        model = _mlp(seed=0)
        template = make_optimizer(config, torch.zeros(1))
        opt = type(template)(
            model.parameters(),
            **{k: v for k, v in template.defaults.items() if k in ("lr", "momentum", "weight_decay", "fused")},
        )
        for x, y in data:
            opt.zero_grad()
            combined_loss(model, x, y, split).backward()
            opt.step()
        return model

    references = [local_training(split=True)]
    if optimizer in ("sgd", "momentum"):  # elementwise-linear: no g / sqrt(v) to amplify summation order
        references.append(local_training(split=False))
    for reference in references:
        for name, value in reference.state_dict().items():
            for rank in (0, 1):
                torch.testing.assert_close(
                    finals[rank][name], value, atol=1e-5, rtol=0, msg=lambda m, n=name, r=rank: f"{n} on rank {r}: {m}"
                )
    assert all(s.version == steps for s in cluster.shards)


def test_sync_pull_after_push_returns_the_round_that_includes_it(ps_cluster_factory):
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=1.0), shards=1)
    tensors = [{"w": torch.zeros(3)}, {"w": torch.zeros(3)}]
    clients = [PSClient(cluster.address) for _ in range(2)]
    try:
        for c, t in zip(clients, tensors, strict=True):
            c.register(t)
        clients[0].push({"w": torch.tensor([1.0, 2.0, 3.0])})
        pulled: list[int] = []
        waiter = threading.Thread(target=lambda: pulled.append(clients[0].pull(tensors[0])))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "the pull must wait for the round to close"
        clients[1].push({"w": torch.tensor([3.0, 2.0, 1.0])})
        waiter.join(10)
        assert pulled == [1]
        torch.testing.assert_close(tensors[0]["w"], torch.tensor([-2.0, -2.0, -2.0]))  # 0 - 1.0 * mean
    finally:
        for c in clients:
            c.close()


def test_async_applies_each_push_on_arrival(ps_cluster_factory):
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.5), shards=2)
    with PSClient(cluster.address) as a, PSClient(cluster.address) as b:
        t = {"w": torch.zeros(4), "b": torch.zeros(2)}
        a.register(t)
        assert {a.rank, b.rank} == {0, 1}
        a.push({"w": torch.ones(4), "b": torch.ones(2)})
        b.push({"w": torch.ones(4), "b": torch.ones(2)})
        assert b.pull(t) == 2  # no round: each shard applied each push on arrival
        torch.testing.assert_close(t["w"], torch.full((4,), -1.0))
        torch.testing.assert_close(t["b"], torch.full((2,), -1.0))


def test_100m_parameter_model_registers_pushes_and_pulls_in_chunks(ps_cluster_factory):
    """400 MB of float32: far above any gRPC message limit, so this only works if everything is chunked."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.5), shards=2)
    sizes = {"embedding": 60_000_000, "dense.weight": 30_000_000, "dense.bias": 9_999_000, "head": 1_000}
    assert sum(sizes.values()) == 99_999_000 + 1_000
    model = {name: torch.full((n,), 1.0) for name, n in sizes.items()}
    with PSClient(cluster.address) as client:
        client.register(model)
        grads = {name: torch.full((n,), 2.0) for name, n in sizes.items()}
        grads["embedding"][-1] = 4.0
        client.push(grads)
        del grads
        for t in model.values():
            t.zero_()
        assert client.pull(model) == 1
    for name, t in model.items():
        # 1 - 0.5 * 2 everywhere, except the embedding's last element: 1 - 0.5 * 4.
        assert float(t[:-1].max()) == 0.0 and float(t[:-1].min()) == 0.0, name
        assert float(t[-1]) == (-1.0 if name == "embedding" else 0.0), name
    # Both shards hold a share of the 400 MB: the embedding is sliced.
    held = [s.model.numel for s in cluster.shards]
    assert sum(held) == sum(sizes.values()) and min(held) > 40_000_000


def test_shard_processes_train_and_stop(tmp_path):
    config = ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1)
    with LocalCluster(config, shards=2, processes=True) as cluster:
        assert len(cluster.addresses) == 2 and cluster.poll() == [None, None]
        torch.manual_seed(0)
        model = build_model("logreg", in_shape=(8,), num_classes=2)
        x = torch.randn(64, 8)
        y = (x[:, 0] > 0).long()
        with PSClient(cluster.address) as client:
            client.register(model)
            for _ in range(30):
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                client.push(model)
                client.pull(model)
            assert min(client.versions) == 30
        procs = cluster.procs
    assert [p.returncode for p in procs] == [0, 0], "SIGTERM must stop shards cleanly"


def test_a_shard_process_serves_only_once_torchs_optimizer_code_is_imported(tmp_path):
    """torch's first optimizer in a process imports torch._dynamo (most of a second on 2 cores): a shard process
    does that before it serves, not in the first worker's Init, which every registering worker would wait for."""
    stderr = (tmp_path / "stderr").open("w")  # a file, not a pipe: -X importtime writes more than a pipe holds
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "paramserver.server.cli", "--shard-index", "0", "--peers-from-stdin"]
        + ["--host", "127.0.0.1", "--port", "0", "--log-level", "INFO"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        port = next(line.split()[-1] for line in proc.stdout if line.startswith(PORT_LINE))
        proc.stdin.write(f"127.0.0.1:{port}\n")
        proc.stdin.flush()
        assert any(line.startswith(READY_LINE) for line in proc.stdout)
    finally:
        proc.terminate()
        proc.wait(30)
        stderr.close()
    lines = (tmp_path / "stderr").read_text().splitlines()
    imported = [i for i, line in enumerate(lines) if line.rstrip().endswith("| torch._dynamo")]
    serving = [i for i, line in enumerate(lines) if "serving on port" in line]
    assert imported and serving, "\n".join(lines[-20:])
    assert imported[0] < serving[0], "the shard served before torch's optimizer code was imported"


def test_a_new_worker_resumes_from_the_servers_state(ps_cluster_factory):
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=1.0), shards=2)
    with PSClient(cluster.address) as first:
        first.register({"w": torch.zeros(5)})
        first.push({"w": torch.ones(5)})
    fresh = {"w": torch.full((5,), 7.0)}  # its own initial values must be ignored: the servers hold the model
    with PSClient(cluster.address) as second:
        assert second.register(fresh) == 1
        torch.testing.assert_close(fresh["w"], torch.full((5,), -1.0))
        assert second.rank == 0


# sync, and async with overlap: make test stays under 6 minutes with the replica and dataset tests. ssp's policy is
# covered in-process (test_staleness, test_consistent_reads), and `make demo MODE=ssp` trains with it.
@pytest.mark.parametrize(("mode", "overlap"), [("sync", False), ("async", True)])
def test_ps_server_and_two_ps_workers_reach_the_accuracy_target(tmp_path, mode, overlap):
    server, address = start_ps_server("--shards", "2", "--mode", mode, "--workers", "2")
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(2):
            cmd = [
                sys.executable,
                "-m",
                "worker.cli",
                "--server",
                address,
                "--no-progress",
                "--metrics-out",
                str(tmp_path / "w.json"),  # one path for both: each writes its rank's, w-0.json and w-1.json
            ]
            if i == 0:
                cmd += ["--save-model", str(tmp_path / "model.safetensors")]
            if overlap:
                # Each gradient a step staler, and staler still where a busy machine lets one worker run ahead:
                # twice the default epochs (after 10: 0.92 under two busy loops, once 0.936 on an idle machine).
                cmd += ["--overlap", "--epochs", "20"]
            workers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outputs = [w.communicate(timeout=240) for w in workers]
        for w, (out, err) in zip(workers, outputs, strict=True):
            assert w.returncode == 0, err.decode()
            assert b"test accuracy" in out
        versions = shard_versions(address)  # what every shard applied, once both workers are done
    finally:
        stop_job(server, workers)
    metrics = [json.loads((tmp_path / f"w-{rank}.json").read_text()) for rank in range(2)]
    assert [m["rank"] for m in metrics] == [0, 1] and not (tmp_path / "w.json").exists()
    for m in metrics:
        assert m["mode"] == mode and m["steps"] > 0 and 0 < m["samples"] <= m["steps"] * 32
        assert m["test_accuracy"] >= 0.95, m
        for key in ("seconds", "samples_per_second", "final_loss", "server_version"):
            assert key in m
        assert m["finished_at"] - m["started_at"] == pytest.approx(m["seconds"], abs=1e-3)
    assert all(m["config"]["overlap"] is overlap for m in metrics)
    if mode == "sync":  # every round needs both workers, so their training spans overlap
        assert max(m["started_at"] for m in metrics) < min(m["finished_at"] for m in metrics)
    else:
        # Every push applied exactly once on every shard (none refused: no --max-staleness), overlapped or not.
        # (Not what the workers' last pulls saw: two last pushes may reach the two shards in opposite orders.)
        assert all(m["stale_pushes"] == 0 for m in metrics)
        assert versions == [sum(m["steps"] for m in metrics)] * 2, versions
    state = load_file(tmp_path / "model.safetensors")
    model = build_model("cnn", in_shape=(1, 8, 8), num_classes=10)
    model.load_state_dict(state)


def test_ps_worker_reports_bad_flags_clearly(ps_cluster):
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", "--server", ps_cluster.address, "--model", "nosuchmodel", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "nosuchmodel" in result.stderr and "mlp" in result.stderr


def test_ps_server_refuses_a_bad_mode():
    result = subprocess.run(
        [sys.executable, "-m", "paramserver.server.cli", "--mode", "bogus"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "bogus" in result.stderr


def test_generated_code_matches_the_proto(tmp_path):
    import importlib.resources

    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{ROOT / 'protos'}",
        f"-I{importlib.resources.files('grpc_tools') / '_proto'}",  # descriptor.proto, for the bound options
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        str(ROOT / "protos/paramserver/v1/ps.proto"),
    ]
    assert protoc.main(args) == 0
    for name in ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py"):
        fresh = (tmp_path / "paramserver/v1" / name).read_text()
        committed = (ROOT / "paramserver/v1" / name).read_text()
        assert fresh == committed, f"paramserver/v1/{name} is stale: run `make proto` and commit"


def test_ps_cluster_fixture_is_offered_to_users(pytester):
    pytester.makepyfile(
        """
        import torch
        from worker import PSClient

        def test_users_own_code(ps_cluster):
            with PSClient(ps_cluster.address) as client:
                model = {"w": torch.ones(3)}
                client.register(model)
                client.push({"w": torch.ones(3)})
                client.pull(model)
            assert torch.allclose(model["w"], torch.full((3,), 0.9))
        """
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
