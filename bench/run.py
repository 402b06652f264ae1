"""Run paramserver's benchmark suite and write latest.json, latest.md and latest.png.

    python bench/run.py                       the whole suite (several minutes on 2 cores)
    python bench/run.py --quick               tiny sizes and repeats: checks that everything runs (smoke test)
    python bench/run.py --only transport,baselines --repeats 9 --out /tmp/bench

Sections: transport (push/pull against shard processes), baselines (raw TCP, gloo all_reduce, a
torch.distributed.rpc parameter server), training (samples/s against local training, time to 0.95 accuracy),
memory (peak RSS of the shards), sparse (a training step on 4,096 Zipf IDs of a sparse embedding table against
the same step in plain torch, its time and the CPU of every process; IDs/s of one shard under 4 workers; a row
table's memory and time against its size), sparse_many (a 52-table DeepFM-shaped model, 2 workers x 2 shards,
against plain torch: CPU per sample and step time; then workers x shards and 1 to 100 tables), sparse_peer
(TorchRec's DistributedModelParallel on 2 CPU ranks against our step and the local one; needs make bench-peers,
else skipped),
replication (--replicas 2: the push + pull against one copy, failover and catch-up times, with a real etcd),
serving (serving copies beside a DLRM job: the cost to its samples/s, freshness, lookup latency, a cold start),
online (click log files landing while ps-prepare --follow, 2 ps-worker --follow and ps-serve run: each file's lag
to serving against preparing and training it alone, a drifting day's shard memory, the AUC on the next file against
training from scratch, the samples per file after SIGKILLs of ps-prepare and of workers),
link (training over a bandwidth-limited link between network namespaces, with and
without ps-worker --overlap; needs root, else skipped), overlap_backward (training over such links with and without
ps-worker --overlap-backward; root), stream (CNN steps fed from shards over HTTP through a
bandwidth-limited link with and without prefetching, against local disk; needs root, else skipped). Everything runs
on 127.0.0.1 or in the link and stream sections' own namespaces; every process started is stopped, and every
namespace removed, at the end.
Set GLIBC_TUNABLES (e.g. glibc.malloc.hugetlb=1) in the environment to measure another malloc setting; the
value in effect is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/run.py` puts bench/, not the repository, on sys.path
    sys.path.insert(0, str(ROOT))

from bench import (  # noqa: E402
    baselines,
    compress,
    hosts,
    link,
    memory,
    online,
    overlap_backward,
    replication,
    report,
    serving,
    sparse,
    sparse_many,
    sparse_peer,
    stream,
    third_party,
    training,
    transport,
)
from bench.common import Figure, Processes, log, machine_facts, write_atomic  # noqa: E402
from bench.plan import Plan  # noqa: E402

SECTIONS = {
    "transport": transport.run,
    "baselines": baselines.run,
    "training": training.run,
    "memory": memory.run,
    "sparse": sparse.run,
    "sparse_many": sparse_many.run,
    "sparse_peer": sparse_peer.run,
    "replication": replication.run,
    "serving": serving.run,
    "link": link.run,
    "compress": compress.run,
    "overlap_backward": overlap_backward.run,
    "hosts": hosts.run,
    "stream": stream.run,
    "online": online.run,
    "third_party": third_party.run,
}
DEFAULT_OUT = ROOT / "bench" / "results"
# The page whose summary table a full run rewrites, between report_summary's markers.
PERFORMANCE_PAGE = "docs/performance.md"


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        listed = ", ".join(unknown) or "(none)"
        raise argparse.ArgumentTypeError(f"unknown section(s) {listed}; use {', '.join(SECTIONS)}")
    return [s for s in SECTIONS if s in names]  # always in the suite's order


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python bench/run.py` (what `make bench` calls)."""
    parser = argparse.ArgumentParser(
        prog="python bench/run.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes and repeats, about a minute (smoke test)")
    parser.add_argument(
        "--render",
        action="store_true",
        help="run nothing: render latest.md, latest.png and docs/performance.md's summary again from OUT/latest.json",
    )
    parser.add_argument(
        "--only",
        type=_sections,
        default=list(SECTIONS),
        metavar="SECTIONS",
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--repeats",
        type=_positive,
        default=None,
        metavar="N",
        help="timed iterations per transport/baseline figure after the warm-up; payloads under 50 MB get 4x, "
        "under 1 MB 10x (default: 5, --quick: 2)",
    )
    parser.add_argument(
        "--train-repeats",
        type=_positive,
        default=None,
        metavar="N",
        help="whole training runs per training figure (default: 3, --quick: 1)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help="directory for latest.json, latest.md, latest.png (default: bench/results)",
    )
    return parser


