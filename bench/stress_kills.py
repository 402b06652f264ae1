"""Kill shards (and workers) at random moments; check by exact arithmetic that every acknowledged push survives, once.

    .venv/bin/python bench/stress_kills.py            # make stress: every scenario, a table, exit 1 on any fault
    .venv/bin/python bench/stress_kills.py --only async-shm --seed 7 --kills 3

The harness: 2 shard processes run plain SGD with lr 1.0 and a --checkpoint-dir; the model is {"a": zeros(4),
"b": zeros(4)}, so each shard holds one tensor. Every worker pushes a gradient of exactly -1 everywhere with
explicit steps 1..K, so each applied push (async) or round (sync: the mean of -1s) adds exactly +1.0 to every
element; float32 counts exactly far beyond these sizes. A worker appends a step to its file once the push_pull of
that step returned (acknowledged). A push refused (Aborted: a round closed without it, or a push computed on a
version a restarted shard no longer has) or whose pull timed out is not acknowledged: the worker pulls and sends
the same (worker, step) again until it is; the shard applies each (worker, step) once, so a resend is safe, and
every step ends acknowledged on every shard (a push half-applied, by one shard and not the other, cannot remain).

Meanwhile shard processes are SIGKILLed at random moments (random points of the job's progress, seeded) and
restarted on the same port with the same command after 0.5-1 s; a worker process may be SIGKILLed too and started
again with its worker id, from the step after the last one its file holds (the one it was killed in is resent:
the shard that had taken it must not apply it again).

At the end every shard is read (a reader that does not join, over gRPC) and checked, element by element:
  async: value == version == the acknowledged pushes of all workers (fewer: lost; more: applied twice);
  sync:  value == version == K on every shard (one round per step; a shard behind lost rounds, ahead applied
         rounds twice or without a worker), and every shard at the same version (skew 0).
A job stuck (no push acknowledged for `stall` seconds, e.g. sync rounds of two shards each waiting for the worker
that waits on the other) is stopped and fails, saying each shard's version and each worker's last lines.

Replicated scenarios (`replicas-*`, --replicas 2 hot standby): each shard runs as two copies (processes
shard * 2 + copy) whose roles live in a real etcd on loopback (paramserver.testing.EtcdServer). The kills
target a shard's primary or its backup, read from the coordinator just before the kill, and workers; a killed
copy is restarted 0.5-1 s later in the background (it comes back as the backup and catches up), so the next
kill may hit the other shard or a worker meanwhile, never the other copy of a shard with a copy down. Without
--checkpoint-dir the backup alone holds what was acknowledged: a primary is killed only once its backup is in
the in-sync set (else the job would lose, by design, what only the primary held). With --checkpoint-dir a
primary may also be killed while its backup is still catching up (it then restarts from its own log). A copy
that exits on its own with DEPOSED_EXIT (a primary whose backup took over, e.g. after a scheduling pause longer
than --replica-timeout) is restarted, as a deployment would, and counted; any other exit is a failure. The
final state is read from the primaries (the reader's links find them); each backup in the in-sync set must
hold the primary's version.

Timing: each line of a worker's steps file is "step sent acked", time.monotonic() (one clock for every process
of the machine) when the step's push was first sent and when it was acknowledged. For each kill of a shard (or
of a copy) the outage is the time from the SIGKILL to the first acknowledgement of a push sent after it: every
push has a part on every shard, so that push was served by the new primary (a failover), the restarted shard
(no replicas), or the primary once it stopped waiting for its dead backup. The table gives its distribution
over the kills of shards (no replicas) or primaries (replicas 2); the summary lines each kill's.

Worker processes run `python bench/stress_kills.py worker ...` (below); tests/test_durability.py runs short
scenarios of this harness inside `make test`. The scenarios and outcomes are bench/stress_outcomes.py; a
scenario's processes and kills, bench/stress_job.py; running and judging one, and the whole run, here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on sys.path, the repository root is not
    sys.path.insert(0, str(ROOT))
if __name__ == "__main__":
    # This process reads the shards over gRPC (at each scenario's end) and goes on forking shards and workers
    # (LocalCluster and the workers use preexec_fn, so a fork, Python code, then exec): with gRPC's fork handlers
    # on, about 1 child in 100 aborts before its exec (SIGABRT, "Epoll1Poller ... epoll_wait error: Bad file
    # descriptor"), which would fail a scenario for nothing it tests.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import torch  # noqa: E402

from bench.stress_job import (  # noqa: E402
    SHARDS,
    Job,
    ack_times,
    acked_steps,
    copy_waits,
    kill_copy,
    kill_shard,
    kill_worker,
    plan_kills,
    read_shards,
    shard_versions,
    stress_model,
)
from bench.stress_outcomes import (  # noqa: E402
    COPY_ROLES,
    TRANSPORT,
    Outcome,
    Scenario,
    outcome_table,
    spread,
)
from paramserver.errors import Aborted, PullTimeout  # noqa: E402
from worker import PSClient  # noqa: E402

END_MARGIN = 50  # steps after the last kill, when the job goes on until every kill happened


# -- the worker process -----------------------------------------------------------------------------------------


def worker_main(argv: list[str]) -> int:
    """One worker: push -1s with steps start..K, appending each acknowledged step to --out (one line each)."""
    p = argparse.ArgumentParser(prog="stress_kills.py worker")
    p.add_argument("--address", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--summary", required=True)
    p.add_argument("--no-shared-memory", action="store_true")
    p.add_argument("--pace", type=float, default=0.0, help="seconds between a step's acknowledgement and the next")
    p.add_argument("--stop-file", default=None, help="once it exists: the last step (it holds), if before --steps")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, grad = stress_model(), stress_model()
    refused = 0
    first_kinds: list[str] = []
    with (
        PSClient(args.address, worker_id=args.worker_id, shared_memory=not args.no_shared_memory, timeout=90) as c,
        open(args.out, "a", buffering=1) as out,
    ):
        c.register(model)  # adopts the shards' weights (or initialises them with zeros, for the first worker)
        last = args.steps
        for step in range(args.start, args.steps + 1):
            if args.stop_file and last == args.steps and os.path.exists(args.stop_file):
                last = min(last, int(Path(args.stop_file).read_text()))
            if step > last:
                break
            if args.pace:
                time.sleep(args.pace)
            sent = time.monotonic()  # the clock the harness reads its kills on (one for every process)
            while True:
                for t in grad.values():
                    t.fill_(-1.0)
                try:
                    c.push_pull(grad, step=step)  # grad's tensors are the gradient, then receive the weights
                    break
                except (Aborted, PullTimeout) as exc:  # not acknowledged: catch up, resend the same (worker, step)
                    refused += 1
                    print(f"step {step} not acknowledged ({type(exc).__name__}: {exc}); resending", file=sys.stderr)
                    try:
                        c.pull(model)
                    except (Aborted, PullTimeout) as again:
                        print(f"catch-up pull failed: {type(again).__name__}: {again}", file=sys.stderr)
            for name, t in model.items():  # what a shard that lost the model is initialised with again
                t.copy_(grad[name])
            out.write(f"{step} {sent:.6f} {time.monotonic():.6f}\n")  # acknowledged: step, sent, acknowledged
            if not first_kinds:
                first_kinds = [link.transport.kind for link in c.links]
        summary = {
            "start": args.start,
            "refused": refused,
            "rank": c.rank,
            "first_transports": first_kinds,
            "last_transports": [link.transport.kind for link in c.links],
            "versions": c.versions,
        }
    with open(args.summary, "a") as f:
        f.write(json.dumps(summary) + "\n")
    return 0


# -- running one scenario ---------------------------------------------------------------------------------------


def run_scenario(s: Scenario, workdir: Path, say: Any = print) -> Outcome:
    """Run one scenario with its kills; return what the shards hold against what was acknowledged."""
    rng = random.Random(s.seed)
    plan = plan_kills(s, rng)
    result = Outcome(scenario=s)
    total = s.workers * s.steps
    began = time.monotonic()
    job = Job(s, workdir)
    with job.running_job():
        say(
            f"[{s.name}] seed {s.seed}: kills at progress "
            + (", ".join(f"{x:.2f} ({k} {i})" for x, k, i in plan) or "none")
            + f"; started in {time.monotonic() - began:.1f} s"
        )
        last_acked, moved_at, after_restart = 0, time.monotonic(), 0
        pending = list(plan)
        waiting: tuple[float, str] | None = None  # since when, and why, the next kill waits (replicas)
        while job.running() or pending:
            job.check_workers()
            if job.replicated:
                job.check_copies(say)
            now = time.monotonic()
            acked = job.acked()
            if acked != last_acked:
                last_acked, moved_at = acked, now
            if now - moved_at > s.stall or now - began > s.timeout:
                why = f"no push acknowledged for {now - moved_at:.0f} s" if now - moved_at > s.stall else "timeout"
                last = {n: max(acked_steps(job.out(n)), default=0) for n in job.names}
                stalled = (
                    f"the job stalled ({why}) at {acked}/{total} acknowledged, shard versions "
                    f"{shard_versions(job.cluster.addresses)}, last step acknowledged per worker {last}"
                )
                if job.replicated:
                    stalled += f", configurations {[job.part(k) for k in range(SHARDS)]}"
                say(f"[{s.name}] {stalled}; the workers' last lines:")
                for n in job.names:
                    say(f"--- {n}:\n" + "\n".join(job.tail(n).strip().splitlines()[-6:]))
                result.problems.append(stalled)
                job.stop_workers()
                break
            if s.until_kills_done and not pending and not job.stop_file(job.names[0]).exists():
                last = job.end_at(END_MARGIN)
                say(f"[{s.name}] every kill happened ({now - began:.1f} s): the workers' last steps {last}")
            # The next kill once the job reached its point and made progress since the last restart (and, for a
            # copy, once the shard can lose it).
            if pending and acked >= pending[0][0] * total and acked >= after_restart + 2 * s.workers:
                _, kind, index = pending[0]
                why = ""
                if kind in COPY_ROLES:  # the planned shard, else the other one if it can lose a copy now
                    for k in (index, *(k for k in range(SHARDS) if k != index)):
                        why = copy_waits(job, k, kind)
                        if not why:
                            index = k
                            break
                if not why:
                    pending.pop(0)
                    waiting = None
                    if kind in COPY_ROLES:
                        kill = kill_copy(job, index, kind, rng, acked)
                    elif kind == "shard":
                        kill = kill_shard(job, index, rng, acked)
                    else:
                        kill = kill_worker(job, index, rng, acked)
                    if kill is not None:
                        result.kills.append(kill)
                        back = "restarting" if kind in COPY_ROLES else f"back after {kill.down_s:.1f} s"
                        say(
                            f"[{s.name}] killed {kill.what} at {acked}/{total} acknowledged "
                            f"({kill.killed_at - began:.1f} s); {back}"
                        )
                    after_restart = job.acked()
                    moved_at = time.monotonic()
                    continue
                if waiting is None:
                    waiting = (now, why)
                elif now - waiting[0] > s.catch_up:
                    result.problems.append(f"a kill of shard {index}'s {kind} waited {s.catch_up:.0f} s: {why}")
                    say(f"[{s.name}] {result.problems[-1]}")
                    pending.pop(0)
                    waiting = None
            if not job.running() and pending:  # the job ended before its last kills: they cannot happen
                last = {n: max(acked_steps(job.out(n)), default=0) for n in job.names}
                say(f"[{s.name}] the job finished before {len(pending)} planned kill(s) (last steps {last})")
                break
            time.sleep(0.01)
        if not result.problems:  # (workers stopped after a stall were SIGKILLed)
            job.check_workers()
        if job.replicated:
            job.settle()  # every killed copy serves again (and its catch-up was timed)
            result.problems += job.in_sync(s.catch_up)
            say(f"[{s.name}] the workers ended, every copy serves and is in sync ({time.monotonic() - began:.1f} s)")
        versions, shards = read_shards(job.cluster.address)
        if job.replicated:
            result.copy_versions = shard_versions(job.cluster.addresses)
            result.deposed = list(job.deposed)
            result.problems += job.errors
    result.seconds = time.monotonic() - began
    _outages(result, job)
    return _judge(result, job, versions, shards)


def _outages(result: Outcome, job: Job) -> None:
    """For each kill of a shard or a copy: from the SIGKILL to the first acknowledgement of a push sent after it
    (over every worker; each push has a part on every shard)."""
    times = [t for n in job.names for t in ack_times(job.out(n))]
    for k in result.kills:
        if k.role == "worker":
            continue
        after = [acked for sent, acked in times if sent >= k.killed_at]
        k.outage_s = min(after) - k.killed_at if after else None


def _judge(result: Outcome, job: Job, versions: list[int], shards: list[torch.Tensor]) -> Outcome:
    s = result.scenario
    problems = result.problems
    # A stalled job's pushes were in flight and its sync rounds open: no exact count to check against.
    stalled = any(p.startswith("the job stalled") for p in problems)
    result.steps = {n: job.steps(n) for n in job.names}
    for n in job.names:
        steps = acked_steps(job.out(n))
        result.acked[n] = len(set(steps))
        if steps != list(range(1, result.steps[n] + 1)) and not stalled:
            problems.append(
                f"worker {n} acknowledged {len(steps)} of steps 1..{result.steps[n]} (not each once, in order)"
            )
        path = job.dir / f"{n}.summary"  # a line per run of the worker that ended (none if stopped after a stall)
        summaries = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
        result.refused += job.tail(n, chars=10**9).count(" not acknowledged (")  # every run of it, killed ones too
        first = [x["first_transports"] for x in summaries if x["first_transports"]]
        result.transports.append(first[0] if first else [])
        if first and any(kind != TRANSPORT[s.shared_memory] for kind in first[0]):
            problems.append(f"worker {n} did not start on {TRANSPORT[s.shared_memory]}: {first[0]}")
    result.versions = versions
    result.values = [(float(t.min()), float(t.max())) if t.numel() else (float("nan"),) * 2 for t in shards]
    # async: each acknowledged push adds +1 once; sync: each of the K rounds adds the mean of -1s, +1.
    result.expected = result.total_acked if s.mode != "sync" else max(result.steps.values())
    result.skew = max(versions) - min(versions)
    if s.replicas > 1 and len(result.copy_versions) == SHARDS * s.replicas:
        for k in range(SHARDS):  # both in sync: the backup holds every update its primary acknowledged
            held = result.copy_versions[k * s.replicas : (k + 1) * s.replicas]
            if any(v != versions[k] for v in held):
                problems.append(f"shard {k}'s copies hold versions {held}; its primary served {versions[k]}")
    if stalled:
        return result
    for i, (lo, hi) in enumerate(result.values):
        if shards[i].numel() == 0:
            problems.append(f"shard {i} holds no element: the check needs a piece on every shard")
            continue
        result.lost.append(max(0, round(result.expected - lo)))
        result.twice.append(max(0, round(hi - result.expected)))
        if lo != hi:
            problems.append(f"shard {i}'s elements differ: {shards[i].tolist()}")
        if (lo, hi) != (versions[i], versions[i]):
            problems.append(f"shard {i} holds {lo, hi} at version {versions[i]}: one +1 per version expected")
    if sum(result.lost):
        problems.append(f"lost {result.lost} (per shard)")
    if sum(result.twice):
        problems.append(f"applied twice {result.twice} (per shard)")
    if result.skew:
        problems.append(f"shard versions differ by {result.skew}: {versions}")
    if any(v != result.expected for v in versions) and not sum(result.lost) and not sum(result.twice):
        problems.append(f"versions {versions}, expected {result.expected}")
    return result


# -- the stress run ---------------------------------------------------------------------------------------------


def scenarios(
    seed: int,
    kills: int,
    worker_kills: int,
    steps: int,
    copy_kills: int = 8,
    replica_worker_kills: int = 2,
    replica_steps: int = 1200,
) -> list[Scenario]:
    """The stress run: async and sync, over shared memory and the data socket, with several checkpoint
    schedules (the log alone, every 50 versions, every second); then the same with --replicas 2, with and without
    a checkpoint dir, `copy_kills` split between primaries (the larger half) and backups."""
    common = {"shard_kills": kills, "worker_kills": worker_kills, "steps": steps, "timeout": 600.0}
    primaries = (copy_kills + 1) // 2
    replicated = {
        "replicas": 2,
        "shard_kills": primaries,
        "backup_kills": copy_kills - primaries,
        "worker_kills": replica_worker_kills,
        "steps": replica_steps,
        "timeout": 600.0,
        "window": (0.1, 0.9),
        "pace": 0.005,
        "until_kills_done": True,
    }
    return [
        Scenario("async-shm", "async", True, "50", seed=seed, **common),
        Scenario("async-socket", "async", False, "0", seed=seed + 1, **common),
        Scenario("sync-shm", "sync", True, "0", seed=seed + 2, **common),
        Scenario("sync-socket", "sync", False, "1s", seed=seed + 3, **common),
        # The log on disk too: a primary may be killed while its backup catches up (it restarts from its log).
        Scenario("replicas-async-shm", "async", True, "50", seed=seed + 4, **replicated),  # type: ignore[arg-type]
        # Memory only: what was acknowledged survives on the backup alone.
        Scenario("replicas-sync-socket", "sync", False, "0", checkpoint_dir=False, seed=seed + 5, **replicated),  # type: ignore[arg-type]
    ]


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock, printed)")
    p.add_argument("--kills", type=int, default=6, help="shard kills per scenario")
    p.add_argument("--worker-kills", type=int, default=2, help="worker kills per scenario")
    p.add_argument("--steps", type=int, default=1500, help="steps per worker")
    p.add_argument(
        "--copy-kills", type=int, default=8, help="replicas scenarios: kills of copies (primaries, then backups)"
    )
    p.add_argument("--replica-worker-kills", type=int, default=2, help="replicas scenarios: worker kills")
    p.add_argument("--replica-steps", type=int, default=1200, help="replicas scenarios: steps per worker")
    p.add_argument("--checkpoint-every", default=None, help="this --checkpoint-every in every scenario")
    p.add_argument("--only", action="append", default=[], help="run only this scenario (repeatable)")
    p.add_argument("--workdir", default=None, help="keep each scenario's files here (default: a temporary folder)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    print(f"stress_kills: seed {seed} (rerun with --seed {seed})", flush=True)
    chosen = [
        s
        for s in scenarios(
            seed,
            args.kills,
            args.worker_kills,
            args.steps,
            args.copy_kills,
            args.replica_worker_kills,
            args.replica_steps,
        )
        if not args.only or s.name in args.only
    ]
    if not chosen:
        p.error(f"no scenario named {args.only}")
    if args.checkpoint_every is not None:
        chosen = [dataclasses.replace(s, checkpoint_every=args.checkpoint_every) for s in chosen]
    outcomes: list[Outcome] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="stress-kills-") as tmp:
        base = Path(args.workdir) if args.workdir else Path(tmp)
        for s in chosen:
            try:
                o = run_scenario(s, base / s.name, say=lambda m: print(m, flush=True))
            except Exception as exc:  # noqa: BLE001 - one scenario's failure must not hide the others' figures
                errors.append(f"[{s.name}] {type(exc).__name__}: {exc}")
                print(errors[-1], flush=True)
                continue
            outcomes.append(o)
            print(o.summary(), flush=True)
    print()
    print(outcome_table(outcomes))
    bad = [o for o in outcomes if o.problems]
    for o in bad:
        print(f"FAIL {o.scenario.name}: {'; '.join(o.problems)}")
    for e in errors:
        print(f"ERROR {e.splitlines()[0]}")
    kills = sum(len(o.kills) for o in outcomes)
    replicated = [o for o in outcomes if o.scenario.replicas > 1]
    if replicated:
        failovers = [x for o in replicated for x in o.failovers]
        pauses = [x for o in replicated for x in o.outages("backup")]
        print(
            f"replicas: {sum(len(o.kills) for o in replicated)} kills in {len(replicated)} scenarios; failover "
            f"(SIGKILL of an in-sync primary -> first acknowledged push sent after it) min/median/p90/max "
            f"{spread(failovers)}; after a backup's SIGKILL {spread(pauses)}"
        )
    print(f"{kills} kills in {len(outcomes)} scenarios: {'FAIL' if bad or errors else 'ok'}")
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
