"""Stream: does prefetching hide the storage? A worker's training steps fed from shards over a bandwidth-limited
HTTP link, against the same steps fed from local disk (issue 18: at least 0.9x, where the link's bandwidth allows).

A dataset of image-like samples (3x32x32 float32, 10 classes) is prepared into Parquet shards (worker/data/prepare.py).
Hosts are network namespaces on a bridge (deploy/netns/netlab.py): two storage hosts, each serving the shards with
`python -m http.server`, and a worker host whose consumer does a real forward, backward and SGD step of the
project's CNN on each batch, on one CPU thread. The storage hosts' links are limited by a tbf token bucket:

- storage-0 at `FAST` x the consumer's data rate (its samples/s from local disk x the shards' bytes per sample,
  measured by a calibration run first): the link allows it, so prefetching should hide it;
- storage-1 at `SLOW` x that rate: the link cannot keep up, and the reader should run at the link's rate.

The consumer (`python -m bench.stream consume ...`, in the worker's host) reads, interleaved within each repeat:
`local` (StreamedDataset on the local directory, prefetch 2), `prefetch` (StreamedDataset over HTTP from storage-0,
prefetch 2, the default), `sequential` (the same shards and checks over the same link, each shard read in the
step's thread and then computed on: a reader that does not overlap) and `slow` (prefetch 2 from storage-1, over a
share of the shards so that the slow link does not dominate the run). `Plan.repeats` such rounds (5, quick 2),
each in a rotated order; every pass is timed whole, from the reader's start (the first shard, which nothing can
hide, included) to the last step.

Needs root (ip netns, tc): elsewhere the section is skipped and says why.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import ROOT, Figure, Processes, log, median
from bench.link import _netlab, unavailable
from bench.plan import Plan

SECTION = "stream"
TIMEOUT = 600.0
PORT = 8000
FAST = 2.0  # the storage link over the consumer's data rate, where it should keep up
SLOW = 0.5  # ... and where it cannot
TARGET = 0.9  # streamed samples/s over local-disk samples/s (issue 18)
SHAPE = (3, 32, 32)
CLASSES = 10
BATCH = 64
HOSTS = {"storage-0": 30, "storage-1": 31, "worker-0": 20}
RUNS = ("local", "prefetch", "sequential", "slow")
TAG = "STREAM-RUN "


def _sizes(plan: Plan) -> tuple[int, int]:
    """(train shards, samples per shard): about 2.5 s of the CNN per pass in the full run, under 1 s in quick."""
    return (8, 32) if plan.quick else (32, 32)


def _write_npz(path: Path, samples: int, test: int) -> None:
    """Image-like samples: a low-frequency template per class under pixel noise, so that the model has something
    to learn and zstd finds about as little to squeeze as in real float images."""
    import numpy as np

    rng = np.random.default_rng(18)
    templates = np.kron(rng.normal(size=(CLASSES, SHAPE[0], 4, 4)), np.ones((1, 1, 8, 8))).astype(np.float32)
    arrays: dict[str, Any] = {}
    for split, n in (("train", samples), ("test", test)):
        y = rng.integers(0, CLASSES, size=n)
        x = templates[y] + rng.normal(scale=0.5, size=(n, *SHAPE)).astype(np.float32)
        arrays[f"x_{split}"], arrays[f"y_{split}"] = x.astype(np.float32), y.astype(np.int64)
    np.savez(path, **arrays)


def _prepare(work: Path, plan: Plan) -> tuple[Path, dict[str, Any]]:
    """Write the dataset's shards under work/data; return the directory and the train split's sizes."""
    from worker.data.prepare import PrepareConfig, prepare

    shards, per_shard = _sizes(plan)
    npz = work / "images.npz"
    _write_npz(npz, shards * per_shard, 2 * BATCH)
    data = work / "data"
    manifest = prepare(str(npz), PrepareConfig(out=str(data), shards=shards, test_shards=1, progress=False))
    npz.unlink()
    train = manifest.splits["train"]
    nbytes = sum(s.bytes for s in train.shards)
    return data, {"shards": len(train.shards), "samples": train.samples, "bytes_per_sample": nbytes / train.samples}


def _rate(bits_per_second: float) -> str:
    """A tc rate, to about three digits (tc's units are decimal: 1mbit = 10^6 bit/s)."""
    if bits_per_second >= 10e6:
        return f"{round(bits_per_second / 1e6)}mbit"
    return f"{max(100, round(bits_per_second / 1e3))}kbit"


def _bits(rate: str) -> float:
    for unit, scale in (("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate.removesuffix(unit)) * scale
    raise ValueError(f"not a rate of ours: {rate!r}")


def _serve(lab: Any, host: str, data: Path, work: Path) -> str:
    """Start Python's HTTP server in the host's namespace on its lab address; return the dataset's URL."""
    address = lab.address(host)
    log_file = work / f"{host}.log"
    argv = [sys.executable, "-u", "-m", "http.server", "--bind", address, "--directory", str(data), str(PORT)]
    proc = lab.popen(host, argv, log_file)
    deadline = time.monotonic() + 30
    while "Serving HTTP on" not in log_file.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server on {host} did not start:\n{log_file.read_text(errors='replace')}")
        time.sleep(0.05)
    return f"http://{address}:{PORT}"


def _consume(lab: Any, work: Path, name: str, args: list[str]) -> list[dict[str, Any]]:
    """Run the consumer in the worker's host; its runs' results in order."""
    argv = [sys.executable, "-m", "bench.stream", "consume", *args]
    out = work / f"{name}.log"
    proc = lab.popen("worker-0", argv, out, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        status = proc.wait(timeout=TIMEOUT)
    finally:
        lab.stop_all()
    text = out.read_text(errors="replace")
    if status != 0:
        raise RuntimeError(f"the stream consumer ({name}) failed with {status}:\n{text[-3000:]}")
    return [json.loads(line[len(TAG) :]) for line in text.splitlines() if line.startswith(TAG)]


def _measure(work: Path, data: Path, sizes: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Calibrate, limit the storage links, then the interleaved runs; every namespace and process is gone after."""
    netlab = _netlab()
    netlab.cleanup_stale()
    slow_world = max(1, sizes["shards"] // 8)
    with netlab.Lab(hosts=HOSTS) as lab:
        # The link's rate follows from the consumer's own speed on this machine, measured here, not assumed.
        passes = "1" if plan.quick else "2"
        calibration = _consume(lab, work, "calibrate", ["--local", str(data), "--runs", "local", "--repeats", passes])
        # The best pass: others' load on a shared machine only ever slows the consumer, and the link must allow
        # what it can do.
        local_sps = max(r["samples_per_second"] for r in calibration)
        data_rate = local_sps * sizes["bytes_per_sample"] * 8
        fast, slow = _rate(FAST * data_rate), _rate(SLOW * data_rate)
        log(
            f"stream: the consumer takes {local_sps:.0f} samples/s from local disk = {data_rate / 1e6:.1f} Mbit/s of "
            f"shards ({sizes['bytes_per_sample'] / 1e3:.1f} KB/sample); storage links {fast} ({FAST:g}x) and "
            f"{slow} ({SLOW:g}x)"
        )
        for host, rate in (("storage-0", fast), ("storage-1", slow)):
            # 64 KB of burst: one GSO packet of the veth's, so tbf need not split them, and little beyond the rate.
            lab.limit_bandwidth(host, rate=rate, burst="64kb", latency="100ms")
        fast_url = _serve(lab, "storage-0", data, work)
        slow_url = _serve(lab, "storage-1", data, work)
        args = [
            "--local", str(data), "--fast", fast_url, "--slow", slow_url, "--runs", ",".join(RUNS),
            "--repeats", str(plan.repeats), "--slow-world", str(slow_world),
        ]  # fmt: skip
        runs = _consume(lab, work, "runs", args)
    return {
        "calibration_sps": local_sps,
        "data_rate": data_rate,
        "fast": fast,
        "slow": slow,
        "slow_world": slow_world,
        "runs": runs,
    }


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """Samples/s of CNN steps fed from local disk, over HTTP through a limited link with and without prefetching,
    and through a link too slow for the consumer."""
    why = unavailable()
    if why is not None:
        log(f"section {SECTION} skipped: {why}")
        return []
    with tempfile.TemporaryDirectory(prefix="ps-bench-stream-") as tmp:
        work = Path(tmp)
        data, sizes = _prepare(work, plan)
        got = _measure(work, data, sizes, plan)
    by_run: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNS}
    for r in got["runs"]:
        by_run[r["run"]].append(r)
    return _figures(sizes, got, by_run)


def _figures(sizes: dict[str, Any], got: dict[str, Any], by_run: dict[str, list[dict[str, Any]]]) -> list[Figure]:
    common = {
        "model": "cnn",
        "sample": "x".join(map(str, SHAPE)),
        "batch_size": BATCH,
        "shards": sizes["shards"],
        "samples": sizes["samples"],
        "bytes_per_sample": round(sizes["bytes_per_sample"], 1),
        "data_rate_mbit": round(got["data_rate"] / 1e6, 2),
        "calibration_sps": round(got["calibration_sps"], 1),
        "target": TARGET,
    }
    where = {
        "local": ("local disk", None, 2),
        "prefetch": ("HTTP", got["fast"], 2),
        "sequential": ("HTTP", got["fast"], 0),
        "slow": ("HTTP", got["slow"], 2),
    }
    figures = []
    for name, done in by_run.items():
        storage, rate, prefetch = where[name]
        sps = [r["samples_per_second"] for r in done]
        link = f" over a {rate} link" if rate else ""
        reader = "prefetch 2" if prefetch else "no prefetch (read a shard, then compute on it)"
        local = [r["samples_per_second"] for r in by_run["local"]]
        paired = [round(a / b, 4) for a, b in zip(sps, local, strict=False)] if name != "local" else []
        # Without the wait for the first batch, which no reader can hide: the rate once data flows.
        flowing = [r["samples"] / (r["seconds"] - r["first_batch"]) for r in done]
        extra: dict[str, Any] = {
            "waited_s": [round(r["waited"], 3) for r in done],
            "first_batch_s": [round(r["first_batch"], 3) for r in done],
            "cpu_s": [round(r["cpu"], 3) for r in done],
            "sps_after_first_batch": [round(x, 2) for x in flowing],
            "seconds": [round(r["seconds"], 3) for r in done],
            "samples": done[0]["samples"] if done else 0,
            **({"paired_ratios": paired} if paired else {}),
        }
        if rate:
            use = [r["bytes"] * 8 / r["seconds"] / _bits(rate) for r in done]
            extra["link_use"] = [round(u, 4) for u in use]
            extra["link_use_median"] = round(median(use), 4)
        figures.append(
            Figure(
                id=f"{SECTION}.sps.{name}",
                section=SECTION,
                title=f"samples/s of CNN steps fed from {storage}{link}, {reader}",
                unit="samples/s",
                repeats=[round(x, 2) for x in sps],
                params={
                    **common,
                    "run": name,
                    "storage": storage,
                    "rate": rate,
                    "rate_x": FAST if name in ("prefetch", "sequential") else SLOW if name == "slow" else None,
                    "prefetch": prefetch,
                    "world": got["slow_world"] if name == "slow" else 1,
                },
                compare=[f"{SECTION}.sps.local"] if name in ("prefetch", "sequential") else [],
                extra=extra,
            )
        )
        line = f"stream {name}{link}: {median(sps):.0f} samples/s"
        if rate:
            line += f", link use {extra['link_use_median']:.2f}, waited {median(extra['waited_s']):.2f} s"
        line += f", consumer CPU {median([r['cpu'] / r['seconds'] for r in done]):.2f} cores"
        log(line)
    by_name = {f.params["run"]: f for f in figures}
    ratio = by_name["prefetch"].median / by_name["local"].median
    steady = median(by_name["prefetch"].extra["sps_after_first_batch"]) / median(
        by_name["local"].extra["sps_after_first_batch"]
    )
    by_name["prefetch"].extra["ratio_after_first_batch"] = round(steady, 4)
    verdict = "met" if ratio >= TARGET else "not met"
    log(
        f"stream: prefetch over a {got['fast']} link ÷ local disk = {ratio:.3f} (target ≥ {TARGET}: {verdict}); "
        f"{steady:.3f} after the first batch"
    )
    return figures


# -- the consumer: runs in the worker's host ---------------------------------------------------------------------


def _sequential(dataset: Any, parts: list[Any], batch: int) -> Iterator[tuple[Any, Any]]:
    """A reader that does not overlap: each shard read (and checked, and decoded) in the step's thread, then its
    batches; batches cross shard boundaries as the streaming reader's do, so both feed the same steps."""
    import numpy as np
    import torch

    held_x, held_y = None, None
    for part in parts:
        began = time.perf_counter()
        x, y, _ = dataset.read(part)
        dataset.waited += time.perf_counter() - began
        dataset.fetched += 1
        if held_x is not None:
            x, y = np.concatenate([held_x, x]), np.concatenate([held_y, y])
        full = len(x) // batch * batch
        for i in range(0, full, batch):
            yield torch.from_numpy(np.ascontiguousarray(x[i : i + batch])), torch.from_numpy(y[i : i + batch])
        held_x, held_y = x[full:], y[full:]
    if held_x is not None and len(held_x):
        yield torch.from_numpy(np.ascontiguousarray(held_x)), torch.from_numpy(held_y)


def _consume_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stream consume")
    parser.add_argument("--local", required=True, help="the prepared dataset's directory")
    parser.add_argument("--fast", default="", help="its URL behind the link that allows the consumer's rate")
    parser.add_argument("--slow", default="", help="its URL behind the link that does not")
    parser.add_argument("--runs", required=True, help=f"comma-separated, of {','.join(RUNS)}")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--slow-world", type=int, default=1, help="the slow run reads rank 0's share of this world")
    parser.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from worker.data.stream import StreamedDataset
    from worker.models.builtin import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("cnn", in_shape=SHAPE, num_classes=CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    import pyarrow.parquet  # noqa: F401 - imported by the first shard's decoding otherwise, inside the first timing

    for _ in range(3):  # the first steps allocate and pick kernels: not the storage's doing
        step(torch.randn(args.batch, *SHAPE), torch.randint(0, CLASSES, (args.batch,)))

    runs = args.runs.split(",")
    sources = {"local": args.local, "prefetch": args.fast, "sequential": args.fast, "slow": args.slow}
    for repeat in range(args.repeats):
        # Rotated each repeat, so that no reader always runs first (or right after another one).
        for name in runs[repeat % len(runs) :] + runs[: repeat % len(runs)]:
            world = args.slow_world if name == "slow" else 1
            dataset = StreamedDataset(sources[name], prefetch=2)  # the manifest's read is not timed
            parts = dataset.plan(0, world, seed=0, epoch=repeat)
            samples, first = 0, 0.0
            cpu = time.process_time()
            began = time.perf_counter()
            if name == "sequential":
                batches: Iterator[tuple[torch.Tensor, ...]] = _sequential(dataset, parts, args.batch)
            else:
                batches = dataset.batches(0, world, args.batch, seed=0, epoch=repeat)
            try:
                for x, y in batches:
                    if not samples:
                        first = time.perf_counter() - began
                    step(x, y)
                    samples += len(y)
                seconds = time.perf_counter() - began
                cpu = time.process_time() - cpu
            finally:
                # Its reader runs on into the next epoch: stopped, so that it takes nothing from the next run.
                dataset.close()
            result = {
                "run": name,
                "repeat": repeat,
                "samples": samples,
                "seconds": seconds,
                "samples_per_second": samples / seconds,
                "waited": dataset.waited,
                "first_batch": first,
                "cpu": cpu,
                "fetched": dataset.fetched,
                "bytes": sum(p.shard.bytes for p in parts),
            }
            print(TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    roles = {"consume": _consume_main}
    if sys.argv[1:2] == [] or sys.argv[1] not in roles:
        sys.exit("usage: python -m bench.stream consume ... (run by the stream section, in the lab's worker host)")
    sys.exit(roles[sys.argv[1]](sys.argv[2:]))
