"""A shard's sparse tables: its rows of every table of the model, the checks on rows that arrive, and the memory cap.

Rows arrive as `RowBlock`s (paramserver.shard.sparse.row_blocks): one table's IDs and, in a push, their summed
gradients. They are received into arrays planned from the request (`plan`), then checked whole (`ShardTables.check`)
before anything applies, so a refused push or lookup leaves every table exactly as it was. Tables of one width, row
optimizer and learning rate share one store (paramserver.shard.sparse.row_store.RowGroup: rows, optimizer state,
admission counts, eviction), and a request's blocks of one group are planned as slices of one buffer, so the group
checks, applies and looks them up as one batch: a model of 52 tables costs a shard a few calls per group, not per table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from paramserver.config import ServerConfig
from paramserver.errors import InvalidArgument, TooLarge
from paramserver.shard.sparse.row_blocks import RowBlock, joined, planned
from paramserver.shard.sparse.row_optimizers import row_optimizer
from paramserver.shard.sparse.row_store import RowGroup
from paramserver.shard.sparse.sparse_in import SparseIn
from paramserver.shard.sparse.table_state import clock_shift
from paramserver.tables import TableSpec, shard_of
from paramserver.v1 import ps_pb2

log = logging.getLogger(__name__)


# The most bytes of rows and IDs one request may carry (RESOURCE_EXHAUSTED beyond), checked before a shard
# allocates the arrays to receive them: a frame's payload is not in memory when the message announcing it is read.
MAX_ROWS_BYTES = 64 << 20
# The most bytes of looked-up rows one reply may carry (RESOURCE_EXHAUSTED beyond, before anything is read or
# applied): a request of 64 MiB of IDs would otherwise ask for 32x that in reply at dim 64. Over gRPC the reply must
# also fit one message (max_message_bytes).
MAX_LOOKUP_BYTES = 256 << 20


# Bytes a held row costs beyond its value and optimizer state: its share of the hash index (two cells of an ID and
# a slot at a load factor of at most 1/2), its ID, last update version and time. The memory cap counts rows at
# row_bytes + this; the slabs they live in are allocated in steps of 1.25x, so allocated memory
# (paramserver_table_allocated_bytes) may run up to that much above what the cap counts.
ROW_OVERHEAD_BYTES = 64


# A group of bounded tables indexes its rows directly, one int32 per possible ID (paramserver.shard.sparse.id_hash.
# DirectIndex: a lookup is one `take`, not a hash probe), where that index costs at most DIRECT_INDEX_BYTES or a
# quarter of what the group's rows would take if this shard held every row it may hold, and never more than
# `budget`: what is left of a quarter of --max-table-bytes after the groups before it (DIRECT_INDEX_SHARE). The
# index is allocated whole when the model is declared, so a bound is checked from the header alone, before any
# allocation: a table declared with 2^62 IDs gets the hash index, which grows with the rows held.
DIRECT_INDEX_BYTES = 16 << 20
DIRECT_INDEX_SHARE = 4  # direct indexes take at most 1/DIRECT_INDEX_SHARE of --max-table-bytes, all groups together


def direct_index_bytes(specs: Sequence[TableSpec]) -> int:
    """What a direct index over these bounded tables costs (an int32 per possible ID)."""
    return 4 * sum(s.num_embeddings for s in specs)


def direct_index(specs: Sequence[TableSpec], optimizer: str, num_shards: int, budget: int | None = None) -> bool:
    """Whether a group of these tables (one dim, this row optimizer) on one of `num_shards` shards indexes its rows
    directly, its index costing at most `budget` bytes (None: no budget)."""
    if not all(s.bounded for s in specs):
        return False
    ids = sum(s.num_embeddings for s in specs)
    cost = direct_index_bytes(specs)
    if budget is not None and cost > budget:
        return False
    row_bytes = 4 * (specs[0].dim + row_optimizer(optimizer).state_cols(specs[0].dim))
    return cost <= max(DIRECT_INDEX_BYTES, ids * row_bytes / (4 * num_shards))


@dataclass(frozen=True)
class TableFigures:
    """One table's figures on one shard, for the metrics."""

    rows: int
    nbytes: int  # what the memory cap counts: rows x (row_bytes + ROW_OVERHEAD_BYTES)
    allocated_bytes: int  # the table's share of its group's allocation, by rows held
    rows_admitted: int
    rows_evicted: int
    ids_seen: int


