"""ps-reshard: a checkpoint set written by N shards restores onto M shards, and the job goes on exactly as if it
had never stopped: the same weights, rows and optimizer state, so the next update moves them identically."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from support.jobs import push_each
from support.references import local_adam
from torch import nn

from paramserver.config import ServerConfig
from paramserver.placement import SLICE_ELEMENTS, place
from paramserver.server.cluster import LocalCluster
from paramserver.shard.durability import checkpoint
from paramserver.shard.reshard import ReshardError, main, reshard
from worker import PSClient, SparseEmbedding

pytestmark = pytest.mark.timeout(60)

N, DIM = 64, 8
WIDE = 1100  # the wide layer's weight has 1.1 M elements: above SLICE_ELEMENTS, so each shard holds a slice of it


def _config(directory: Path) -> ServerConfig:
    return ServerConfig(
        mode="sync", workers=1, optimizer="adam", lr=0.01, checkpoint_dir=str(directory), checkpoint_every="0"
    )


def _files(directory: Path) -> dict[str, str]:
    """Every file in `directory` by name, with the sha256 of its bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


# -- a dense model with a sliced tensor and a sparse table, from a live 2-shard job onto 3 shards ------------------


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wide = nn.Linear(WIDE, 1000)
        self.head = nn.Linear(1000 + DIM, 1)
        self.item = SparseEmbedding(dim=DIM, num_embeddings=N, init_scale=0.3, seed=7)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([torch.relu(self.wide(x)), self.item(ids)], 1)).squeeze(-1)


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, WIDE, generator=g), (torch.rand(8, generator=g) ** 2 * N).long(), torch.randn(8, generator=g))
        for _ in range(steps)
    ]


