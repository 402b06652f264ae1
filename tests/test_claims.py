"""Dataset claims (ps-worker --follow): the record on shard 0 of which worker trains each dataset shard. Claims ride
the shard's updates, so the write-ahead log, checkpoints and a backup keep them; a worker that leaves or goes silent
frees what it held; bad requests are refused with their status and change nothing; an idle worker is out of the
sync rounds' count until it pushes again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from paramserver.config import ServerConfig
from paramserver.errors import ClaimNotHeld, InvalidArgument, NotClaimShard, OtherDataset, UnknownWorker, WrongJob
from paramserver.placement import TensorSpec, place
from paramserver.server import standby
from paramserver.server.cluster import LocalCluster
from paramserver.shard.claims import DONE, FREE, HELD, Claims
from paramserver.shard.durability import wal
from paramserver.shard.state import Shard
from paramserver.shard.update import Update
from paramserver.v1 import ps_pb2, ps_pb2_grpc

pytestmark = pytest.mark.timeout(60)

ADDRESSES = ("a:1", "b:2")
SPECS = [TensorSpec("w", (6, 5)), TensorSpec("b", (7,))]
DS = "clicks:0123abcd"


def _start(config: ServerConfig, index: int = 0, workers: tuple[str, ...] = ("w",)) -> Shard:
    """Shard `index` of a 2-shard job: restored from its directory, or initialised afresh; `workers` joined."""
    shard = Shard(config, index, ADDRESSES)
    if not shard.restore():
        placement = place(SPECS, 2)
        model = shard.prepare_init(SPECS, 2, placement.digest)
        model.params.copy_(torch.linspace(-1, 1, model.numel))
        shard.commit_init(model)
    for w in workers:
        shard.join(w, "")
    return shard


def _push(shard: Shard, worker: str, step: int) -> None:
    model = shard.require_model()
    grad = ((np.arange(model.numel) % 5 + step) / 32).astype(np.float32)
    shard.push(worker, step, shard.version, grad, model.digest)
    shard.wait_durable(shard.durable_target(worker), 10.0)


def _record(shard: Shard) -> list[tuple[int, str, str, int, int]]:
    _, entries = shard.claim_record()
    return [(c.shard, c.state, c.worker, c.tries, c.samples) for c in entries]


def test_each_shard_goes_to_one_worker_and_a_holder_asking_again_gets_its_own() -> None:
    claims = Claims()
    assert claims.claim("a", DS, 3) == 0
    assert claims.claim("b", DS, 3) == 1
    assert claims.claim("a", DS, 3) == 0  # the answer was lost: asked again, the same shard
    claims.finish("a", DS, 0, 100)
    claims.finish("a", DS, 0, 100)  # again: harmless
    assert claims.claim("a", DS, 3) == 2
    assert claims.claim("c", DS, 3) is None  # every listed shard is held or done
    assert claims.claim("c", DS, 4) == 3  # the manifest grew
    assert [(c.shard, c.state, c.worker) for c in claims.entries()] == [
        (0, DONE, "a"),
        (1, HELD, "b"),
        (2, HELD, "a"),
        (3, HELD, "c"),
    ]


def test_a_released_shard_is_claimed_again_from_its_start_and_counts_its_tries() -> None:
    claims = Claims()
    assert claims.claim("a", DS, 2) == 0
    assert claims.release("a") == [0]
    assert claims.claim("b", DS, 2) == 0
    with pytest.raises(ClaimNotHeld):
        claims.finish("a", DS, 0, 10)  # too late: b trains it again
    with pytest.raises(ClaimNotHeld):
        claims.hold("a", DS, 0)
    claims.finish("b", DS, 0, 10)
    (entry,) = claims.entries()
    assert (entry.state, entry.worker, entry.tries, entry.samples) == (DONE, "b", 2, 10)


def test_a_claim_lost_or_freed_but_not_taken_is_held_again_and_finished() -> None:
    claims = Claims()
    claims.hold("a", DS, 0)  # a's claim was lost by a restart of shard 0: recorded again
    assert claims.claim("b", DS, 1) is None
    assert claims.release("a") == [0]  # freed while a was silent...
    claims.hold("a", DS, 0)  # ...and taken by nobody since: a goes on
    claims.finish("a", DS, 0, 7)
    assert claims.claim("c", DS, 2) == 1
    claims.release("c")
    claims.finish("c", DS, 1, 5)  # freed, not taken, and trained whole all the same: done
    assert [(c.shard, c.state, c.worker, c.tries, c.samples) for c in claims.entries()] == [
        (0, DONE, "a", 1, 7),
        (1, DONE, "c", 1, 5),
    ]


def test_after_a_restart_no_new_shard_is_given_until_lost_claims_are_reasserted() -> None:
    claims = Claims.restore({"dataset": DS, "claims": [{"shard": 0, "state": DONE, "worker": "a", "tries": 1}]})
    claims.hold_off(60.0)
    assert claims.claim("b", DS, 3) is None  # shard 1 may be a's, claimed after the last logged update
    claims.hold("a", DS, 1)  # a says so
    assert claims.claim("a", DS, 3) == 1  # its own
    claims.hold_off(0.0)
    assert claims.claim("b", DS, 3) == 2


def test_holders_that_never_come_back_are_released_after_a_lease() -> None:
    claims = Claims.restore({"dataset": DS, "claims": [{"shard": 0, "state": HELD, "worker": "gone", "tries": 1}]})
    assert claims.expire(live={"other"}, lease=10.0, now=100.0) == []  # first seen absent
    assert claims.expire(live={"other"}, lease=10.0, now=105.0) == []
    assert claims.expire(live={"other"}, lease=10.0, now=111.0) == [0]
    assert claims.entries()[0].state == FREE


@pytest.mark.parametrize("every", ["0", "2"])
def test_claims_survive_a_shard_dropped_without_closing(tmp_path: Path, every: str) -> None:
    config = ServerConfig(
        mode="async", workers=2, optimizer="adam", lr=0.01, checkpoint_dir=str(tmp_path), checkpoint_every=every
    )
    first = _start(config, workers=("a", "b"))
    assert first.claim("a", "", DS, 2) == 0
    _push(first, "a", 1)  # the update holding a's first push holds its claim
    assert first.claim("b", "", DS, 2) == 1
    _push(first, "b", 1)
    assert first.claim("a", "", DS, 3, finish=0, samples=64) == 2
    _push(first, "a", 2)
    _push(first, "a", 3)
    before = _record(first)
    assert before == [(0, DONE, "a", 1, 64), (1, HELD, "b", 1, 0), (2, HELD, "a", 1, 0)]
    first.checkpoints.flush()
    del first  # as a SIGKILL leaves it: nothing closed, nothing written at the end

    second = _start(config, workers=())
    assert _record(second) == before
    assert second.claims.dataset == DS
    second.close()


def test_a_backup_applying_its_primarys_records_holds_the_same_claims() -> None:
    config = ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.1)
    primary, backup = _start(config, workers=("a",)), _start(config, workers=())
    records: list[list[memoryview | bytes]] = []

    class Link:  # what the replication link does with each update: the encoded record, in version order
        def logged(self, update: Update) -> None:
            records.append([bytes(p) for p in update.encoded()])

        def applied(self, update: Update) -> None:
            pass

    primary.consumers.add(Link(), after=primary.checkpoints)
    assert primary.claim("a", "", DS, 2) == 0
    _push(primary, "a", 1)
    assert primary.claim("a", "", DS, 2, finish=0, samples=5) == 1
    _push(primary, "a", 2)
    for parts in records:
        found = wal.decode(memoryview(b"".join(parts)))
        assert found is not None
        standby.apply_record(backup, found[0], parts)
    assert _record(backup) == _record(primary) == [(0, DONE, "a", 1, 5), (1, HELD, "a", 1, 0)]


def test_a_worker_that_leaves_or_is_evicted_frees_what_it_held() -> None:
    config = ServerConfig(mode="async", workers=3, optimizer="sgd", lr=0.1, lease_timeout=5.0)
    shard = _start(config, workers=("a", "b", "c"))
    assert [shard.claim(w, "", DS, 3) for w in ("a", "b", "c")] == [0, 1, 2]
    shard.leave("a")
    shard.membership.touch("c")
    shard.tick(now=shard.membership.get("c").last_seen + 6.0)  # b and c silent past the lease: both evicted
    assert [(i, state) for i, state, *_ in _record(shard)] == [(0, FREE), (1, FREE), (2, FREE)]


def test_an_idle_worker_leaves_the_sync_rounds_count_until_it_pushes() -> None:
    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.1)
    shard = _start(config, workers=("a", "b"))
    model = shard.require_model()
    grad = np.ones(model.numel, np.float32)
    shard.heartbeat("b", idle=True)
    assert shard.push("a", 1, 0, grad, model.digest) == (1, True)  # a round of a alone: b is idle
    assert shard.push("a", 2, 1, grad, model.digest) == (2, True)
    assert shard.push("b", 1, 2, grad, model.digest) == (2, True)  # b's push counts it in again: the round waits
    assert shard.version == 2 and shard.policy.in_progress()
    assert shard.push("a", 3, 2, grad, model.digest) == (3, True)
    assert shard.membership.active == {"a", "b"}


# -- over gRPC: bad requests are refused with their status, and change nothing ---------------------------------------

JOB = "claims-test"


@pytest.fixture
def cluster(ps_cluster_factory: object) -> Iterator[LocalCluster]:
    config = ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.1, job_name=JOB)
    yield ps_cluster_factory(config, 2)  # type: ignore[operator]


def _stub(address: str) -> tuple[grpc.Channel, ps_pb2_grpc.ParameterServerStub]:
    channel = grpc.insecure_channel(address)
    return channel, ps_pb2_grpc.ParameterServerStub(channel)


def test_bad_claims_are_refused_with_their_status_and_change_nothing(cluster: LocalCluster) -> None:
    topo = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(cluster.address)).GetTopology(
        ps_pb2.GetTopologyRequest(), timeout=5
    )
    channels = [_stub(a) for a in topo.shards]
    try:
        (_, s0), (_, s1) = channels
        for s in (s0, s1):
            s.Join(ps_pb2.JoinRequest(worker_id="a", job_name=JOB), timeout=5)
        s0.Join(ps_pb2.JoinRequest(worker_id="b", job_name=JOB), timeout=5)
        ok = s0.Claim(ps_pb2.ClaimRequest(worker_id="a", job_name=JOB, dataset=DS, listed=2, finish=-1), timeout=5)
        assert ok.shard == 0
        before = s0.Claims(ps_pb2.ClaimsRequest(), timeout=5)

        def claim(**fields: object) -> ps_pb2.ClaimRequest:
            base: dict[str, object] = {"worker_id": "b", "job_name": JOB, "dataset": DS, "listed": 2, "finish": -1}
            return ps_pb2.ClaimRequest(**{**base, **fields})

        cases = [
            (s0, claim(job_name="another-job"), grpc.StatusCode.FAILED_PRECONDITION, WrongJob),
            (s0, claim(dataset="another:dataset"), grpc.StatusCode.FAILED_PRECONDITION, OtherDataset),
            (s0, claim(dataset=""), grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
            (s0, claim(listed=1 << 40), grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
            (s0, claim(finish=0), grpc.StatusCode.ABORTED, ClaimNotHeld),  # a's, not b's
            (s0, claim(holding=0), grpc.StatusCode.ABORTED, ClaimNotHeld),  # a's, not b's
            (s0, claim(holding=1 << 40), grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
            (s0, claim(finish=1 << 40), grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
            (s0, claim(worker_id="stranger"), grpc.StatusCode.ABORTED, UnknownWorker),
            (s1, claim(worker_id="a"), grpc.StatusCode.FAILED_PRECONDITION, NotClaimShard),
        ]
        for stub, request, code, kind in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.Claim(request, timeout=5)
            assert info.value.code() == code, (request, info.value.details())
            metadata = dict(info.value.trailing_metadata() or ())
            assert metadata.get("ps-error") == kind.__name__, (request, metadata)
            assert s0.Claims(ps_pb2.ClaimsRequest(), timeout=5) == before
        with pytest.raises(grpc.RpcError) as info:
            s1.Claims(ps_pb2.ClaimsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert s0.Claim(claim(), timeout=5).shard == 1  # b's own, once asked well
    finally:
        for channel, _ in channels:
            channel.close()


def test_ps_reshard_keeps_the_claims_with_shard_0(tmp_path: Path) -> None:
    from paramserver.shard.durability import checkpoint
    from paramserver.shard.reshard import reshard

    config = ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1, checkpoint_dir=str(tmp_path / "src"))
    shards = [_start(config, index) for index in (0, 1)]
    assert shards[0].claim("w", "", DS, 3) == 0
    _push(shards[0], "w", 1)
    assert shards[0].claim("w", "", DS, 3, finish=0, samples=9) == 1
    _push(shards[0], "w", 2)  # the finish and the claim of shard 1 are in the log only, after the checkpoint
    for step in (1, 2):
        _push(shards[1], "w", step)  # one consistent cut: both shards at version 2
    want = _record(shards[0])
    for shard in shards:
        shard.checkpoints.flush()
    reshard(tmp_path / "src", tmp_path / "out", 3)
    snaps = [checkpoint.load_latest(tmp_path / "out", j) for j in range(3)]
    assert all(s is not None for s in snaps)
    assert Claims.restore(snaps[0].claims).dataset == DS  # type: ignore[union-attr]
    assert [(c.shard, c.state, c.worker, c.tries, c.samples) for c in Claims.restore(snaps[0].claims).entries()] == want  # type: ignore[union-attr]
    assert snaps[1].claims == snaps[2].claims == {}  # type: ignore[union-attr]