@dataclass(frozen=True)
class TableView:
    """One table of a shard, as a part of its group: its rows, reads and state."""

    group: RowGroup
    tag: int

    @property
    def spec(self) -> TableSpec:
        return self.group.specs[self.tag]

    @property
    def rows(self) -> int:
        """Rows held."""
        return int(self.group.rows_held[self.tag])

    @property
    def held_bytes(self) -> int:
        """The bytes the memory cap counts for the table's rows."""
        return self.rows * (self.group.row_bytes + ROW_OVERHEAD_BYTES)

    def _tags(self, n: int) -> np.ndarray | None:
        return np.full(n, self.tag, dtype=np.int32) if self.group.tagged else None

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The current rows of these IDs (initial values where none is held)."""
        return self.group.lookup(ids, self._tags(len(ids)))

    def missing(self, ids: np.ndarray) -> int:
        return self.group.missing(ids, self._tags(len(ids)))

    def state(self) -> dict[str, np.ndarray]:
        return self.group.state(self.tag)

    def state_bytes(self) -> bytes:
        return self.group.state_bytes(self.tag)


@dataclass
class _Batch:
    """A request's blocks of one group as one batch: the IDs (and values) of its blocks one after the other."""

    group: int
    blocks: list[int]  # the positions of its blocks in the request
    ids: np.ndarray
    values: np.ndarray | None
    tags: np.ndarray | None  # each ID's table in the group (None in a group of one)
    tables: np.ndarray  # each block's table index in the model
    starts: np.ndarray  # where each block's IDs start in `ids`

    def table_at(self, position: int) -> int:
        """The table (model index) of the ID at this position."""
        return int(self.tables[np.searchsorted(self.starts, position, side="right") - 1])


