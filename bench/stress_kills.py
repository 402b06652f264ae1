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

Worker processes run `python bench/stress_kills.py worker ...` (below); tests/test_durability.py runs short
scenarios of this harness inside `make test`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on sys.path, the repository root is not
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from paramserver import LocalCluster, ServerConfig  # noqa: E402
from paramserver.errors import Aborted, PullTimeout  # noqa: E402
from paramserver.procs import die_with_parent  # noqa: E402
from paramserver.v1 import ps_pb2, ps_pb2_grpc  # noqa: E402
from worker import PSClient  # noqa: E402

SHARDS = 2
SIZES = {"a": 4, "b": 4}  # placement puts one tensor on each of the two shards
TRANSPORT = {True: "shared memory", False: "data socket"}


def _model() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(n) for name, n in SIZES.items()}


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
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, grad = _model(), _model()
    refused = 0
    first_kinds: list[str] = []
    with (
        PSClient(args.address, worker_id=args.worker_id, shared_memory=not args.no_shared_memory, timeout=90) as c,
        open(args.out, "a", buffering=1) as out,
    ):
        c.register(model)  # adopts the shards' weights (or initialises them with zeros, for the first worker)
        for step in range(args.start, args.steps + 1):
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
            out.write(f"{step}\n")  # acknowledged
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


# -- scenarios and outcomes -------------------------------------------------------------------------------------


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


@dataclass
class Kill:
    what: str  # "shard 1", "worker w0"
    at_acked: int  # acknowledged pushes (all workers) when it was killed
    down_s: float  # from the kill until it served (shard) or ran (worker) again


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

    @property
    def total_acked(self) -> int:
        return sum(self.acked.values())

    def summary(self) -> str:
        s = self.scenario
        kills = ", ".join(f"{k.what} at {k.at_acked} acked (down {k.down_s:.1f} s)" for k in self.kills) or "none"
        return (
            f"[{s.name}] mode {s.mode}, {TRANSPORT[s.shared_memory]}, checkpoint_every {s.checkpoint_every!r}, "
            f"{s.workers} workers x {s.steps} steps, seed {s.seed}: kills: {kills}; acknowledged pushes "
            f"{self.total_acked} {self.acked}; expected value {self.expected} on every shard; values (min, max) "
            f"per shard {self.values}; versions {self.versions}; lost {self.lost}; applied twice {self.twice}; "
            f"skew {self.skew}; resent after refusal {self.refused}; transports {self.transports}; "
            f"{self.seconds:.1f} s; problems: {self.problems or 'none'}"
        )


# -- running one scenario ---------------------------------------------------------------------------------------


def _acked_steps(path: Path) -> list[int]:
    """The steps a worker's file holds (complete lines only: one being written when it was killed is not)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [int(x) for x in text.split("\n")[:-1] if x]


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


class _Job:
    """The cluster and the worker processes of one scenario; stops every process it started."""

    def __init__(self, scenario: Scenario, workdir: Path) -> None:
        self.s = scenario
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        config = ServerConfig(
            mode=scenario.mode,
            workers=scenario.workers,
            optimizer="sgd",
            lr=1.0,
            checkpoint_dir=str(workdir / "ckpt"),
            checkpoint_every=scenario.checkpoint_every,
            lease_timeout=scenario.lease_timeout,
            pull_timeout=scenario.pull_timeout,
        )
        # STRESS_LOG_LEVEL=INFO: the shards say what they restore (on stderr).
        level = os.environ.get("STRESS_LOG_LEVEL", "WARNING")
        self.cluster = LocalCluster(config, shards=SHARDS, processes=True, log_level=level)
        self.names = [f"w{i}" for i in range(scenario.workers)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.exits: dict[str, list[int]] = {n: [] for n in self.names}  # exit codes of earlier incarnations

    def out(self, name: str) -> Path:
        return self.dir / f"{name}.steps"

    def log(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def start_worker(self, name: str) -> None:
        out = self.out(name)
        if out.exists():  # drop a line cut short by a kill: the step it names was not written as acknowledged
            data = out.read_bytes()
            out.write_bytes(data[: data.rfind(b"\n") + 1])
        done = _acked_steps(out)
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "worker", "--address", self.cluster.address,
            "--worker-id", f"stress-{self.s.name}-{name}", "--steps", str(self.s.steps),
            "--start", str(max(done, default=0) + 1), "--out", str(out),
            "--summary", str(self.dir / f"{name}.summary"),
        ]  # fmt: skip
        if not self.s.shared_memory:
            cmd.append("--no-shared-memory")
        with open(self.log(name), "ab") as log:
            self.procs[name] = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL),
            )

    def acked(self) -> int:
        return sum(_count_lines(self.out(n)) for n in self.names)

    def running(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def check_workers(self) -> None:
        for n, p in self.procs.items():
            code = p.poll()
            if code not in (None, 0):
                raise RuntimeError(f"worker {n} exited with {code}:\n{self.tail(n)}")

    def tail(self, name: str, chars: int = 4000) -> str:
        try:
            return self.log(name).read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop_workers(self) -> None:
        running = [p for p in self.procs.values() if p.poll() is None]
        for p in running:
            p.kill()
        for p in running:
            p.wait()

    @contextmanager
    def running_job(self) -> Iterator[_Job]:
        try:
            with self.cluster:
                try:
                    for n in self.names:
                        self.start_worker(n)
                    yield self
                finally:
                    self.stop_workers()
        finally:
            self.stop_workers()


def _plan(s: Scenario, rng: random.Random) -> list[tuple[float, str, int]]:
    """(progress fraction, "shard" | "worker", index) for each kill, in order of progress."""
    kinds = ["shard"] * s.shard_kills + ["worker"] * s.worker_kills
    rng.shuffle(kinds)
    lo, hi = s.window
    points = sorted(rng.uniform(lo, hi) for _ in kinds)
    return [(x, k, rng.randrange(SHARDS if k == "shard" else s.workers)) for x, k in zip(points, kinds, strict=True)]


def _versions(addresses: list[str]) -> list[int | str]:
    """Each shard's version (GetTopology), or why it did not answer."""
    out: list[int | str] = []
    for address in addresses:
        channel = grpc.insecure_channel(address)
        try:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            out.append(int(stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=5).version))
        except grpc.RpcError as err:
            out.append(f"({err.code().name})")
        finally:
            channel.close()
    return out


