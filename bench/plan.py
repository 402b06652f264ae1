"""The benchmark suite's plan: what each section measures, at which sizes, how often (`Plan.full`, and
`Plan.quick_plan`, the smoke test's miniature)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MLP_PARAMS = 85_002  # the digits MLP: worker.models.builtin.build_model("mlp", in_shape=(1, 8, 8), num_classes=10)


@dataclass(frozen=True)
class Plan:
    """Sizes, counts and repeats of one run; `Plan.full` is the suite, `Plan.quick` its smoke-test miniature."""

    quick: bool
    repeats: int  # timed iterations of transport and baselines (more for small payloads, see `schedule`)
    train_repeats: int  # whole training runs per training figure
    payloads: dict[str, int]  # label -> float32 parameters of the dense model, split into 4 equal tensors
    transport_shards: tuple[int, ...]
    transport_workers: tuple[int, ...]
    bf16_payload: str  # the payload also measured with the bf16 wire (2 shards, 1 worker)
    small_model: bool  # also the digits MLP (85,002 parameters), 2 shards, 1 worker
    rpc_workers: tuple[int, ...]
    train_models: tuple[str, ...]
    train_setups: tuple[tuple[int, str], ...]  # (workers, mode)
    train_epochs: int
    big_model: str  # a ps-worker --model spec of about 25 M parameters, trained on synthetic data
    big_steps: int
    big_workers: tuple[int, ...]
    tta_model: str
    tta_epochs: tuple[int, ...]  # runs of growing length until one reaches the target accuracy
    tta_target: float
    memory_params: int
    memory_workers: tuple[int, ...]
    memory_rounds: int
    link_rate: str  # the worker's link in the link section, both ways (tc tbf rate)
    link_batch: int
    link_epochs: int
    link_payload: int  # float32 parameters pushed and pulled over the link, in turn and at once
    compress_rates: tuple[str, ...]  # the links the compress section's exchanges run over (tbf rates)
    compress_train_rates: tuple[str, ...]  # ... and its training runs
    compress_epochs: int  # the CNN's epochs there (tested after each: the time to tta_target)
    compress_steps: int  # big_model's steps there
    overlap_backward_rates: tuple[str, ...]  # the links the overlap_backward section trains over (tbf rates)
    overlap_backward_wires: tuple[str, ...]  # ... and its wire dtypes (its steps and epochs: compress's)
    hosts_model: str  # the hosts section's model (ps-worker --model), 2 hosts x ps-worker --nproc 2
    hosts_steps: int
    sparse_dims: tuple[int, ...]  # row widths of the sparse step cases (4,096 Zipf IDs a batch)
    sparse_shards: tuple[int, ...]
    sparse_wires: tuple[str, ...]  # shm, socket, grpc
    sparse_rounds: int  # rounds of (local steps, PS steps) in turn, per case; throughput windows too
    sparse_steps: int  # steps per side per round
    sparse_batches: int  # pre-drawn batches a process cycles through; its warm-up is one pass over them
    sparse_workers: int  # concurrent workers against one shard in the throughput case
    sparse_seconds: float  # length of one throughput window
    sparse_rows: tuple[int, int]  # rows of the small and the large RowTable in the memory case
    many_big: tuple[int, ...]  # sizes of the many-table model's four large fields
    many_batch: int  # samples a worker's step (and the local step)
    many_batches: int  # pre-drawn batches each process cycles through (its warm-up is one pass)
    many_rounds: int
    many_steps: int  # steps per side per round
    many_workers: tuple[int, ...]  # the scaling cases' workers (x many_shards)
    many_shards: tuple[int, ...]
    many_tables: tuple[int, ...]  # the scaling cases' table counts (2 workers x 2 shards)

    @classmethod
    def full(cls, repeats: int = 5, train_repeats: int = 3) -> Plan:
        return cls(
            quick=False,
            repeats=repeats,
            train_repeats=train_repeats,
            payloads={"4MB": 1_000_000, "100MB": 25_000_000},
            transport_shards=(1, 2),
            transport_workers=(1, 2),
            bf16_payload="100MB",
            small_model=True,
            rpc_workers=(1, 2),
            train_models=("mlp", "cnn"),
            train_setups=((1, "sync"), (1, "async"), (2, "sync"), (2, "async")),
            # ps-worker's default: 3 epochs of the digits MLP last 0.13 s, where one worker starting a few ms
            # before the other moves the figure
            train_epochs=10,
            big_model="bench.models:mlp25m",
            big_steps=20,
            big_workers=(1, 2),
            tta_model="cnn",
            tta_epochs=(2, 3, 4, 6, 8, 10, 12),
            tta_target=0.95,
            memory_params=25_000_000,
            memory_workers=(1, 2, 4),
            memory_rounds=3,
            # The CNN's 605 KB each way per step take about as long on it as a batch of 128 takes to compute.
            link_rate="400mbit",
            link_batch=128,
            link_epochs=5,
            link_payload=6_250_000,  # 25 MB: half a second each way
            compress_rates=("100mbit", "400mbit", "1gbit"),
            compress_train_rates=("100mbit", "1gbit"),
            compress_epochs=20,  # the compressed runs' pushes arrive late: ~0.97 after 20 epochs, 0.91-0.95 after 10
            compress_steps=6,
            overlap_backward_rates=("400mbit", "1gbit"),
            overlap_backward_wires=("bf16", "float32"),
            hosts_model="bench.models:mlp1m",  # 4.4 MB each way a push: the link, not the 2 cores, sets the pace
            hosts_steps=40,
            sparse_dims=(16, 64, 128),
            sparse_shards=(1, 2),
            sparse_wires=("shm", "socket", "grpc"),
            sparse_rounds=2 * repeats,
            sparse_steps=20,
            sparse_batches=32,
            sparse_workers=4,
            sparse_seconds=2.0,
            sparse_rows=(100_000, 10_000_000),
            many_big=(10_000_000, 4_000_000, 2_000_000, 1_000_000),
            many_batch=2048,
            many_batches=8,
            many_rounds=2 * repeats,
            many_steps=8,
            many_workers=(1, 2, 4),
            many_shards=(1, 2),
            many_tables=(1, 26, 52, 100),
        )

    @classmethod
    def quick_plan(cls, repeats: int = 2, train_repeats: int = 1) -> Plan:
        return cls(
            quick=True,
            repeats=repeats,
            train_repeats=train_repeats,
            payloads={"1MB": 250_000},
            transport_shards=(2,),
            transport_workers=(1, 2),
            bf16_payload="1MB",
            small_model=False,
            rpc_workers=(1,),
            train_models=("mlp",),
            train_setups=((2, "sync"),),
            train_epochs=1,
            big_model="bench.models:mlp1m",
            big_steps=3,
            big_workers=(1,),
            tta_model="mlp",
            tta_epochs=(1,),
            tta_target=0.95,
            memory_params=1_000_000,
            memory_workers=(1,),
            memory_rounds=2,
            link_rate="400mbit",
            link_batch=128,
            link_epochs=1,
            link_payload=1_000_000,  # 2 MB a shard: over the 1 MiB that goes from the caller's thread
            compress_rates=("400mbit",),
            compress_train_rates=("400mbit",),
            compress_epochs=1,
            compress_steps=2,
            overlap_backward_rates=("400mbit",),
            overlap_backward_wires=("bf16",),  # mlp1m's fc2 is a shard's part, 2 MiB in bf16: the flag applies
            hosts_model="mlp",
            hosts_steps=3,
            sparse_dims=(64,),
            sparse_shards=(1, 2),
            sparse_wires=("shm", "socket", "grpc"),
            sparse_rounds=repeats,
            sparse_steps=5,
            sparse_batches=8,
            sparse_workers=4,
            sparse_seconds=0.5,
            sparse_rows=(10_000, 1_000_000),
            many_big=(100_000, 50_000, 20_000, 10_000),
            many_batch=256,
            many_batches=2,
            many_rounds=repeats,
            many_steps=2,
            many_workers=(2,),
            many_shards=(2,),
            many_tables=(1, 52),
        )

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}
