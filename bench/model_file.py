"""Save and load a model with one large table: PSClient.save (streamed from the shards) and worker.load (served
from the file, memory-mapped), against safetensors.torch.save_file / load_file of the same table held whole.

    .venv/bin/python bench/model_file.py                    # 10 M rows of dim 16 on 2 shard processes
    .venv/bin/python bench/model_file.py --rows 1000000 --dim 64

A model of one nn.Embedding(rows, dim) and a Linear is converted with make_sparse and registered (its rows go to
the shards in the Init streams), then saved. Figures, each for this process (the worker) only: seconds, the file's
size, and the peak of resident memory above what it held before the step (VmHWM, reset through
/proc/self/clear_refs just before), as a multiple of the table's size. Load: seconds to load, then a million
lookups of random IDs (the first touch of the file's pages: a warm page cache, as the file was just written).
The baseline is what a user would write without the streaming writer: the table's rows gathered whole from the
shards (client.lookup of every ID), save_file, then load_file and the same lookups by indexing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on sys.path, the repository root is not
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402

from paramserver.config import ServerConfig  # noqa: E402
from paramserver.server.cluster import LocalCluster  # noqa: E402
from worker import PSClient, PSOptimizer, load, make_sparse  # noqa: E402


def _status(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match, field
    return int(match.group(1)) * 1024


class _Peak:
    """The peak of resident memory above the start, over a `with` block."""

    def __enter__(self) -> _Peak:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
        self.base = _status("VmRSS")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.bytes = _status("VmHWM") - self.base


class Model(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, dim)
        self.fc = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.table(ids)).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--lookups", type=int, default=1_000_000)
    args = parser.parse_args()
    table_bytes = args.rows * args.dim * 4
    out: dict[str, Any] = {"rows": args.rows, "dim": args.dim, "shards": args.shards, "table_bytes": table_bytes}
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, args.rows, args.lookups))
    config = ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.05, max_table_bytes=8 * table_bytes)
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(config, args.shards, processes=True) as cluster:
        path, base = Path(tmp) / "model.safetensors", Path(tmp) / "whole.safetensors"
        model = make_sparse(Model(args.rows, args.dim))
        with PSClient(cluster.address, timeout=600) as client:
            with _Peak() as p:
                PSOptimizer(model, client)
            out["register_s"] = round(p.seconds, 2)
            with _Peak() as p:
                client.save(model, path)
            out.update(save_s=round(p.seconds, 2), save_peak_x=round(p.bytes / table_bytes, 3))
            out["file_bytes"] = path.stat().st_size
            with torch.no_grad():
                served = model(ids[:4096])
            with _Peak() as p:  # the baseline: the table gathered whole from the shards, then save_file
                whole = client.lookup(model, 0, np.arange(args.rows))
                save_file({"table.ids": torch.arange(args.rows), "table.values": torch.from_numpy(whole)}, str(base))
            out.update(baseline_save_s=round(p.seconds, 2), baseline_save_peak_x=round(p.bytes / table_bytes, 3))
            del whole
        fresh = make_sparse(Model(args.rows, args.dim))
        with _Peak() as p:
            load(fresh, path)
        out.update(load_s=round(p.seconds, 3), load_peak_x=round(p.bytes / table_bytes, 3))
        with torch.no_grad(), _Peak() as p:
            assert torch.equal(fresh(ids[:4096]), served)
            fresh(ids)
        out.update(lookup_s=round(p.seconds, 3), lookup_peak_x=round(p.bytes / table_bytes, 3))
        del fresh, model
        with _Peak() as p:  # safetensors maps the file lazily: the pages are read as the tensor is first used
            values = load_file(str(base))["table.values"]
            values[ids].sum()
        out.update(baseline_lookup_s=round(p.seconds, 3), baseline_lookup_peak_x=round(p.bytes / table_bytes, 3))
        del values
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