def _read_shards(address: str) -> tuple[list[int], list[torch.Tensor]]:
    """Every shard's version and its elements, read by a client that does not join (gRPC)."""
    with PSClient(address, join=False, shared_memory=False, data_socket=False, timeout=30) as reader:
        weights = _model()
        reader.pull(weights)
        placement = reader.placement(weights)
        per_shard = [
            torch.cat([weights[p.name].reshape(-1)[p.start : p.start + p.length] for p in pieces])
            if pieces
            else torch.empty(0)
            for pieces in placement.shards
        ]
        return list(reader.versions), per_shard


def _kill_shard(job: _Job, index: int, rng: random.Random, acked: int) -> Kill:
    """SIGKILL shard process `index`, wait 0.5-1 s, start it again on its port with the same command."""
    job.cluster.kill(index)
    killed_at = time.monotonic()
    job.cluster.procs[index].wait(timeout=10)
    time.sleep(rng.uniform(0.5, 1.0))
    job.cluster.restart(index)
    return Kill(f"shard {index}", acked, time.monotonic() - killed_at)


def _kill_worker(job: _Job, index: int, rng: random.Random, acked: int) -> Kill | None:
    """SIGKILL worker `index` (or another still running, if it finished), start it again 0.2-1 s later with its
    worker id, from the step after the last one acknowledged; None when every worker has finished."""
    name = job.names[index]
    if job.procs[name].poll() is not None:
        live = job.running()
        if not live:
            return None
        name = live[0]
    proc = job.procs[name]
    proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    job.exits[name].append(proc.wait(timeout=10))
    time.sleep(rng.uniform(0.2, 1.0))
    job.start_worker(name)
    return Kill(f"worker {name}", acked, time.monotonic() - killed_at)


def run_scenario(s: Scenario, workdir: Path, say: Any = print) -> Outcome:
    """Run one scenario with its kills; return what the shards hold against what was acknowledged."""
    rng = random.Random(s.seed)
    plan = _plan(s, rng)
    result = Outcome(scenario=s)
    total = s.workers * s.steps
    began = time.monotonic()
    job = _Job(s, workdir)
    with job.running_job():
        say(
            f"[{s.name}] seed {s.seed}: kills at progress "
            + (", ".join(f"{x:.2f} ({k} {i})" for x, k, i in plan) or "none")
        )
        last_acked, moved_at, after_restart = 0, time.monotonic(), 0
        pending = list(plan)
        while job.running() or pending:
            job.check_workers()
            now = time.monotonic()
            acked = job.acked()
            if acked != last_acked:
                last_acked, moved_at = acked, now
            if now - moved_at > s.stall or now - began > s.timeout:
                why = f"no push acknowledged for {now - moved_at:.0f} s" if now - moved_at > s.stall else "timeout"
                last = {n: max(_acked_steps(job.out(n)), default=0) for n in job.names}
                stalled = (
                    f"the job stalled ({why}) at {acked}/{total} acknowledged, shard versions "
                    f"{_versions(job.cluster.addresses)}, last step acknowledged per worker {last}"
                )
                say(f"[{s.name}] {stalled}; the workers' last lines:")
                for n in job.names:
                    say(f"--- {n}:\n" + "\n".join(job.tail(n).strip().splitlines()[-6:]))
                result.problems.append(stalled)
                job.stop_workers()
                break
            # The next kill once the job reached its point and made progress since the last restart.
            if pending and acked >= pending[0][0] * total and acked >= after_restart + 2 * s.workers:
                _, kind, index = pending.pop(0)
                kill = _kill_shard(job, index, rng, acked) if kind == "shard" else _kill_worker(job, index, rng, acked)
                if kill is not None:
                    result.kills.append(kill)
                    say(
                        f"[{s.name}] killed {kill.what} at {acked}/{total} acknowledged; back after {kill.down_s:.1f} s"
                    )
                after_restart = job.acked()
                moved_at = time.monotonic()
                continue
            if not job.running() and pending:  # the job ended before its last kills: they cannot happen
                last = {n: max(_acked_steps(job.out(n)), default=0) for n in job.names}
                say(f"[{s.name}] the job finished before {len(pending)} planned kill(s) (last steps {last})")
                break
            time.sleep(0.01)
        if not result.problems:  # (workers stopped after a stall were SIGKILLed)
            job.check_workers()
        versions, shards = _read_shards(job.cluster.address)
    result.seconds = time.monotonic() - began
    return _judge(result, job, versions, shards)