def run_order(sections: Sequence[str]) -> list[str]:
    """The sections in the suite's order, except that the baselines run both before and after the transport cases
    when both are asked for: this machine's speed drifts by up to 2x over minutes, and a baseline measured on both
    sides of the cases it is compared with carries the same drift into its median."""
    if "transport" in sections and "baselines" in sections:
        rest = [s for s in sections if s not in ("transport", "baselines")]
        return ["baselines", "transport", "baselines", *rest]
    return list(sections)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


def run(plan: Plan, sections: Sequence[str]) -> dict[str, Any]:
    """Run the sections in order; a failing section is recorded and the others still run."""
    started = time.monotonic()
    doc: dict[str, Any] = {
        "suite": "paramserver benchmarks",
        "schema": 1,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": [Path(sys.executable).name, *sys.argv],
        "plan": plan.to_json(),
        "machine": machine_facts(),
        "sections": {},
        "figures": [],
    }
    measured: dict[str, Figure] = {}
    for name in run_order(sections):
        t0 = time.monotonic()
        log(f"section {name}")
        before = doc["sections"].get(name, {"ok": True, "seconds": 0.0})
        try:
            with Processes() as procs:
                figures = SECTIONS[name](plan, procs)
        except Exception as exc:  # noqa: BLE001 - recorded in the results; the other sections still run
            log(f"section {name} failed:\n{traceback.format_exc()}")
            doc["sections"][name] = {"ok": False, "seconds": round(time.monotonic() - t0, 1), "error": str(exc)}
            continue
        for f in figures:
            if f.id in measured:  # a second pass (baselines): its repeats join the first pass's
                measured[f.id].repeats += f.repeats
            else:
                measured[f.id] = f
        doc["sections"][name] = {
            **before,
            "seconds": round(before["seconds"] + time.monotonic() - t0, 1),
            "figures": len([f for f in measured.values() if f.section == name]),
        }
    doc["figures"] = [f.to_json() for f in measured.values()]
    doc["seconds"] = round(time.monotonic() - started, 1)
    if hasattr(os, "getloadavg"):
        doc["machine"]["load_average_end"] = list(os.getloadavg())
    report.add_ratios(doc)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run, write the three files, print the markdown; non-zero when a section failed."""
    args = build_parser().parse_args(argv)
    out: Path = args.out
    if args.render:
        doc = json.loads((out / "latest.json").read_text())
        report.add_ratios(doc)
        _write(doc, out)
        return 0
    if args.quick:
        plan = Plan.quick_plan(repeats=args.repeats or 2, train_repeats=args.train_repeats or 1)
    else:
        plan = Plan.full(repeats=args.repeats or 5, train_repeats=args.train_repeats or 3)
    signal.signal(signal.SIGTERM, _interrupt)  # stop every child and shard on the way out, as on Ctrl-C
    try:
        doc = run(plan, args.only)
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc}); every process was stopped, no results written")
        return 130
    write_atomic(out / "latest.json", json.dumps(doc, indent=1) + "\n")
    print(_write(doc, out))
    log(f"wrote {out / 'latest.json'}, latest.md, latest.png in {doc['seconds']:.0f} s")
    return 0 if all(s["ok"] for s in doc["sections"].values()) else 1


def _write(doc: dict[str, Any], out: Path) -> str:
    """Write latest.md and latest.png; a full run of every section into bench/results also updates the summary
    table of docs/performance.md. Return the markdown."""
    text = report.markdown(doc)
    write_atomic(out / "latest.md", text)
    if not report.plot(doc, out / "latest.png"):
        log("matplotlib is not installed: no latest.png (pip install matplotlib)")
    full = not doc["plan"]["quick"] and set(doc["sections"]) == set(SECTIONS)
    if full and out.resolve() == DEFAULT_OUT.resolve():
        if report.update_readme(doc, ROOT / PERFORMANCE_PAGE):
            log(f"updated the performance summary in {PERFORMANCE_PAGE}")
        else:
            log(f"{PERFORMANCE_PAGE} has no bench summary markers: not updated")
    return text


if __name__ == "__main__":
    sys.exit(main())
