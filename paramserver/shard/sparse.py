"""A shard's sparse tables: its rows of every table of the model, the checks on rows that arrive, and the memory cap.

Rows arrive as `RowBlock`s: one table's IDs and, in a push, their summed gradients. They are received into arrays
planned from the request (`plan`), then checked whole (`ShardTables.check`) before anything applies, so a refused
push or lookup leaves every table exactly as it was. Each table's rows, optimizer state, admission counts and
eviction live in paramserver.shard.row_store.RowTable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from paramserver.config import ServerConfig
from paramserver.errors import InvalidArgument, MalformedStream, TooLarge
from paramserver.shard.row_store import RowTable
from paramserver.tables import TableSpec, shard_of
from paramserver.v1 import ps_pb2

log = logging.getLogger(__name__)

# The most bytes of rows and IDs one request may carry (RESOURCE_EXHAUSTED beyond), checked before a shard
# allocates the arrays to receive them: a frame's payload is not in memory when the message announcing it is read.
MAX_ROWS_BYTES = 64 << 20


@dataclass
class RowBlock:
    """One table's rows in one request: IDs (int64), and values (float32 [count, dim]) unless it is a lookup."""

    table: int
    ids: np.ndarray
    values: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes) + (int(self.values.nbytes) if self.values is not None else 0)

    def arrays(self) -> list[np.ndarray]:
        """The arrays in payload order: the IDs, then the values."""
        return [self.ids] if self.values is None else [self.ids, self.values]


@dataclass
class SparseIn:
    """The sparse part of one exchange: the rows it pushes and the IDs it looks up, as planned arrays."""

    rows: list[RowBlock]
    lookups: list[RowBlock]
    answers: list[np.ndarray] = field(default_factory=list)  # the looked-up rows, once read (float32 [n, dim])

    def __bool__(self) -> bool:
        return bool(self.rows or self.lookups)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows and IDs (their part of a frame's payload)."""
        return sum(b.nbytes for b in self.rows) + sum(b.nbytes for b in self.lookups)

    def targets(self) -> list[np.ndarray]:
        """The arrays a frame's payload fills after its dense part, in order."""
        return [a for b in self.rows for a in b.arrays()] + [b.ids for b in self.lookups]

    def fill_inline(self, request_rows: Sequence[ps_pb2.Rows], request_lookups: Sequence[ps_pb2.Rows]) -> None:
        """Fill the arrays from the bytes in the messages (gRPC); MalformedStream for bytes of another size."""
        for block, entry in zip(self.rows, request_rows, strict=True):
            _take(block.ids, entry.ids, "ids", block.table)
            assert block.values is not None
            _take(block.values, entry.values, "values", block.table)
        for block, entry in zip(self.lookups, request_lookups, strict=True):
            _take(block.ids, entry.ids, "ids", block.table)
            if entry.values:
                raise MalformedStream(f"a lookup of table {block.table} carries values")

    def answer_inline(self, reply: ps_pb2.ExchangeResponse) -> None:
        """Put the looked-up rows' bytes into the reply's `rows` (gRPC)."""
        for entry, values in zip(reply.rows, self.answers, strict=True):
            entry.values = values.tobytes()


def _take(target: np.ndarray, data: bytes, what: str, table: int) -> None:
    if len(data) != target.nbytes:
        raise MalformedStream(
            f"rows of table {table}: {len(data)} bytes of {what} where their count and the table's dim make "
            f"{target.nbytes}"
        )
    target.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)


# Bytes a held row costs beyond its value and optimizer state: its share of the hash index (two cells of an ID and
# a slot at a load factor of at most 1/2), its ID, last update version and time. The memory cap counts rows at
# row_bytes + this; the slabs they live in are allocated in steps of 1.25x, so allocated memory
# (paramserver_table_allocated_bytes) may run up to that much above what the cap counts.
ROW_OVERHEAD_BYTES = 64


@dataclass(frozen=True)
class TableFigures:
    """One table's figures on one shard, for the metrics."""

    rows: int
    nbytes: int  # what the memory cap counts: rows x (row_bytes + ROW_OVERHEAD_BYTES)
    allocated_bytes: int
    rows_admitted: int
    rows_evicted: int
    ids_seen: int


def held_bytes(table: RowTable) -> int:
    """The bytes the memory cap counts for a table's rows."""
    return table.rows * (table.row_bytes + ROW_OVERHEAD_BYTES)