def _judge(result: Outcome, job: _Job, versions: list[int], shards: list[torch.Tensor]) -> Outcome:
    s = result.scenario
    problems = result.problems
    stalled = bool(problems)  # then pushes were in flight and sync rounds open: no exact count to check against
    for n in job.names:
        steps = _acked_steps(job.out(n))
        result.acked[n] = len(set(steps))
        if steps != list(range(1, s.steps + 1)) and not stalled:
            problems.append(f"worker {n} acknowledged {len(steps)} of steps 1..{s.steps} (not each once, in order)")
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
    result.expected = result.total_acked if s.mode != "sync" else s.steps
    result.skew = max(versions) - min(versions)
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


def scenarios(seed: int, kills: int, worker_kills: int, steps: int) -> list[Scenario]:
    """The stress run: async and sync, over shared memory and the data socket, with several checkpoint
    schedules (the log alone, every 50 versions, every second)."""
    common = {"shard_kills": kills, "worker_kills": worker_kills, "steps": steps, "timeout": 600.0}
    return [
        Scenario("async-shm", "async", True, "50", seed=seed, **common),
        Scenario("async-socket", "async", False, "0", seed=seed + 1, **common),
        Scenario("sync-shm", "sync", True, "0", seed=seed + 2, **common),
        Scenario("sync-socket", "sync", False, "1s", seed=seed + 3, **common),
    ]


def _table(outcomes: list[Outcome]) -> str:
    head = (
        f"{'scenario':<14} {'ckpt':>5} {'kills':>11} {'acked':>6} {'versions':>12} {'lost':>5} {'twice':>6} "
        f"{'skew':>5} {'resent':>6} {'secs':>6}  result"
    )
    rows = [head, "-" * len(head)]
    for o in outcomes:
        s = o.scenario
        shard_kills = sum(k.what.startswith("shard") for k in o.kills)
        worker_kills = len(o.kills) - shard_kills
        rows.append(
            f"{s.name:<14} {s.checkpoint_every:>5} {f'{shard_kills}s+{worker_kills}w':>11} {o.total_acked:>6} "
            f"{'/'.join(map(str, o.versions)):>12} {sum(o.lost):>5} {sum(o.twice):>6} {o.skew:>5} {o.refused:>6} "
            f"{o.seconds:>6.1f}  {'ok' if not o.problems else 'STALL' if 'stalled' in o.problems[0] else 'FAIL'}"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock, printed)")
    p.add_argument("--kills", type=int, default=6, help="shard kills per scenario")
    p.add_argument("--worker-kills", type=int, default=2, help="worker kills per scenario")
    p.add_argument("--steps", type=int, default=1500, help="steps per worker")
    p.add_argument("--checkpoint-every", default=None, help="this --checkpoint-every in every scenario")
    p.add_argument("--only", action="append", default=[], help="run only this scenario (repeatable)")
    p.add_argument("--workdir", default=None, help="keep each scenario's files here (default: a temporary folder)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    print(f"stress_kills: seed {seed} (rerun with --seed {seed})", flush=True)
    chosen = [
        s for s in scenarios(seed, args.kills, args.worker_kills, args.steps) if not args.only or s.name in args.only
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
    print(_table(outcomes))
    bad = [o for o in outcomes if o.problems]
    for o in bad:
        print(f"FAIL {o.scenario.name}: {'; '.join(o.problems)}")
    for e in errors:
        print(f"ERROR {e.splitlines()[0]}")
    kills = sum(len(o.kills) for o in outcomes)
    print(f"{kills} kills in {len(outcomes)} scenarios: {'FAIL' if bad or errors else 'ok'}")
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
