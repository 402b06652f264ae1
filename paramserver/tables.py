"""Sparse embedding tables, as both sides see them: a table's spec, where its rows live, and how a new row starts.

Pure numpy, no torch, no Python loop per ID: a worker and a shard compute the same answers, and
protos/paramserver/v1/SPEC.md (section 14) defines them for other languages.

- `TableSpec`: a named table of `dim`-wide float32 rows keyed by int64 IDs, bounded (`num_embeddings`: IDs
  0..N-1) or not (0: any int64, a row made on first use), with its initialisation, optimizer, admission and
  eviction. Part of the model: the digest covers every field.
- `shard_of(ids, num_shards)`: the shard that holds each ID's row: `mix64(id) mod num_shards`, where mix64 is
  SplitMix64's finaliser of the ID's 64 bits (two's complement), a bijection that spreads consecutive and
  Zipf-heavy IDs evenly.
- `initial_rows(spec, ids)`: the value a row has before any update (and again after it was evicted): zeros, or a
  deterministic function of the table's seed and the ID (see `Initialiser`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields

import numpy as np

from paramserver.v1 import ps_pb2

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11, _S32 = (np.uint64(s) for s in (30, 27, 31, 11, 32))

# The row optimizers a table may name; "" takes the job's (DEFAULT_ROW_OPTIMIZER). The shard's registry
# (paramserver.shard.sparse.row_optimizers) implements exactly these.
ROW_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
# A table that names no optimizer uses the one that acts on rows as the job's optimizer acts on dense tensors.
DEFAULT_ROW_OPTIMIZER = {"sgd": "sgd", "momentum": "sgd", "adam": "adam", "adamw": "adam", "adagrad": "adagrad"}
INITS = ("normal", "uniform", "zeros")
MAX_DIM = 65536
CODEBOOK_ROWS = 4096  # rows per initialisation codebook (see Initialiser)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of uint64 values: (x + 0x9E3779B97F4A7C15), then two xor-shift-multiplies
    and a final xor-shift, all modulo 2^64."""
    z = np.asarray(x, dtype=np.uint64) + _GAMMA
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def as_ids(ids: np.ndarray) -> np.ndarray:
    """IDs as a flat int64 array (ValueError for anything that is not integers)."""
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"embedding IDs are integers, not {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard holding each ID's row (int64 array): mix64(ID as uint64) mod num_shards."""
    u = as_ids(ids).view(np.uint64)
    return (mix64(u) % np.uint64(num_shards)).astype(np.int64)


