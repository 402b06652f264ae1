"""The stress run's scenarios and what each ended with (bench/stress_kills.py): a `Scenario` (a job and its kills),
each `Kill`, an `Outcome` judged by exact arithmetic, and the table of outcomes."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

TRANSPORT = {True: "shared memory", False: "data socket"}
COPY_ROLES = ("primary", "backup")


@dataclass(frozen=True)
class Scenario:
    """One run: a job, how many steps each worker pushes, and how many kills of each kind at random moments."""

    name: str
    mode: str = "async"
    shared_memory: bool = True
    checkpoint_every: str = "50"
    workers: int = 2
    steps: int = 400
    shard_kills: int = 1
    worker_kills: int = 0
    seed: int = 0
    window: tuple[float, float] = (0.15, 0.85)  # kills happen between these fractions of the job's progress
    lease_timeout: float = 10.0
    pull_timeout: float = 20.0
    timeout: float = 300.0  # the whole run (then it is stopped and judged, as a stall)
    # No push acknowledged for this long while workers run: the job is stuck (more than a pull_timeout, so that a
    # worker's resend after a PullTimeout counts as progress): stop it and judge what the shards hold.
    stall: float = 45.0
    # Seconds a worker waits before each step: a job of a length set by its steps, not by how fast the pushes go
    # (kills of copies restart in the background; the job must last for them), on cores left for the restarts.
    pace: float = 0.0
    # The job goes on past `steps` (to at most `steps_cap` x) until every planned kill happened, and then a little
    # (the harness tells the workers the last step, the same for all): the kills of copies restart in the
    # background, so a job of a fixed length on a loaded machine could end before them.
    until_kills_done: bool = False
    steps_cap: int = 10
    # 2: each shard on two copies (hot standby), roles in a real etcd; shard_kills then kill a shard's primary.
    replicas: int = 1
    backup_kills: int = 0  # replicas 2: kills of a shard's backup
    checkpoint_dir: bool = True  # False: no --checkpoint-dir (replicas 2: only the backup keeps what was acknowledged)
    # replicas 2: a shard's copies must be in sync again within this after a restart (before the next kill of its
    # primary that waits for it, and at the end).
    catch_up: float = 60.0

    @property
    def checkpoint(self) -> str:
        return self.checkpoint_every if self.checkpoint_dir else "none"

    @property
    def wait_in_sync(self) -> bool:
        """Kill a primary only once its backup is in the in-sync set: without a log on disk, a primary killed while
        its backup catches up takes acknowledged updates with it (by design)."""
        return not self.checkpoint_dir


@dataclass
class Kill:
    what: str  # "shard 1", "worker w0", "shard 1 primary (copy 0)"
    at_acked: int  # acknowledged pushes (all workers) when it was killed
    down_s: float  # from the kill until it served (shard) or ran (worker) again
    killed_at: float = 0.0  # time.monotonic() of the SIGKILL (the clock of the workers' steps files)
    role: str = ""  # "shard" (no replicas), "primary" or "backup" (a copy), "worker"
    in_sync: bool = False  # replicas 2: both copies were in the in-sync set when it was killed
    outage_s: float | None = None  # from the SIGKILL to the first acknowledgement of a push sent after it
    catch_up_s: float | None = None  # replicas 2: from the restarted copy serving to both copies in sync again
    epochs: tuple[int, int] = (0, 0)  # replicas 2: the shard's epoch when killed, and once in sync again

    def describe(self) -> str:
        parts = [f"down {self.down_s:.1f} s"]
        if self.role in COPY_ROLES and not self.in_sync:
            parts.append("copies not in sync")
        if self.outage_s is not None:
            parts.append(f"first ack after {self.outage_s * 1e3:.0f} ms")
        if self.catch_up_s is not None:  # (none where a copy of the shard was killed again first)
            parts.append(f"in sync {self.catch_up_s:.2f} s after serving, epoch {self.epochs[0]}->{self.epochs[1]}")
        return f"{self.what} at {self.at_acked} acked ({', '.join(parts)})"


@dataclass
class Outcome:
    scenario: Scenario
    kills: list[Kill] = field(default_factory=list)
    acked: dict[str, int] = field(default_factory=dict)  # worker -> acknowledged steps
    versions: list[int] = field(default_factory=list)
    values: list[tuple[float, float]] = field(default_factory=list)  # (min, max) of each shard's elements
    expected: int = 0  # the value (and version) every shard must hold
    lost: list[int] = field(default_factory=list)  # per shard
    twice: list[int] = field(default_factory=list)  # per shard
    skew: int = 0
    refused: int = 0
    transports: list[list[str]] = field(default_factory=list)  # per worker: each link's kind at its first step
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # worker -> its last step (`steps`, or later)
    copy_versions: list[int | str] = field(default_factory=list)  # replicas 2: every copy's version at the end
    deposed: list[str] = field(default_factory=list)  # replicas 2: copies that exited DEPOSED_EXIT (restarted)

    @property
    def total_acked(self) -> int:
        return sum(self.acked.values())

    def outages(self, role: str) -> list[float]:
        """The outages after kills of this role ("shard", "primary", "backup"); a primary's only where its
        backup was in sync (a failover, not a restart from disk)."""
        return [
            k.outage_s
            for k in self.kills
            if k.role == role and k.outage_s is not None and (k.in_sync or role != "primary")
        ]

    @property
    def failovers(self) -> list[float]:
        """What the table shows: each kill of a shard (no replicas) or an in-sync primary, SIGKILL to first ack."""
        return self.outages("primary" if self.scenario.replicas > 1 else "shard")

    def summary(self) -> str:
        s = self.scenario
        kills = ", ".join(k.describe() for k in self.kills) or "none"
        steps = self.steps if len(set(self.steps.values())) > 1 else next(iter(self.steps.values()), s.steps)
        ckpt = f"checkpoint_every {s.checkpoint_every!r}" if s.checkpoint_dir else "no checkpoint dir"
        replicated = ""
        if s.replicas > 1:
            catch_up = [k.catch_up_s for k in self.kills if k.catch_up_s is not None]
            replicated = (
                f"replicas {s.replicas}; failover (kill of an in-sync primary -> first ack) {spread(self.failovers)}; "
                f"pause after a backup kill {spread(self.outages('backup'))}; catch-up after a restart "
                f"{spread(catch_up)}; every copy's version at the end {self.copy_versions}; exited deposed "
                f"{self.deposed or 'none'}; "
            )
        return (
            f"[{s.name}] mode {s.mode}, {TRANSPORT[s.shared_memory]}, {ckpt}, "
            f"{s.workers} workers x {steps} steps, seed {s.seed}: kills: {kills}; {replicated}acknowledged pushes "
            f"{self.total_acked} {self.acked}; expected value {self.expected} on every shard; values (min, max) "
            f"per shard {self.values}; versions {self.versions}; lost {self.lost}; applied twice {self.twice}; "
            f"skew {self.skew}; resent after refusal {self.refused}; transports {self.transports}; "
            f"{self.seconds:.1f} s; problems: {self.problems or 'none'}"
        )


def quantile(values: list[float], q: float) -> float:
    """The q-quantile, linear between the order statistics (p90 of a few values lies near the largest)."""
    xs = sorted(values)
    at = q * (len(xs) - 1)
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def spread(seconds: list[float]) -> str:
    """min/median/p90/max in milliseconds, and how many ("-" for none)."""
    if not seconds:
        return "-"
    q = [min(seconds), statistics.median(seconds), quantile(seconds, 0.9), max(seconds)]
    return "/".join(f"{x * 1e3:.0f}" for x in q) + f" ms (n={len(seconds)})"


def kills_text(o: Outcome) -> str:
    """Kills by kind: "6s+2w" of shards (no replicas) and workers; "4p+4b+2w" of primaries, backups, workers."""
    count = {role: sum(k.role == role for k in o.kills) for role in ("shard", "primary", "backup", "worker")}
    if o.scenario.replicas > 1:
        return f"{count['primary']}p+{count['backup']}b+{count['worker']}w"
    return f"{count['shard']}s+{count['worker']}w"


def outcome_table(outcomes: list[Outcome]) -> str:
    """One row per scenario; `outage ms`: from the SIGKILL of a shard (no replicas: until it restarted) or of an
    in-sync primary (replicas: the failover) to the first acknowledged push sent after it, min/median/p90/max."""
    head = (
        f"{'scenario':<20} {'ckpt':>5} {'kills':>9} {'acked':>6} {'versions':>11} {'lost':>4} {'twice':>5} "
        f"{'skew':>4} {'resent':>6} {'secs':>6} {'outage ms min/med/p90/max':>27}  result"
    )
    rows = [head, "-" * len(head)]
    for o in outcomes:
        s = o.scenario
        outage = spread(o.failovers).removesuffix(")").replace(" ms (n=", " n=")
        verdict = "ok" if not o.problems else "STALL" if "stalled" in o.problems[0] else "FAIL"
        rows.append(
            f"{s.name:<20} {s.checkpoint:>5} {kills_text(o):>9} {o.total_acked:>6} "
            f"{'/'.join(map(str, o.versions)):>11} {sum(o.lost):>4} {sum(o.twice):>5} {o.skew:>4} {o.refused:>6} "
            f"{o.seconds:>6.1f} {outage:>27}  {verdict}"
        )
    return "\n".join(rows)