class ShardTables:
    """This shard's rows of every table of one model."""

    def __init__(self, specs: Sequence[TableSpec], index: int, num_shards: int, config: ServerConfig) -> None:
        self.specs = tuple(specs)
        self.index = index
        self.num_shards = num_shards
        self.config = config
        self.tables = [RowTable(s, s.row_optimizer(config.optimizer), s.lr or config.lr) for s in self.specs]
        self._warned_full = False

    def __len__(self) -> int:
        return len(self.tables)

    def __bool__(self) -> bool:
        return bool(self.tables)

    # -- requests ------------------------------------------------------------------------------------------------

    def plan(self, request_rows: Sequence[ps_pb2.Rows], request_lookups: Sequence[ps_pb2.Rows]) -> SparseIn:
        """Arrays to receive a request's rows and lookups into; InvalidArgument for an unknown table or a count
        past MAX_ROWS_BYTES (TooLarge), before anything is allocated."""
        total = 0
        for entry, values in [*((e, True) for e in request_rows), *((e, False) for e in request_lookups)]:
            if entry.table >= len(self.tables):
                raise InvalidArgument(
                    f"rows for table {entry.table}, but the model has {len(self.tables)} table(s)"
                    + (f" ({', '.join(s.name for s in self.specs)})" if self.specs else "")
                )
            total += entry.count * (8 + (4 * self.specs[entry.table].dim if values else 0))
        if total > MAX_ROWS_BYTES:
            raise TooLarge(
                f"{total} bytes of rows and IDs in one request, over the limit of {MAX_ROWS_BYTES}: send smaller "
                "batches"
            )
        rows = [
            RowBlock(
                e.table,
                np.empty(e.count, dtype=np.int64),
                np.empty((e.count, self.specs[e.table].dim), dtype=np.float32),
            )
            for e in request_rows
        ]
        lookups = [RowBlock(e.table, np.empty(e.count, dtype=np.int64)) for e in request_lookups]
        return SparseIn(rows, lookups)

    def check(self, blocks: Sequence[RowBlock]) -> None:
        """Refuse (InvalidArgument) IDs this shard cannot take: outside a bounded table, held by another shard,
        twice in one request; and values that are NaN or infinite. Nothing is changed either way."""
        seen: set[int] = set()
        for block in blocks:
            spec = self.specs[block.table]
            name = f"table {spec.name!r}"
            if block.values is not None:
                if block.table in seen:
                    raise InvalidArgument(f"{name} appears twice in one push: send each table's rows once")
                seen.add(block.table)
            ids = block.ids
            problem = spec.check_ids(ids)
            if problem:
                raise InvalidArgument(problem)
            # Clients send each shard's IDs sorted (torch.unique's order): then one comparison proves them distinct.
            if len(ids) > 1 and not (ids[1:] > ids[:-1]).all() and len(np.unique(ids)) != len(ids):
                raise InvalidArgument(f"{name}: an ID appears more than once in one request: sum its rows first")
            if len(ids) and self.num_shards > 1:
                owner = shard_of(ids, self.num_shards)
                wrong = np.flatnonzero(owner != self.index)
                if len(wrong):
                    bad = int(ids[wrong[0]])
                    raise InvalidArgument(
                        f"{name}: ID {bad} belongs to shard {int(owner[wrong[0]])}, not {self.index} (mix64(id) mod "
                        f"{self.num_shards}, see ps.proto TableSpec)"
                    )
            if block.values is not None and not np.isfinite(block.values).all():
                raise InvalidArgument(f"{name}: NaN or Inf in the rows' gradients")

    def check_room(self, blocks: Sequence[RowBlock]) -> None:
        """Refuse (TooLarge: RESOURCE_EXHAUSTED) a push whose new rows would take the tables past the shard's
        --max-table-bytes, where --table-overflow is `refuse`; with `evict`, room is made when it applies."""
        if self.config.table_overflow != "refuse" or not blocks:
            return
        limit = self.table_bytes_limit()
        grow = sum(
            self.tables[b.table].missing(b.ids) * (self.tables[b.table].row_bytes + ROW_OVERHEAD_BYTES) for b in blocks
        )
        if grow and self.nbytes + grow > limit:
            raise TooLarge(
                f"this push would make rows of {grow} bytes, and the tables of shard {self.index} hold {self.nbytes} "
                f"of their limit of {limit} (--max-table-bytes); raise it, add shards, or let rows be evicted "
                "(--table-overflow evict, or a table's capacity / evict_after_*)"
            )

    # -- reads and updates ---------------------------------------------------------------------------------------

    def lookup(self, blocks: Sequence[RowBlock]) -> list[np.ndarray]:
        """The current rows of each block's IDs (initial values where none is held)."""
        return [self.tables[b.table].lookup(b.ids) for b in blocks]

    def apply(self, blocks: Sequence[RowBlock], version: int, wall: float | None = None) -> None:
        """Apply one update's row gradients (each block's IDs unique), then evict what the tables' policies and
        the memory cap say. `wall`: when the update first applied (time.time(); a replay's), else now."""
        now = time.monotonic() if wall is None else wall - (time.time() - time.monotonic())
        for b in blocks:
            assert b.values is not None
            self.tables[b.table].apply(b.ids, b.values, version, now)
        touched = {b.table for b in blocks}
        for k, table in enumerate(self.tables):
            if k not in touched:
                # A table's step counts the job's updates, as torch.optim.SparseAdam counts its steps (its bias
                # correction), not only those that brought this shard some of its rows.
                table.steps += 1
        for table in self.tables:
            table.expire(version, now)
        self._keep_within_limit()

    def _keep_within_limit(self) -> None:
        limit = self.table_bytes_limit()
        if self.config.table_overflow != "evict" or self.nbytes <= limit:
            return  # refuse: each push was checked; a sync round of several may end up to one round above
        # Drop the least recently updated rows of every table in proportion to what it holds.
        over = self.nbytes - limit
        held = self.nbytes
        for table in self.tables:
            share = over * held_bytes(table) / held
            cost = table.row_bytes + ROW_OVERHEAD_BYTES
            drop = min(table.rows, -(-int(share) // cost))
            if drop:
                table.evict_lru(table.rows - drop)
        if not self._warned_full:
            self._warned_full = True
            log.warning(
                "shard %d: sparse tables reached --max-table-bytes %d: evicting the least recently updated rows",
                self.index,
                limit,
            )

    def table_bytes_limit(self) -> int:
        """The shard's cap on table memory (bytes)."""
        return self.config.max_table_bytes

    @property
    def nbytes(self) -> int:
        """What the memory cap counts of every table's rows (see ROW_OVERHEAD_BYTES)."""
        return sum(held_bytes(t) for t in self.tables)

    # -- sync rounds ---------------------------------------------------------------------------------------------

    @staticmethod
    def combine(blocks: Sequence[RowBlock], divide_by: int) -> list[RowBlock]:
        """One block per table from a round's blocks (several workers'): the gradients of an ID summed, then all
        divided by the round's number of gradients, as the dense sum is."""
        by_table: dict[int, list[RowBlock]] = {}
        for b in blocks:
            by_table.setdefault(b.table, []).append(b)
        out = []
        for table, group in sorted(by_table.items()):
            if len(group) == 1:
                ids, values = group[0].ids, group[0].values
                assert values is not None
                if divide_by > 1:
                    values = values / np.float32(divide_by)
                out.append(RowBlock(table, ids, values))
                continue
            all_ids = np.concatenate([g.ids for g in group])
            unique, inverse = np.unique(all_ids, return_inverse=True)
            summed = torch.zeros((len(unique), group[0].values.shape[1]), dtype=torch.float32)  # type: ignore[union-attr]
            summed.index_add_(
                0,
                torch.from_numpy(inverse.astype(np.int64)),
                torch.from_numpy(np.concatenate([g.values for g in group])),  # type: ignore[misc]
            )
            if divide_by > 1:
                summed.div_(divide_by)
            out.append(RowBlock(table, unique, summed.numpy()))
        return out

    # -- state ---------------------------------------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, np.ndarray]]:
        """Every table's rows, optimizer state and admission counts, as copies (for a checkpoint). Last-update
        times are kept as wall-clock seconds, so that age-based eviction goes on right in another process."""
        shift = time.time() - time.monotonic()
        out = []
        for table in self.tables:
            state = {k: np.array(v, copy=True) for k, v in table.state().items()}
            state["times"] = state["times"] + shift
            out.append(state)
        return out

    def restore(self, states: Sequence[dict[str, np.ndarray]]) -> None:
        """Take the tables' rows from a checkpoint's `snapshot` (ValueError when they do not fit the tables)."""
        if len(states) != len(self.tables):
            raise ValueError(f"the checkpoint holds {len(states)} tables, the model {len(self.tables)}")
        shift = time.time() - time.monotonic()
        restored = []
        for spec, table, state in zip(self.specs, self.tables, states, strict=True):
            state = dict(state)
            state["times"] = np.asarray(state["times"], dtype=np.float64) - shift
            restored.append(RowTable.from_state(spec, table.optimizer.name, table.lr, state))
        self.tables = restored

    def state_bytes(self) -> bytes:
        return b"|".join(t.state_bytes() for t in self.tables)

    def figures(self) -> list[tuple[str, TableFigures]]:
        """Each table's figures, by name (for the metrics)."""
        return [
            (spec.name, TableFigures(t.rows, held_bytes(t), t.nbytes, t.rows_admitted, t.rows_evicted, t.ids_seen))
            for spec, t in zip(self.specs, self.tables, strict=True)
        ]