def _step(client: PSClient, model: Net, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    x, ids, y = batch
    model.zero_grad(set_to_none=True)
    ((model(x, ids) - y) ** 2).mean().backward()
    client.push_pull(model)


def _dense(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_two_shard_set_restores_onto_three_shards_and_the_next_update_is_identical(
    tmp_path: Path, ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    assert WIDE * 1000 > SLICE_ELEMENTS
    src, dst = tmp_path / "two", tmp_path / "three"
    batches = _batches(5)
    # The reference job runs on, uninterrupted. Its checkpoint_every=0 leaves the Init's checkpoint (version 0) and
    # the write-ahead log of every version after it: the reshard replays the log, as a restarted shard would.
    reference = ps_cluster_factory(_config(src), 2)
    ref_client = PSClient(reference.address)
    model = Net(seed=0)
    ref_client.register(model)
    for batch in batches[:4]:
        _step(ref_client, model, batch)
    before = _files(src)

    report = reshard(src, dst, 3)
    assert (report.source_shards, report.target_shards, report.version) == (2, 3, 4)
    assert report.source_versions == (4, 4) and report.replayed == (4, 4)
    assert list(report.paths) == [checkpoint.list_checkpoints(dst, j)[0] for j in range(3)]
    assert report.bytes == sum(p.stat().st_size for p in report.paths) and report.seconds > 0
    assert _files(src) == before, "the source set is only read"
    snaps = [checkpoint.load(p) for p in report.paths]
    specs = snaps[0].specs
    assert snaps[0].digest == place(specs, 3, tables=snaps[0].table_specs).digest
    assert all(len(place(specs, 3).shards[j]) for j in range(3)) and any(
        p.name == "wide.weight" and p.length < WIDE * 1000 for p in place(specs, 3).shards[2]
    ), "the wide weight is cut into three slices"
    rows = [s.tables[0]["ids"] for s in snaps]
    assert sum(len(r) for r in rows) > N // 4 and all(len(r) for r in rows), "the rows spread over the new shards"

    resharded = ps_cluster_factory(_config(dst), 3)
    client = PSClient(resharded.address)
    fresh = Net(seed=1)  # other initial weights: registering adopts what the shards hold
    assert client.register(fresh) == 4
    for name, value in _dense(model).items():
        assert torch.equal(_dense(fresh)[name], value), name
    all_ids = np.arange(N, dtype=np.int64)
    assert np.array_equal(client.lookup(fresh, 0, all_ids), ref_client.lookup(model, 0, all_ids))

    # One more identical step on both: the optimizer state came along (a fresh Adam would move them otherwise).
    _step(ref_client, model, batches[4])
    _step(client, fresh, batches[4])
    assert client.versions == [5, 5, 5]
    for name, value in _dense(model).items():
        torch.testing.assert_close(_dense(fresh)[name], value, atol=1e-7, rtol=0, msg=name)
    np.testing.assert_allclose(client.lookup(fresh, 0, all_ids), ref_client.lookup(model, 0, all_ids), atol=1e-7)
    client.close()
    ref_client.close()


# -- a stopped 3-shard job onto 2 shards; refusals and the command line -----------------------------------------


def _model_and_gradients(steps: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(7)
    model = {
        "a": torch.randn(40, 3, generator=gen),
        "b": torch.randn(7, generator=gen),
        "c": torch.randn(5, 5, generator=gen),
        "d": torch.randn(30, generator=gen),
    }
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in model.items()} for _ in range(steps)]
    return model, grads


def _stopped_set(
    factory: Callable[..., LocalCluster], directory: Path, shards: int, steps: int
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Train `steps` steps on `shards` shards, then stop them (each writes its final checkpoint)."""
    init, grads = _model_and_gradients(steps + 1)
    model = {k: v.clone() for k, v in init.items()}
    cluster = factory(_config(directory), shards)
    assert push_each(cluster.address, model, grads[:steps]) == [steps] * shards
    cluster.stop()
    return init, grads, model


def test_a_stopped_three_shard_set_restores_onto_two_shards(
    tmp_path: Path, ps_cluster_factory: Callable[..., LocalCluster], capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = tmp_path / "three", tmp_path / "two"
    init, grads, model = _stopped_set(ps_cluster_factory, src, 3, 6)
    before = _files(src)
    dst.mkdir()  # an empty target is taken
    assert main([str(src), str(dst), "--shards", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("resharded ") and "(3 shards)" in line and "(2 shards) at version 6" in line, line
    assert _files(src) == before
    assert [len(checkpoint.list_checkpoints(dst, j)) for j in range(3)] == [1, 1, 0]
    assert len(list(dst.iterdir())) == 2, "the new set and nothing else"
    snaps = [checkpoint.load_latest(dst, j) for j in range(2)]
    assert all(s is not None and s.num_shards == 2 and s.version == 6 for s in snaps)

    fresh = {k: torch.zeros_like(v) for k, v in init.items()}
    cluster = ps_cluster_factory(_config(dst), 2)
    assert push_each(cluster.address, fresh, []) == [6, 6]
    for k in model:
        assert torch.equal(fresh[k], model[k]), k
    assert push_each(cluster.address, fresh, grads[6:]) == [7, 7]
    expected = local_adam(init, grads, 0.01)
    for k in fresh:
        torch.testing.assert_close(fresh[k], expected[k], atol=1e-6, rtol=0)
        assert not torch.equal(fresh[k], model[k]), "the step after the reshard moves the weights"


def test_shards_at_different_versions_are_refused_unless_allowed(
    tmp_path: Path, ps_cluster_factory: Callable[..., LocalCluster], capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "two"
    _stopped_set(ps_cluster_factory, src, 2, 3)
    checkpoint.list_checkpoints(src, 1)[0].unlink()  # shard 1 falls back to the Init's checkpoint, version 0
    before = _files(src)

    with pytest.raises(ReshardError, match=r"not one consistent cut: shard 0 at version 3, shard 1 at version 0"):
        reshard(src, tmp_path / "out", 3)
    assert not (tmp_path / "out").exists()
    assert main([str(src), str(tmp_path / "out"), "--shards", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ps-reshard: error: the shards in") and err.count("\n") == 1, err
    assert "--allow-mixed" in err

    report = reshard(src, tmp_path / "out", 3, allow_mixed=True)
    assert report.version == 3 and report.source_versions == (3, 0)
    assert any("shard 0 at version 3, shard 1 at version 0" in note for note in report.notes), report.notes
    assert _files(src) == before

    # Never over another set, and never a missing source.
    with pytest.raises(ReshardError, match="not an empty directory"):
        reshard(src, tmp_path / "out", 2)
    assert main([str(tmp_path / "nothing"), str(tmp_path / "new"), "--shards", "2"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "--allow-mixed" in capsys.readouterr().out
