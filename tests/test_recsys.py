"""The recommendation demo's planted world (worker/demos/planted.py): click logs drawn from a known model, their
ceiling, and their Criteo day files. The demo itself (`python -m worker.demos.recsys`, make demo MODEL=recsys) runs
the command-line job; tests/test_click_models.py checks that job against local training."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from worker.demos.planted import (
    CRITEO_CATEGORICAL,
    CRITEO_INTEGERS,
    ClickLogs,
    ceiling_auc,
    criteo_lines,
    make_click_logs,
    write_criteo,
)
from worker.train.metrics import auc


@pytest.fixture(scope="module")
def logs() -> ClickLogs:
    return make_click_logs(100_000, 10_000, seed=0)


def test_same_seed_same_logs_other_seed_other_logs() -> None:
    a, b, c = (make_click_logs(3000, 500, seed=s) for s in (5, 5, 6))
    for name in ("dense", "user", "item", "category", "tags", "tag_offsets", "label", "prob"):
        assert np.array_equal(getattr(a.train, name), getattr(b.train, name)), name
    assert a.ceiling_auc == b.ceiling_auc
    assert not np.array_equal(a.train.user, c.train.user)


def test_users_are_zipf_distributed(logs: ClickLogs) -> None:
    _, counts = np.unique(logs.train.user, return_counts=True)
    counts = np.sort(counts)[::-1]
    assert counts[: len(counts) // 100].sum() / counts.sum() > 0.3  # the top 1 % of users
    assert (counts == 1).mean() > 0.8  # most users are in the tail, seen once


def test_the_ceiling_is_the_planted_probabilities_auc(logs: ClickLogs) -> None:
    assert 0.7 < logs.ceiling_auc < 0.9
    assert logs.ceiling_auc == auc(logs.test.label, logs.test.prob)
    assert abs(ceiling_auc(logs) - logs.ceiling_auc) < 0.01  # over every impression: about the same


def test_criteo_lines_carry_the_label_counts_and_hashes(logs: ClickLogs) -> None:
    lines = criteo_lines(logs.test)
    assert len(lines) == len(logs.test)
    for i in (0, 17, len(lines) - 1):
        fields = lines[i].split("\t")
        assert len(fields) == 1 + CRITEO_INTEGERS + CRITEO_CATEGORICAL
        assert int(fields[0]) == logs.test.label[i]
        counts = [int(v) for v in fields[1:5]]
        assert counts == np.rint(4 * np.exp(logs.test.dense[i].astype(np.float64))).astype(int).tolist()
        assert fields[5:14] == [""] * 9  # the integer features the world has no value for: missing
        hashes = fields[14:]
        assert int(hashes[0], 16) == int(logs.test.user[i]) & 0xFFFFFFFF and len(hashes[0]) == 8
        assert int(hashes[1], 16) == logs.test.item[i] and int(hashes[2], 16) == logs.test.category[i]
        bag = logs.test.tags[logs.test.tag_offsets[i] : logs.test.tag_offsets[i + 1]]
        assert [int(h, 16) for h in hashes[3 : 3 + len(bag)]] == bag.tolist()
        assert all(h == "" for h in hashes[3 + len(bag) :])


def test_write_criteo_writes_a_plain_and_a_gzip_day_file(tmp_path: Path) -> None:
    small = make_click_logs(300, 50, seed=2)
    plain, packed = write_criteo(small, tmp_path)
    assert plain.read_text().splitlines() == criteo_lines(small.train)
    with gzip.open(packed, "rt") as f:
        assert f.read().splitlines() == criteo_lines(small.test)
