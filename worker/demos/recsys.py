"""`make demo MODEL=recsys`: a recommendation job from the command line, against the same model trained locally.

It runs what a user runs, as subprocesses: the planted click logs (worker.demos.planted) written as Criteo day
files, `ps-prepare --format criteo`, `ps-server` (2 shards, sync, Adagrad) and two `ps-worker --model dlrm`
streaming the prepared shards; then it trains the same DLRM in this process on the same samples (`train_reference`)
and prints the held-out AUC of both next to the ceiling (the planted probabilities' own AUC). A `ps-serve` follows the
job while it trains; at the end the DLRM is served from it, its predictions checked against the model the workers
saved, with the copies' freshness (worker.demos.served).

The two runs see the same samples in the same steps: worker r reads its shards in the order the trainer draws
(StreamedDataset.batches(r, 2, ...)), and the local step t trains on the concatenation of the workers' step-t
batches. Sync mode averages the workers' gradients, each the mean over its own batch, which is the mean over the
combined batch that the local step takes; both start from the same weights (the dense ones from the seed, the rows
from `paramserver.tables.initial_rows`), so the two differ only by float rounding and the order of sums.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from paramserver.tables import initial_rows
from worker.data.features import Features, concat
from worker.data.manifest import Categorical
from worker.data.stream import Part, StreamedDataset
from worker.demos.common import address_of, start_server, start_workers, stop, worker_metrics
from worker.demos.planted import ceiling_auc, make_click_logs, write_criteo
from worker.demos.served import PsServe, check_served
from worker.models.clicks import TableOptions, build_click_model
from worker.train.gradients import evaluate
from worker.train.losses import LossStep, resolve_loss

TARGET_GAP = 0.01  # |distributed AUC - local AUC|
TARGET_FRACTION = 0.85  # of the way from 0.5 to the ceiling
WORKERS = 2


class _LocalTable(nn.Module):
    """A table of the local copy: torch's sparse nn.Embedding (nn.EmbeddingBag for a bag) holding the rows the
    distributed table starts with; unbounded IDs map to rows by binary search over the sorted IDs of the data."""

    def __init__(self, table: nn.Module, vocab: np.ndarray | None, multi_hot: bool) -> None:
        super().__init__()
        spec = table.spec("table")  # type: ignore[operator]
        ids = vocab if vocab is not None else np.arange(spec.num_embeddings)
        weight = torch.from_numpy(initial_rows(spec, ids))
        self.vocab = torch.from_numpy(vocab) if vocab is not None else None
        self.embed: nn.Module = (
            nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode="sum", sparse=True)
            if multi_hot
            else nn.Embedding.from_pretrained(weight, freeze=False, sparse=True)
        )

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        rows = torch.searchsorted(self.vocab, ids) if self.vocab is not None else ids
        return self.embed(rows, offsets) if offsets is not None else self.embed(rows)


@dataclasses.dataclass(frozen=True)
class LocalTables(TableOptions):
    """TableOptions whose tables are local copies (`vocab`: each unbounded feature's sorted IDs)."""

    vocab: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def table(self, feature: Categorical, dim: int | None = None, seed: int = 0) -> nn.Module:
        served = super().table(feature, dim, seed)
        return _LocalTable(served, None if self.table_size else self.vocab[feature.name], feature.multi_hot)


def _vocab(data: StreamedDataset) -> dict[str, np.ndarray]:
    """Each categorical feature's sorted distinct IDs over both splits (the local tables' rows)."""
    schema = data.manifest.schema
    assert schema is not None
    seen: dict[str, list[np.ndarray]] = {f.name: [] for f in schema.categorical}
    for split in data.manifest.splits.values():
        for shard in split.shards:
            _, _, _, *columns = data.read(Part(shard, np.arange(shard.samples)))
            for f, column in zip(schema.categorical, columns, strict=True):
                values = np.concatenate(list(column)) if f.multi_hot else column
                seen[f.name].append(np.unique(values))
    return {name: np.unique(np.concatenate(parts)) for name, parts in seen.items()}


def train_reference(
    dataset: str,
    *,
    model: str = "dlrm",
    tables: TableOptions | None = None,
    workers: int = WORKERS,
    batch_size: int,
    epochs: int = 1,
    lr: float,
    seed: int = 0,
) -> dict[str, float]:
    """Train locally what a sync job of `workers` ps-workers (the job's optimizer Adagrad at `lr`) trains, on the
    same samples in the same steps; return the held-out metrics (test_auc, test_logloss, ...)."""
    tables = tables or TableOptions()
    readers = [StreamedDataset(dataset) for _ in range(workers)]
    try:
        schema = readers[0].manifest.schema
        if schema is None:
            raise ValueError(f"{dataset} has no categorical features: prepare click logs (ps-prepare --format criteo)")
        vocab = {} if tables.table_size else _vocab(readers[0])
        torch.manual_seed(seed)  # the dense weights every worker starts from
        served = build_click_model(model, schema, tables)
        local = build_click_model(model, schema, LocalTables(**dataclasses.asdict(tables), vocab=vocab))
        unexpected = local.load_state_dict(served.state_dict(), strict=False).unexpected_keys
        assert not unexpected, unexpected
        # torch's Adagrad warns once that it skips its checks of the sparse gradients it makes.
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        optimizer = torch.optim.Adagrad(local.parameters(), lr=lr)
        step = LossStep(resolve_loss("bce", "classification"))
        for epoch in range(epochs):
            ranks = [r.batches(k, workers, batch_size, seed=seed, epoch=epoch) for k, r in enumerate(readers)]
            for pairs in zip(*ranks, strict=True):
                x = concat([cast(Features, p[0]) for p in pairs])
                y = torch.cat([p[1] for p in pairs])
                optimizer.zero_grad()
                step(local, x, y).backward()
                optimizer.step()
        return evaluate(local, readers[0].test_batches(8192), torch.device("cpu"), step=step)
    finally:
        for r in readers:
            r.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.demos.recsys", description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-samples", type=int, default=1_200_000, help="training impressions generated")
    parser.add_argument("--test-samples", type=int, default=100_000, help="more impressions (a second day file)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training split")
    parser.add_argument("--batch-size", type=int, default=2048, help="impressions per worker and step")
    parser.add_argument("--lr", type=float, default=0.05, help="Adagrad's learning rate, dense weights and rows")
    parser.add_argument("--dim", type=int, default=16, help="embedding width")
    parser.add_argument(
        "--table-size",
        type=int,
        default=0,
        help="0: unbounded tables keyed by the raw IDs; N: N rows a table (ID mod N)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the click logs, the weights and the batches")
    parser.add_argument("--port", type=int, default=0, help="port of shard 0 (default: 0, free ports)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when the distributed AUC is within TARGET_GAP of the local one and TARGET_FRACTION of the
    way to the ceiling."""
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="ps-recsys-") as tmp:
        planted = _planted_dataset(args, Path(tmp))
        if planted is None:
            return 1
        dataset, ceiling = planted
        began = time.perf_counter()
        tables = TableOptions(dim=args.dim, table_size=args.table_size)
        local = train_reference(
            dataset, tables=tables, batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, seed=args.seed
        )
        print(f"local: AUC {local['test_auc']:.4f} in {time.perf_counter() - began:.1f} s", flush=True)
        try:
            job = _train_distributed(args, dataset, tables, Path(tmp))
        except KeyboardInterrupt:
            print("\ninterrupted: stopping workers and servers", file=sys.stderr)
            return 130
    if job is None:
        return 1
    return _report(job, local["test_auc"], ceiling)


def _quiet(args: argparse.Namespace) -> list[str]:
    return ["--no-progress"] if args.no_progress else []


def _planted_dataset(args: argparse.Namespace, tmp: Path) -> tuple[str, float] | None:
    """Write the planted click logs as Criteo day files and run ps-prepare on them; return the prepared dataset
    and the ceiling AUC, or None when ps-prepare failed."""
    began = time.perf_counter()
    logs = make_click_logs(args.train_samples, args.test_samples, seed=args.seed)
    files = write_criteo(logs, tmp / "logs")
    ceiling = ceiling_auc(logs)
    print(
        f"click logs: {len(logs.train) + len(logs.test):,} impressions as Criteo day files in "
        f"{time.perf_counter() - began:.1f} s; ceiling AUC (the planted model's own) {ceiling:.4f}",
        flush=True,
    )
    del logs
    dataset = str(tmp / "criteo")
    prepare = [*map(str, files), "--format", "criteo", "--out", dataset, "--shards", str(2 * WORKERS), *_quiet(args)]
    print(f"$ ps-prepare {' '.join(prepare)}", flush=True)
    began = time.perf_counter()
    if subprocess.run([sys.executable, "-m", "worker.data.prepare", *prepare]).returncode != 0:
        return None
    print(f"prepared in {time.perf_counter() - began:.1f} s", flush=True)
    return dataset, ceiling


@dataclasses.dataclass(frozen=True)
class _Job:
    """What the distributed run left: each worker's metrics, its seconds, ps-server's status, the serving check."""

    metrics: list[dict[str, Any]]
    seconds: float
    status: int
    served_ok: bool


def _train_distributed(args: argparse.Namespace, dataset: str, tables: TableOptions, tmp: Path) -> _Job | None:
    """ps-server, a ps-serve following it and WORKERS ps-workers on `dataset`; every process stopped on return."""
    server_args = ["--shards", "2", "--workers", str(WORKERS), "--mode", "sync", "--optimizer", "adagrad"]
    server = start_server([*server_args, "--lr", str(args.lr), "--port", str(args.port)])
    workers: list[subprocess.Popen[bytes]] = []
    serving: PsServe | None = None
    saved = str(tmp / "dlrm.safetensors")
    try:
        address = address_of(server)
        serving = PsServe(address)  # it follows the job from its first version
        worker_args = ["--dataset", dataset, "--model", "dlrm", "--epochs", str(args.epochs)]
        worker_args += ["--batch-size", str(args.batch_size), "--embedding-dim", str(args.dim)]
        worker_args += ["--table-size", str(args.table_size), "--seed", str(args.seed), "--threads", str(args.threads)]
        worker_args += ["--save-model", saved, *_quiet(args)]
        print(f"$ ps-worker --server {address} {' '.join(worker_args)} (x{WORKERS})", flush=True)
        began = time.perf_counter()
        workers = start_workers(address, worker_args, WORKERS, tmp)
        if any(w.wait() != 0 for w in workers):
            print("recsys: a worker failed (see above)", file=sys.stderr)
            return None
        seconds = time.perf_counter() - began
        metrics = worker_metrics(tmp, WORKERS)
        served_ok = check_served(serving.wait_ready(), address, dataset, saved, tables, args.seed)
    finally:
        for w in workers:
            stop(w, signal.SIGINT)
        if serving is not None:
            serving.stop()
        status = stop(server, signal.SIGTERM)
    return _Job(metrics, seconds, status, served_ok)


def _report(job: _Job, local_auc: float, ceiling: float) -> int:
    got = job.metrics[0]["test_auc"]
    gap, fraction = abs(got - local_auc), (got - 0.5) / (ceiling - 0.5)
    ok = gap <= TARGET_GAP and fraction >= TARGET_FRACTION and job.status == 0 and job.served_ok
    samples = sum(m["samples"] for m in job.metrics)
    print(
        f"distributed (2 shards, {WORKERS} workers, sync): AUC {got:.4f} in {job.seconds:.1f} s "
        f"({samples / max(job.seconds, 1e-9):,.0f} samples/s with start-up)\n"
        f"ceiling AUC {ceiling:.4f}, local AUC {local_auc:.4f}, distributed AUC {got:.4f}, |difference| "
        f"{gap:.4f} (target <= {TARGET_GAP}), {fraction:.3f} of the way from 0.5 to the ceiling (target >= "
        f"{TARGET_FRACTION}): {'reached' if ok else 'MISSED'}; servers stopped with status {job.status}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