class ShardTables:
    """This shard's rows of every table of one model, in groups of one width, row optimizer and learning rate."""

    def __init__(self, specs: Sequence[TableSpec], index: int, num_shards: int, config: ServerConfig) -> None:
        self.specs = tuple(specs)
        self.index = index
        self.num_shards = num_shards
        self.config = config
        kinds: dict[tuple[int, str, float], list[int]] = {}
        for k, s in enumerate(self.specs):
            kinds.setdefault((s.dim, s.row_optimizer(config.optimizer), s.lr or config.lr), []).append(k)
        self._kinds = list(kinds)
        self._members = list(kinds.values())  # each group's tables (model indexes), its tags in order
        self._group_of = np.zeros(len(self.specs), dtype=np.int64)
        self._tag_of = np.zeros(len(self.specs), dtype=np.int32)
        for g, members in enumerate(self._members):
            self._group_of[members] = g
            self._tag_of[members] = np.arange(len(members))
        self._bounds = np.array([s.num_embeddings for s in self.specs], dtype=np.int64)
        self._direct = self._choose_indexes()
        self.groups = [
            RowGroup([self.specs[k] for k in m], opt, lr, direct=d)
            for ((_, opt, lr), m), d in zip(self._groups(), self._direct, strict=True)
        ]
        self._warned_full = False

    def _choose_indexes(self) -> list[bool]:
        """Each group's index, from the specs alone (nothing is allocated yet): direct while the direct indexes
        together stay within 1/DIRECT_INDEX_SHARE of --max-table-bytes, else the hash index (see direct_index)."""
        budget = self.config.max_table_bytes // DIRECT_INDEX_SHARE
        out = []
        for (_, opt, _), m in self._groups():
            specs = [self.specs[k] for k in m]
            direct = direct_index(specs, opt, self.num_shards, budget)
            if direct:
                budget -= direct_index_bytes(specs)
            elif all(s.bounded for s in specs):
                log.info(
                    "shard %d: tables %s index their rows by hashing: a direct index of %d IDs would take %d bytes, "
                    "over what --max-table-bytes %d leaves for one",
                    self.index,
                    ", ".join(s.name for s in specs),
                    sum(s.num_embeddings for s in specs),
                    direct_index_bytes(specs),
                    self.config.max_table_bytes,
                )
            out.append(direct)
        return out

    def _groups(self) -> list[tuple[tuple[int, str, float], list[int]]]:
        """Each group's kind (dim, row optimizer, rate) and tables."""
        return list(zip(self._kinds, self._members, strict=True))

    def __len__(self) -> int:
        return len(self.specs)

    def __bool__(self) -> bool:
        return bool(self.specs)

    @property
    def tables(self) -> list[TableView]:
        """Every table, in the model's order."""
        return [TableView(self.groups[g], int(t)) for g, t in zip(self._group_of, self._tag_of, strict=True)]

    # -- requests ------------------------------------------------------------------------------------------------

    def plan(self, request_rows: Sequence[ps_pb2.Rows], request_lookups: Sequence[ps_pb2.Rows]) -> SparseIn:
        """Arrays to receive a request's rows and lookups into; InvalidArgument for an unknown table, TooLarge for a
        count past MAX_ROWS_BYTES or looked-up rows past MAX_LOOKUP_BYTES, before anything is allocated. A group's
        blocks are slices of one buffer."""
        total = answer = 0
        for entry, values in [*((e, True) for e in request_rows), *((e, False) for e in request_lookups)]:
            if entry.table >= len(self.specs):
                raise InvalidArgument(
                    f"rows for table {entry.table}, but the model has {len(self.specs)} table(s)"
                    + (f" ({', '.join(s.name for s in self.specs)})" if self.specs else "")
                )
            total += entry.count * (8 + (4 * self.specs[entry.table].dim if values else 0))
            answer += 0 if values else entry.count * 4 * self.specs[entry.table].dim
        if total > MAX_ROWS_BYTES:
            raise TooLarge(
                f"{total} bytes of rows and IDs in one request, over the limit of {MAX_ROWS_BYTES}: send smaller "
                "batches"
            )
        if answer > MAX_LOOKUP_BYTES:
            raise TooLarge(
                f"the rows looked up would take {answer} bytes in the reply, over the limit of {MAX_LOOKUP_BYTES}: "
                "look up fewer IDs per call"
            )
        pushed = zip(request_rows, self._arrays(request_rows, True), strict=True)
        looked = zip(request_lookups, self._arrays(request_lookups, False), strict=True)
        rows = [RowBlock(e.table, ids, values, at) for e, (ids, values, at) in pushed]
        lookups = [RowBlock(e.table, ids, None, at) for e, (ids, _, at) in looked]
        return SparseIn(rows, lookups)

    def _arrays(self, entries: Sequence[ps_pb2.Rows], values: bool) -> list[tuple[np.ndarray, np.ndarray | None, int]]:
        """Each entry's IDs (and values), a group's entries as consecutive slices of one buffer, and where each
        starts in it."""
        out: list[tuple[np.ndarray, np.ndarray | None, int]] = [(np.empty(0, np.int64), None, -1)] * len(entries)
        by_group: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            by_group.setdefault(int(self._group_of[e.table]), []).append(i)
        for g, where in by_group.items():
            counts = [entries[i].count for i in where]
            ids, starts = planned(counts, None)
            vals: list[np.ndarray | None] = [None] * len(where)
            if values:
                vals[:] = planned(counts, self.groups[g].dim)[0]
            for i, a, v, at in zip(where, ids, vals, starts, strict=True):
                out[i] = (a, v, at)
        return out

    def _batches(self, blocks: Sequence[RowBlock]) -> list[_Batch]:
        """The blocks as one batch per group (in the order groups first appear)."""
        by_group: dict[int, list[int]] = {}
        for i, b in enumerate(blocks):
            by_group.setdefault(int(self._group_of[b.table]), []).append(i)
        out = []
        for g, where in by_group.items():
            parts = [blocks[i] for i in where]
            tables = np.array([b.table for b in parts], dtype=np.int64)
            counts = [len(b.ids) for b in parts]
            values = joined(parts, values=True) if parts[0].values is not None else None
            tags = np.repeat(self._tag_of[tables], counts) if self.groups[g].tagged else None
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            out.append(_Batch(g, where, joined(parts), values, tags, tables, starts))
        return out

    def group_of(self, table: int) -> int:
        """The group (index in `groups`) holding this table's rows."""
        return int(self._group_of[table])

    def check(self, blocks: Sequence[RowBlock], what: str = "the rows' gradients") -> None:
        """Refuse (InvalidArgument) IDs this shard cannot take: outside a bounded table, held by another shard,
        twice in one request; and values that are NaN or infinite (`what` they are, for the message). Nothing is
        changed either way."""
        seen: set[int] = set()
        for block in blocks:
            if block.values is not None:
                if block.table in seen:
                    raise InvalidArgument(
                        f"table {self.specs[block.table].name!r} appears twice in one push: send each table's rows once"
                    )
                seen.add(block.table)
        for batch in self._batches(blocks):
            self._check_batch(blocks, batch, what)

    def _check_batch(self, blocks: Sequence[RowBlock], batch: _Batch, what: str) -> None:
        ids = batch.ids
        if not len(ids):
            return
        block_bounds = self._bounds[batch.tables]
        if block_bounds.any():  # per-ID bounds only where some table of the batch is bounded
            bounds = np.repeat(block_bounds, np.diff(np.append(batch.starts, len(ids))))
            outside = (bounds > 0) & ((ids < 0) | (ids >= bounds))
            if outside.any():
                b = blocks[batch.blocks[np.searchsorted(batch.starts, np.argmax(outside), side="right") - 1]]
                raise InvalidArgument(self.specs[b.table].check_ids(b.ids))
        # Clients send each shard's IDs sorted (torch.unique's order): then one comparison proves them distinct. A
        # block's first ID need not exceed the last of the block before it.
        rising = ids[1:] > ids[:-1]
        edges = batch.starts[(batch.starts > 0) & (batch.starts < len(ids))] - 1
        rising[edges] = True
        if not rising.all():
            for i in batch.blocks:
                b = blocks[i]
                if len(b.ids) > 1 and not (b.ids[1:] > b.ids[:-1]).all() and len(np.unique(b.ids)) != len(b.ids):
                    raise InvalidArgument(
                        f"table {self.specs[b.table].name!r}: an ID appears more than once in one request: sum its "
                        "rows first"
                    )
        if self.num_shards > 1:
            owner = shard_of(ids, self.num_shards)
            wrong = np.flatnonzero(owner != self.index)
            if len(wrong):
                bad, name = int(ids[wrong[0]]), self.specs[batch.table_at(int(wrong[0]))].name
                raise InvalidArgument(
                    f"table {name!r}: ID {bad} belongs to shard {int(owner[wrong[0]])}, not {self.index} (mix64(id) "
                    f"mod {self.num_shards}, see ps.proto TableSpec)"
                )
        if batch.values is not None and not np.isfinite(batch.values).all():
            finite = np.isfinite(batch.values).all(axis=1)
            name = self.specs[batch.table_at(int(np.argmin(finite)))].name
            raise InvalidArgument(f"table {name!r}: NaN or Inf in {what}")

    def check_room(self, blocks: Sequence[RowBlock]) -> None:
        """Refuse (TooLarge: RESOURCE_EXHAUSTED) a push whose new rows would take the tables past the shard's
        --max-table-bytes, where --table-overflow is `refuse`; with `evict`, room is made when it applies."""
        if self.config.table_overflow != "refuse" or not blocks:
            return
        limit = self.table_bytes_limit()
        grow = 0
        for batch in self._batches(blocks):
            group = self.groups[batch.group]
            grow += group.missing(batch.ids, batch.tags) * (group.row_bytes + ROW_OVERHEAD_BYTES)
        if grow and self.nbytes + grow > limit:
            raise TooLarge(
                f"this push would make rows of {grow} bytes, and the tables of shard {self.index} hold {self.nbytes} "
                f"of their limit of {limit} (--max-table-bytes); raise it, add shards, or let rows be evicted "
                "(--table-overflow evict, or a table's capacity / evict_after_*)"
            )

    def give(self, blocks: Sequence[RowBlock], now: float) -> None:
        """Hold these checked rows (none held yet) from the start: version 0, optimizer state zero (an Init's given
        rows, paramserver.shard.sparse.given_rows)."""
        for block in blocks:
            assert block.values is not None
            group, tag, n = self.groups[self.group_of(block.table)], int(self._tag_of[block.table]), len(block.ids)
            group.load(
                tag,
                {
                    "ids": block.ids,
                    "values": block.values,
                    "optimizer_state": np.zeros((n, group.state_cols), np.float32),
                    "versions": np.zeros(n, np.int64),
                    "times": np.full(n, now),
                    "count_ids": np.empty(0, np.int64),
                    "counts": np.empty(0, np.int64),
                    "step": np.array([group.steps[tag]], np.int64),
                },
            )

    # -- reads and updates ---------------------------------------------------------------------------------------

    def lookup(self, blocks: Sequence[RowBlock]) -> list[np.ndarray]:
        """The current rows of each block's IDs (initial values where none is held), a group's at once."""
        out: list[np.ndarray] = [np.empty((0, 0), np.float32)] * len(blocks)
        for batch in self._batches(blocks):
            rows = self.groups[batch.group].lookup(batch.ids, batch.tags)
            at = 0
            for i in batch.blocks:
                n = len(blocks[i].ids)
                out[i] = rows[at : at + n]
                at += n
        return out

    def apply(self, blocks: Sequence[RowBlock], version: int, wall: float | None = None) -> None:
        """Apply one update's row gradients (each block's IDs unique), then evict what the tables' policies and
        the memory cap say. `wall`: when the update first applied (time.time(); a replay's), else now."""
        now = time.monotonic() if wall is None else wall - clock_shift()
        # The job's learning-rate schedule scales every table's rate as it scales the dense one's (a function of the
        # version, so a replay applies the same rates).
        config = self.config
        factor = config.lr_at(version) / config.lr if config.lr > 0 else 1.0
        touched = set()
        for batch in self._batches(blocks):
            assert batch.values is not None
            self.groups[batch.group].apply(batch.ids, batch.values, version, now, batch.tags, factor)
            touched.add(batch.group)
        for g, group in enumerate(self.groups):
            if g not in touched:
                group.tick()
        for group in self.groups:
            group.expire(version, now)
        self._keep_within_limit()

    def _keep_within_limit(self) -> None:
        limit = self.table_bytes_limit()
        if self.config.table_overflow != "evict" or self.nbytes <= limit:
            return  # refuse: each push was checked; a sync round of several may end up to one round above
        # Drop the least recently updated rows of every table in proportion to what it holds.
        over = self.nbytes - limit
        held = self.nbytes
        for table in self.tables:
            share = over * table.held_bytes / held
            cost = table.group.row_bytes + ROW_OVERHEAD_BYTES
            drop = min(table.rows, -(-int(share) // cost))
            if drop:
                table.group.evict_lru(table.rows - drop, table.tag)
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
        return sum(g.rows * (g.row_bytes + ROW_OVERHEAD_BYTES) for g in self.groups)

    # -- state ---------------------------------------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, np.ndarray]]:
        """Every table's rows, optimizer state and admission counts, as copies (for a checkpoint). Last-update
        times are kept as wall-clock seconds, so that age-based eviction goes on right in another process."""
        shift = clock_shift()
        out = []
        for table in self.tables:
            state = {k: np.array(v, copy=True) for k, v in table.state().items()}
            state["times"] = state["times"] + shift
            out.append(state)
        return out

    def restore(self, states: Sequence[dict[str, np.ndarray]]) -> None:
        """Take the tables' rows from a checkpoint's `snapshot` (ValueError when they do not fit the tables)."""
        if len(states) != len(self.specs):
            raise ValueError(f"the checkpoint holds {len(states)} tables, the model {len(self.specs)}")
        shift = clock_shift()
        moved = []
        for state in states:
            state = dict(state)
            state["times"] = np.asarray(state["times"], dtype=np.float64) - shift
            moved.append(state)
        self.groups = [
            RowGroup.from_states([self.specs[k] for k in m], opt, lr, [moved[k] for k in m], direct=d)
            for ((_, opt, lr), m), d in zip(self._groups(), self._direct, strict=True)
        ]

    def state_bytes(self) -> bytes:
        return b"|".join(t.state_bytes() for t in self.tables)

    def figures(self) -> list[tuple[str, TableFigures]]:
        """Each table's figures, by name (for the metrics)."""
        out = []
        for t in self.tables:
            g, tag = t.group, t.tag
            share = g.nbytes * t.rows // g.rows if g.rows else (g.nbytes if len(g.specs) == 1 else 0)
            figures = TableFigures(
                t.rows,
                t.held_bytes,
                int(share),
                int(g.rows_admitted[tag]),
                int(g.rows_evicted[tag]),
                int(g.ids_seen[tag]),
            )
            out.append((t.spec.name, figures))
        return out
