"""Durability with --checkpoint-dir: an acknowledged push survives a SIGKILL of its shard and a restart with the
same command, whatever --checkpoint-every is; no push applies twice; in sync mode every shard ends at one version.

Exact arithmetic (the harness is bench/stress_kills.py, whose `make stress` runs many more kills): 2 shard
processes run SGD with lr 1.0; the workers (processes) push gradients of exactly -1 with explicit steps 1..K, so
every applied push (async) or round (sync) adds exactly +1 to every element. One shard is SIGKILLed at a random
(seeded, printed) point of the job and restarted on its port 0.5-1 s later. At the end each shard's elements must
equal, exactly, the pushes acknowledged (async) or K, the rounds (sync): fewer is a lost push, more one applied
twice. PS_DURABILITY_SEED=N picks other kill points.

Every process started is stopped by the harness, also when a test fails (workers SIGKILLed, shards by
LocalCluster's exit); workers also die with this process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.stress_kills import Outcome, Scenario, run_scenario  # noqa: E402

SEED = int(os.environ.get("PS_DURABILITY_SEED", "0"))
STEPS = 200  # per worker: the job outlasts the kill and the restart, and ends well within the tests' time


def _run(tmp_path: Path, name: str, mode: str, shared_memory: bool, checkpoint_every: str, seed: int) -> Outcome:
    """One shard SIGKILLed and restarted in a job of 2 workers x STEPS steps. A job stuck for 25 s (no push
    acknowledged; each pull waits at most 10 s) is stopped and fails with what the shards and workers say."""
    scenario = Scenario(
        name, mode, shared_memory, checkpoint_every, steps=STEPS, seed=seed, timeout=90, stall=25, pull_timeout=10
    )
    outcome = run_scenario(scenario, tmp_path / name)
    print(outcome.summary())
    return outcome


def _check_async(o: Outcome) -> None:
    s = o.scenario
    why = o.summary()
    assert len(o.kills) == s.shard_kills, why
    assert o.acked == {f"w{i}": s.steps for i in range(s.workers)}, why  # every step ends acknowledged
    assert sum(o.lost) == 0, f"acknowledged pushes lost: {o.lost} per shard\n{why}"
    assert sum(o.twice) == 0, f"pushes applied twice: {o.twice} per shard\n{why}"
    assert o.values == [(o.total_acked, o.total_acked)] * 2, why
    assert o.versions == [o.total_acked] * 2, why
    assert not o.problems, why


@pytest.mark.timeout(120)
def test_async_a_killed_shard_with_only_its_log_keeps_every_acknowledged_push(tmp_path):
    """checkpoint_every 0: no periodic checkpoint, so the restarted shard has only its log to go by. (The data
    socket with a log under kills: test_replicas and make stress's async-socket scenario.)"""
    o = _run(tmp_path, "async-shm", "async", True, "0", seed=SEED)
    _check_async(o)
    assert o.transports == [["shared memory"] * 2] * 2, o.summary()


@pytest.mark.timeout(120)
def test_sync_a_killed_shard_ends_at_the_same_version_as_the_other(tmp_path):
    o = _run(tmp_path, "sync-shm", "sync", True, "50", seed=SEED + 2)
    why = o.summary()
    assert len(o.kills) == 1, why
    assert o.acked == {"w0": STEPS, "w1": STEPS}, why
    assert o.skew == 0, f"the shards end at versions {o.versions}\n{why}"
    assert o.versions == [STEPS, STEPS], f"one round per step: lost {o.lost}, applied twice {o.twice}\n{why}"
    assert o.values == [(STEPS, STEPS)] * 2, f"every element == its shard's version\n{why}"
    assert not o.problems, why
