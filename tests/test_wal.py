"""The write-ahead log: a shard that stops without a word (its object dropped, as a SIGKILL leaves its files) comes
back in exactly the state it acknowledged, whatever --checkpoint-every is; a torn record ends the log."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from paramserver.config import ServerConfig
from paramserver.placement import TensorSpec, place
from paramserver.shard.durability import wal
from paramserver.shard.sparse.row_blocks import RowBlock
from paramserver.shard.state import Shard
from paramserver.tables import TableSpec, shard_of

ADDRESSES = ("a:1", "b:2")
SPECS = [TensorSpec("w", (6, 5)), TensorSpec("b", (7,))]
TABLES = [TableSpec("user", dim=3, optimizer="adagrad")]


def _start(config: ServerConfig) -> Shard:
    """Shard 0 of a 2-shard job as ps-server starts it: restored from its directory, or initialised afresh."""
    shard = Shard(config, 0, ADDRESSES)
    if not shard.restore():
        placement = place(SPECS, 2, tables=TABLES)
        model = shard.prepare_init(SPECS, 2, placement.digest, TABLES)
        model.params.copy_(torch.linspace(-1, 1, model.numel))
        shard.commit_init(model)
    shard.join("w", "")
    return shard


def _rows(step: int) -> list[RowBlock]:
    ids = np.arange(step, step + 40, dtype=np.int64)
    ids = ids[shard_of(ids, 2) == 0]
    values = np.full((len(ids), 3), 0.25 * step, dtype=np.float32) + ids[:, None].astype(np.float32) / 64
    return [RowBlock(0, ids, values)]


def _state(shard: Shard) -> bytes:
    """Weights, optimizer state, version and rows: what an update changes, less the rows' update times (the
    clock of another process reads them back to within a rounding)."""
    model = shard.require_model()
    parts = [str(shard.version).encode(), model.params.numpy().tobytes()]
    for st in model.optimizer.state.values():
        parts += [
            v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode() for _, v in sorted(st.items())
        ]
    for table in model.tables.tables:
        parts += [a.tobytes() for k, a in sorted(table.state().items()) if k != "times"]
    return b"|".join(parts)


def _push(shard: Shard, step: int) -> tuple[int, bool]:
    model = shard.require_model()
    grad = ((np.arange(model.numel) % 7 + step) / 16).astype(np.float32)
    return shard.push("w", step, shard.version, grad, model.digest, rows=_rows(step))


@pytest.mark.parametrize("every", ["0", "3"])
@pytest.mark.parametrize("sync", ["write", "fsync"])
def test_a_shard_dropped_without_closing_comes_back_in_the_state_it_acknowledged(
    tmp_path: Path, every: str, sync: str
) -> None:
    config = ServerConfig(
        mode="sync",
        workers=1,
        optimizer="adam",
        lr=0.01,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=every,
        wal_sync=sync,
    )
    first = _start(config)
    for step in range(1, 8):
        assert _push(first, step) == (step, True)
        first.wait_durable(first.durable_target("w"), 10.0)  # what the exchange handler waits for before it answers
    saved, version = _state(first), first.version
    # No close(): no final checkpoint, nothing flushed by the shard; only what the kernel holds survives. (Its
    # writer finishes the checkpoints it was handed first: a killed process's would stop, but this one shares the
    # directory with the next, and must not delete log files under its replay.)
    first.checkpoints.flush()
    second = _start(config)
    assert second.version == version == 7
    assert _state(second) == saved
    # The pushes it holds are known: a retry is recognised, not applied again.
    assert _push(second, 7) == (7, False)
    assert _state(second) == saved
    # And it goes on as the first would have.
    assert _push(second, 8) == (8, True)
    second.close()
    first.close()


def test_a_torn_last_record_ends_the_log_and_its_push_applies_when_retried(tmp_path: Path) -> None:
    def config(directory: Path) -> ServerConfig:
        return ServerConfig(
            mode="async", workers=1, optimizer="sgd", lr=0.5, checkpoint_dir=str(directory), checkpoint_every="0"
        )

    reference = _start(config(tmp_path / "reference"))
    for step in range(1, 4):
        _push(reference, step)
    first = _start(config(tmp_path / "torn"))
    for step in range(1, 4):
        _push(first, step)
    # Cut the last record short, as a kill in the middle of its write would.
    ((_, path),) = wal.segments(tmp_path / "torn", 0)[-1:]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 11])
    second = _start(config(tmp_path / "torn"))
    assert second.version == 2
    assert _push(second, 3) == (3, True)  # the torn record's push was never acknowledged: it applies now
    assert _state(second) == _state(reference)
    for shard in (reference, first, second):
        shard.close()


def test_the_segments_a_checkpoint_covers_are_deleted_once_it_is_on_disk(tmp_path: Path) -> None:
    config = ServerConfig(
        mode="async", workers=1, optimizer="sgd", lr=0.5, checkpoint_dir=str(tmp_path), checkpoint_every="4"
    )
    shard = _start(config)
    for step in range(1, 10):
        _push(shard, step)
    shard.checkpoints.flush()
    starts = [start for start, _ in wal.segments(tmp_path, 0)]
    assert starts == [8], "only the segment after the newest checkpoint (version 8) is left"
    assert [r.version for r in wal.records(tmp_path, 0, 8)] == [9]
    shard.close()


def test_group_commit_makes_every_record_written_durable(tmp_path: Path) -> None:
    log = wal.WriteAheadLog(tmp_path, 0, 0, fsync=True)
    grad = np.ones(1000, dtype=np.float32)
    for version in range(1, 21):
        log.append(version, wal.encode(version, [("w", version)], grad, [], 0.0))
    assert log.wait_durable(20, 10.0) and log.durable == 20
    log.close()
    assert [r.version for r in wal.records(tmp_path, 0, 0)] == list(range(1, 21))