@dataclass(frozen=True)
class TableSpec:
    """One sparse embedding table of a model (see worker.SparseEmbedding for what each field means to a user).

    Zero and empty values mean the default: `init_scale` 0 is 1/sqrt(dim); `optimizer` "" the job's
    (DEFAULT_ROW_OPTIMIZER), `lr` 0 the job's; `admit_after` 0 or 1 and `admit_probability` 1 admit every ID at
    its first update; `evict_after_versions`, `evict_after_seconds` and `capacity` 0 never evict.
    """

    name: str
    dim: int
    num_embeddings: int = 0  # 0: unbounded int64 IDs; else IDs 0..num_embeddings-1
    init: str = "normal"  # normal | uniform | zeros
    init_scale: float = 0.0  # the normal's standard deviation, or the uniform's bound
    seed: int = 0
    optimizer: str = ""  # sgd | adagrad | rowwise_adagrad | adam (lazy, as torch.optim.SparseAdam)
    lr: float = 0.0
    admit_after: int = 0  # a row is made once its ID was in this many updates
    admit_probability: float = 1.0  # ... or, in each update it is in, with this probability
    evict_after_versions: int = 0  # rows no update touched for this many versions are dropped
    evict_after_seconds: float = 0.0  # rows no update touched for this long are dropped
    capacity: int = 0  # rows per shard; beyond, the least recently updated are dropped

    def __post_init__(self) -> None:
        for f in fields(self):  # one type per field, whatever the caller passed: the digest spells each one way
            if f.type in ("int", "float"):
                object.__setattr__(
                    self, f.name, int(getattr(self, f.name)) if f.type == "int" else float(getattr(self, f.name))
                )
        problems = []
        if not self.name:
            problems.append("a table needs a name")
        if not 1 <= self.dim <= MAX_DIM:
            problems.append(f"dim must be in 1..{MAX_DIM}, not {self.dim}")
        if self.num_embeddings < 0 or self.num_embeddings >= 1 << 63:
            problems.append(f"num_embeddings must be 0 (unbounded) or a positive int64, not {self.num_embeddings}")
        if self.init not in INITS:
            problems.append(f"init must be one of {', '.join(INITS)}, not {self.init!r}")
        if not (math.isfinite(self.init_scale) and self.init_scale >= 0):
            problems.append(f"init_scale must be finite and >= 0, not {self.init_scale}")
        if not 0 <= self.seed < 1 << 64:
            problems.append(f"seed must be in 0..2^64-1, not {self.seed}")
        if self.optimizer and self.optimizer not in ROW_OPTIMIZERS:
            problems.append(
                f"optimizer must be one of {', '.join(ROW_OPTIMIZERS)} or '' (the job's), not {self.optimizer!r}"
            )
        if not (math.isfinite(self.lr) and self.lr >= 0):
            problems.append(f"lr must be finite and >= 0 (0: the job's), not {self.lr}")
        if not 0 <= self.admit_after < 1 << 63:
            problems.append(f"admit_after must be in 0..2^63-1, not {self.admit_after}")
        if not 0 < self.admit_probability <= 1:
            problems.append(f"admit_probability must be in (0, 1], not {self.admit_probability}")
        for name in ("evict_after_versions", "evict_after_seconds", "capacity"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{name} must be >= 0 (0: never), not {value}")
            elif name != "evict_after_seconds" and value >= 1 << 63:  # held as int64 on the shard
                problems.append(f"{name} must be at most 2^63-1 (0: never), not {value}")
        if problems:
            raise ValueError(f"table {self.name!r}: " + "; ".join(problems))

    @property
    def scale(self) -> float:
        """The initialisation's scale: init_scale, or 1/sqrt(dim) when that is 0."""
        return self.init_scale or 1.0 / math.sqrt(self.dim)

    @property
    def bounded(self) -> bool:
        return self.num_embeddings > 0

    def digest_entry(self) -> list[str]:
        """The table as the model digest sees it (SPEC.md section 2): every field in declaration order (the
        .proto's), as strings any language writes alike: text as it is, integers in decimal, floats as "0x" and
        the 16 lowercase hex digits of their IEEE 754 binary64 bits."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                out.append("0x" + struct.pack(">d", value).hex())
            else:
                out.append(str(value))
        return out

    def row_optimizer(self, job_optimizer: str) -> str:
        """The optimizer this table's rows get in a job whose dense optimizer is `job_optimizer`."""
        return self.optimizer or DEFAULT_ROW_OPTIMIZER[job_optimizer]

    def check_ids(self, ids: np.ndarray) -> str:
        """Why these IDs cannot be this table's ("" when they can): outside a bounded table's range."""
        if self.bounded and len(ids):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                return f"ID {bad} is outside table {self.name!r} (IDs 0..{self.num_embeddings - 1})"
        return ""


def _uniform01(counters: np.ndarray, key: np.uint64) -> np.ndarray:
    """Uniform float64 in [0, 1): the top 53 bits of mix64(key + counter)."""
    return (mix64(counters + key) >> _S11).astype(np.float64) * 2.0**-53


class Initialiser:
    """The initial rows of one table, from its seed and each ID, without a Python loop per ID.

    Two codebooks A and B of CODEBOOK_ROWS rows each are drawn once from the seed: with k = mix64(seed) and
    u(c) = top 53 bits of mix64(k + c) / 2^53, element j of row r of codebook b (0 for A, 1 for B) is, for
    `uniform`, u(c) with c = (b * CODEBOOK_ROWS + r) * dim + j; for `normal`, the Box-Muller value
    sqrt(-2 ln(1 - u(2c))) * cos(2 pi u(2c + 1)). An ID's hash h = mix64(ID xor k) picks row h mod CODEBOOK_ROWS
    of A and row (h >> 32) mod CODEBOOK_ROWS of B; the row is scale * (a + b) / sqrt(2) for `normal` (so N(0,
    scale^2) again), scale * (2 * frac(a + b) - 1) for `uniform` (uniform again on [-scale, scale)), zeros for
    `zeros`. Computed in float64, stored as float32.
    """

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.key = mix64(np.array([spec.seed], dtype=np.uint64))[0]
        self._books: np.ndarray | None = None

    def _codebooks(self) -> np.ndarray:
        if self._books is None:
            dim = self.spec.dim
            count = 2 * CODEBOOK_ROWS * dim
            c = np.arange(count, dtype=np.uint64)
            if self.spec.init == "normal":
                u1 = _uniform01(c * np.uint64(2), self.key)
                u2 = _uniform01(c * np.uint64(2) + np.uint64(1), self.key)
                books = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)
            else:
                books = _uniform01(c, self.key)
            self._books = books.reshape(2, CODEBOOK_ROWS, dim)
        return self._books

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The initial rows of these IDs, float32 [len(ids), dim]."""
        ids = as_ids(ids)
        spec = self.spec
        if spec.init == "zeros":
            return np.zeros((len(ids), spec.dim), dtype=np.float32)
        h = mix64(ids.view(np.uint64) ^ self.key)
        rows = np.uint64(CODEBOOK_ROWS)
        books = self._codebooks()
        a = books[0][(h % rows).astype(np.intp)]
        b = books[1][((h >> _S32) % rows).astype(np.intp)]
        if spec.init == "normal":
            out = (a + b) * (spec.scale / math.sqrt(2.0))
        else:
            s = a + b
            out = (2.0 * (s - np.floor(s)) - 1.0) * spec.scale
        return out.astype(np.float32)


def initial_rows(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """The value each ID's row has before any update, float32 [len(ids), dim] (see Initialiser)."""
    return Initialiser(spec).rows(ids)


def spec_to_proto(spec: TableSpec) -> ps_pb2.TableSpec:
    """A table spec as ps.proto's TableSpec."""
    return ps_pb2.TableSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)})


def spec_from_proto(msg: ps_pb2.TableSpec) -> TableSpec:
    """A ps.proto TableSpec as a table spec (ValueError for values outside their ranges); an admit_probability of
    0 (proto3's unset) means 1."""
    values = {f.name: getattr(msg, f.name) for f in fields(TableSpec)}
    values["admit_probability"] = values["admit_probability"] or 1.0
    return TableSpec(**values)
