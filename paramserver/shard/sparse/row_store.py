"""The rows of sparse embedding tables on one shard: tables of one width, row optimizer and learning rate in one store
(as FBGEMM's table-batched embeddings share one weights tensor), with admission and eviction.

A batch of IDs is the unit of work: a few thousand IDs of any of the group's tables cost one probe, one gather, one
optimizer step and one scatter, never a Python step per ID or per table, and no work that grows with the table.

- `RowGroup`: the tables' rows on a RowSlab (paramserver.shard.sparse.row_slab: values and optimizer state in two
  slabs, a row keyed by (its table's tag, its ID) in an IdHash, or a DirectIndex for small bounded tables; per slot, the
  ID, the tag, the version and time of its last update; a free-slot stack reuses evicted slots). Each table keeps its
  own policy (initial rows, admission, eviction by age, capacity) and figures.
- `RowTable`: a group of one table, with that table's API.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from paramserver.shard.sparse.id_hash import DirectIndex, IdHash
from paramserver.shard.sparse.row_optimizers import row_optimizer
from paramserver.shard.sparse.row_slab import RowSlab
from paramserver.shard.sparse.table_state import checked_state, state_bytes
from paramserver.tables import Initialiser, TableSpec, as_ids

_STEP_CHUNK_ELEMENTS = 1 << 22  # floats per gathered chunk in an optimizer step (16 MiB a temporary)
_NO_LRU = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64))


class RowGroup(RowSlab):
    """The rows of one or more tables of one width, row optimizer and rate on one shard. A table is named by its tag,
    its position in `specs`; batch calls take the IDs and, in a group of several tables, each ID's tag (int32; None
    in a group of one). The caller resolves the optimizer and rate, validates and de-duplicates (tag, ID) pairs, and
    serialises calls: a group has no lock."""

    def __init__(
        self,
        specs: Sequence[TableSpec],
        optimizer: str,
        lr: float,
        seed_rng: int = 0,
        direct: bool = False,
        updates: bool = True,
    ) -> None:
        self.specs = tuple(specs)
        if not self.specs or len({s.dim for s in self.specs}) != 1:
            raise ValueError("a row group holds one or more tables of one dim")
        self.dim = self.specs[0].dim
        self.optimizer = row_optimizer(optimizer)
        self.lr = float(lr)
        self._rate = self.lr
        self.state_cols = self.optimizer.state_cols(self.dim)
        count = len(self.specs)
        self.tagged = count > 1
        self.initialisers = [Initialiser(s) for s in self.specs]  # each caches the codebooks its rows read
        # One admission RNG per table, drawn in its own IDs' order: a table admits the same rows in a group as alone.
        self._rngs = [np.random.default_rng(np.random.SeedSequence([s.seed, seed_rng])) for s in self.specs]
        # Bounded tables may index their rows directly (`direct`: the caller weighs its memory), else by hashing.
        if direct and not all(s.bounded for s in self.specs):
            raise ValueError("a direct index is for bounded tables only")
        index = DirectIndex([s.num_embeddings for s in self.specs]) if direct else IdHash(np.int32, self.tagged)
        super().__init__(self.dim, self.state_cols, index, self.tagged, updates)
        self._counts = IdHash(np.int64, self.tagged)  # IDs without a row -> how many updates they were in
        # Each table's policy, indexed by tag (0 means never / always, as in TableSpec).
        self._admit_after = np.array([s.admit_after for s in self.specs], dtype=np.int64)
        self._admit_p = np.array([s.admit_probability for s in self.specs], dtype=np.float64)
        self._old_versions = np.array([s.evict_after_versions for s in self.specs], dtype=np.int64)
        self._old_seconds = np.array([s.evict_after_seconds for s in self.specs], dtype=np.float64)
        self._caps = np.array([s.capacity for s in self.specs], dtype=np.int64)
        self._ages = bool(self._old_versions.any() or self._old_seconds.any())
        # Per table: updates applied (SparseAdam's bias correction counts per table), IDs seen, rows held, made and
        # dropped.
        self.steps = np.zeros(count, dtype=np.int64)
        self.ids_seen = np.zeros(count, dtype=np.int64)
        self.rows_held = np.zeros(count, dtype=np.int64)
        self.rows_admitted = np.zeros(count, dtype=np.int64)
        self.rows_evicted = np.zeros(count, dtype=np.int64)
        # Per table, the oldest rows as of its last LRU scan, oldest first: later evictions take from it while its
        # entries are unchanged (same ID, same version), so a table at its capacity pays one O(rows) scan per many
        # applies.
        self._lru: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lru_next: dict[int, int] = {}
        self._ids_since_sweep = 0

    # --- sizes -------------------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the group: the slab's (RowSlab.nbytes), the admission counts and the LRU queues
        (the Initialisers' codebooks, a constant per table, are not counted)."""
        queues = sum(a.nbytes for q in self._lru.values() for a in q)
        return int(super().nbytes + self._counts.nbytes + queues)

    def _per_table(self, tags: np.ndarray | None, n: int) -> np.ndarray | int:
        """How many of n keys belong to each table (a group of one: n, added to its one-element arrays)."""
        if tags is None:
            return n
        return np.bincount(tags, minlength=len(self.specs)).astype(np.int64)

    # --- reads -------------------------------------------------------------------------------------------------

    def lookup(self, ids: np.ndarray, tags: np.ndarray | None = None) -> np.ndarray:
        """The current rows of these IDs, float32 [n, dim]; an ID without a row reads as its initial row. Makes no
        row (a read must not let a reader fill the table)."""
        ids = np.ascontiguousarray(as_ids(ids))
        slots = self._index.get(ids, tags)
        found = slots >= 0
        if found.all():
            return self._gather(slots)
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        if found.any():
            out[found] = self._gather(slots[found])
        absent = np.flatnonzero(~found)
        out[absent] = self._initial(ids[absent], None if tags is None else tags[absent])
        return out

    def _initial(self, ids: np.ndarray, tags: np.ndarray | None) -> np.ndarray:
        """The initial rows of these IDs, each by its table's rule."""
        if tags is None:
            return self.initialisers[0].rows(ids)
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for tag in np.unique(tags):
            where = np.flatnonzero(tags == tag)
            out[where] = self.initialisers[int(tag)].rows(ids[where])
        return out

    def missing(self, ids: np.ndarray, tags: np.ndarray | None = None) -> int:
        """How many of these IDs have no row (what an apply could add at most, for the caller's memory cap)."""
        ids = np.ascontiguousarray(as_ids(ids))
        return int(np.count_nonzero(self._index.get(ids, tags) < 0))

    # --- updates -----------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Count an update that brought the group no rows: a table's step counts the job's updates, as
        torch.optim.SparseAdam counts its steps (its bias correction), not only those that touched it."""
        self.steps += 1

    def apply(
        self,
        ids: np.ndarray,
        grads: np.ndarray | torch.Tensor,
        version: int,
        now: float,
        tags: np.ndarray | None = None,
        lr_factor: float = 1.0,
    ) -> None:
        """Apply one update: the gradients of these unique (tag, ID) pairs, float32 [n, dim], summed per pair, at the
        group's rate times `lr_factor` (the job's schedule).

        IDs without a row go through admission first (the rest of their gradient is dropped); then one optimizer
        step on every row the IDs now have, which become this version's and this time's; then eviction.
        """
        ids = np.ascontiguousarray(as_ids(ids))
        if isinstance(grads, torch.Tensor):
            g = grads.detach().to(torch.float32)
        else:
            g = torch.from_numpy(np.ascontiguousarray(grads, dtype=np.float32))
        if tuple(g.shape) != (len(ids), self.dim):
            raise ValueError(f"rows of dim {self.dim}: gradients of shape {tuple(g.shape)} for {len(ids)} IDs")
        self.steps += 1
        self.ids_seen += self._per_table(tags, len(ids))
        self._rate = self.lr * lr_factor  # this update's (_step_at's)
        slots = self._index.get(ids, tags)
        if self._ages:
            # A row too old to be kept is re-made as a new one even when no sweep has dropped it yet, so that what
            # an update does never depends on when the last sweep ran.
            held = np.flatnonzero(slots >= 0)
            stale = held[self._too_old(slots[held], version, now)]
            if len(stale):
                self._drop(slots[stale])
                slots[stale] = -1
        absent = np.flatnonzero(slots < 0)
        if len(absent):
            absent_tags = None if tags is None else tags[absent]
            admitted = self._admit(ids[absent], absent_tags)
            slots[absent[admitted]] = self._make_rows(
                ids[absent[admitted]], None if absent_tags is None else absent_tags[admitted]
            )
            present = np.flatnonzero(slots >= 0)
            self._step(slots[present], g[torch.from_numpy(present)], None if tags is None else tags[present])
            slots = slots[present]
        else:
            self._step(slots, g, tags)
        self._versions[slots] = version
        self._times[slots] = now
        self._ids_since_sweep += len(ids)
        if self._ages and self._ids_since_sweep * 8 >= self.rows:
            self.expire(version, now)
        for tag in np.flatnonzero(self._caps):
            if self.rows_held[tag] > self._caps[tag]:
                self.evict_lru(int(self._caps[tag]), int(tag))

    def _step(self, slots: np.ndarray, grads: torch.Tensor, tags: np.ndarray | None) -> None:
        if len(slots) == 0:
            return
        steps = self.steps if len(self.steps) == 1 else np.unique(self.steps)
        if len(steps) > 1 and tags is not None:
            # Tables restored at different step counts (an optimizer's bias correction counts per table): one step
            # per count, each over its tables' rows.
            for count in steps:
                mine = np.flatnonzero(self.steps[tags] == count)
                self._step_at(slots[mine], grads[torch.from_numpy(mine)], int(count))
            return
        self._step_at(slots, grads, int(steps[0]))

    def _step_at(self, slots: np.ndarray, grads: torch.Tensor, step: int) -> None:
        chunk = max(1, _STEP_CHUNK_ELEMENTS // max(self.dim, self.state_cols))
        for begin in range(0, len(slots), chunk):
            s = torch.from_numpy(slots[begin : begin + chunk])
            values = self._values.index_select(0, s)
            state = self._state.index_select(0, s)
            self.optimizer.step(values, state, grads[begin : begin + chunk], self._rate, step)
            self._values.index_copy_(0, s, values)
            if self.state_cols:
                self._state.index_copy_(0, s, state)

    def _admit(self, ids: np.ndarray, tags: np.ndarray | None) -> np.ndarray:
        """Which of these row-less IDs get a row now (bool); counts the others' updates."""
        after = self._admit_after if tags is None else self._admit_after[tags]
        p = self._admit_p if tags is None else self._admit_p[tags]
        counting = np.broadcast_to(after > 1, ids.shape)
        drawing = np.broadcast_to(p < 1, ids.shape)
        if not counting.any() and not drawing.any():
            return np.ones(len(ids), dtype=bool)
        admit = ~(counting | drawing)
        c = np.flatnonzero(counting)
        if len(c):
            c_tags = None if tags is None else tags[c]
            cells = self._counts.find(ids[c], c_tags)
            known = cells >= 0
            counts = np.ones(len(c), dtype=np.int64)
            counts[known] += self._counts.vals[cells[known]]
            admit[c] |= counts >= np.broadcast_to(after, ids.shape)[c]
        d = np.flatnonzero(drawing)
        if len(d):
            d_tags = np.zeros(len(d), np.int32) if tags is None else tags[d]
            for tag in np.unique(d_tags):
                mine = d[d_tags == tag]
                admit[mine] |= self._rngs[int(tag)].random(len(mine)) < self._admit_p[tag]
        if len(c):
            got = admit[c]
            self._counts.remove_cells(cells[got & known])
            kept = ~got & known
            self._counts.vals[cells[kept]] = counts[kept]
            new = ~got & ~known
            self._counts.insert(ids[c][new], counts[new], None if c_tags is None else c_tags[new])
        return admit

    def _make_rows(self, ids: np.ndarray, tags: np.ndarray | None) -> np.ndarray:
        """Rows at their initial value and zero state for these new IDs; their slots."""
        slots = self._take_slots(len(ids))
        chunk = max(1, _STEP_CHUNK_ELEMENTS // self.dim)  # the initial rows are computed in float64
        for begin in range(0, len(ids), chunk):
            part = slice(begin, begin + chunk)
            rows = torch.from_numpy(self._initial(ids[part], None if tags is None else tags[part]))
            self._values.index_copy_(0, torch.from_numpy(slots[part]), rows)
        self._claim(slots, ids, tags)
        made = self._per_table(tags, len(ids))
        self.rows_admitted += made
        self.rows_held += made
        return slots

    # --- eviction ----------------------------------------------------------------------------------------------

    def _too_old(self, slots: np.ndarray, version: int, now: float) -> np.ndarray:
        tags = self._slot_tags[slots] if self.tagged else 0
        versions = self._old_versions[tags] if self.tagged else self._old_versions[0]
        seconds = self._old_seconds[tags] if self.tagged else self._old_seconds[0]
        old = (versions > 0) & (self._versions[slots] < version - versions)
        old |= (seconds > 0) & (self._times[slots] < now - seconds)
        return np.broadcast_to(old, slots.shape)

    def _drop(self, slots: np.ndarray) -> None:
        """Remove the rows in these (live, distinct) slots and release the slots."""
        if len(slots) == 0:
            return
        tags = self._slot_tags[slots] if self.tagged else None
        self._release(slots, tags)
        dropped = self._per_table(tags, len(slots))
        self.rows_evicted += dropped
        self.rows_held -= dropped

    def expire(self, version: int, now: float) -> int:
        """Drop now every row whose last update is more than its table's evict_after_versions versions before
        `version` or more than its evict_after_seconds seconds before `now`; how many were dropped. apply runs
        this every few updates."""
        self._ids_since_sweep = 0
        if not self._ages:
            return 0
        held = np.flatnonzero(self._live[: self._high])
        old = held[self._too_old(held, version, now)]
        self._drop(old)
        return len(old)

    def evict_lru(self, rows_to_keep: int, tag: int = 0) -> int:
        """Drop table `tag`'s least recently updated rows down to `rows_to_keep`; how many were dropped. Least
        recent is by version, then time, then ID: a function of the logical state (state()), so a restored table
        evicts as the original would."""
        excess = int(self.rows_held[tag]) - max(0, rows_to_keep)
        if excess <= 0:
            return 0
        left = excess
        while left:
            slots, ids, versions, times = self._lru.get(tag, _NO_LRU)
            start = self._lru_next.get(tag, 0)
            if start >= len(slots):
                self._scan_lru(left, tag)
                continue
            window = slice(start, start + 2 * left + 64)
            s = slots[window]
            # An entry still stands for its row while the slot holds the same ID, not updated since the scan.
            valid = self._live[s] & (self._slot_ids[s] == ids[window])
            valid &= (self._versions[s] == versions[window]) & (self._times[s] == times[window])
            if self.tagged:
                valid &= self._slot_tags[s] == tag
            taken = np.flatnonzero(valid)[:left]
            self._lru_next[tag] = start + (int(taken[-1]) + 1 if len(taken) == left else len(s))
            self._drop(s[taken])
            left -= len(taken)
        return excess

    def _scan_lru(self, needed: int, tag: int) -> None:
        """Queue table `tag`'s oldest rows, oldest first: `needed` of them and a reserve for later evictions.

        Rows updated after the scan are newer than all of them while versions and times do not go back, so the
        queue's unchanged entries stay the oldest rows until it is used up: one O(rows) scan serves many applies
        of a table at its capacity."""
        held = self._held_of(tag)
        versions = self._versions[held]
        take = min(len(held), max(8 * needed, len(held) // 16))
        if take < len(held):
            bound = np.partition(versions, take - 1)[take - 1]
            held = held[versions <= bound]  # the oldest `take`, and every row tied with the newest of them
            versions = self._versions[held]
        ids, times = self._slot_ids[held], self._times[held]
        order = np.lexsort((ids, times, versions))[:take]
        self._lru[tag] = (held[order], ids[order], versions[order], times[order])
        self._lru_next[tag] = 0

    # --- checkpoints -------------------------------------------------------------------------------------------

    def state(self, tag: int = 0) -> dict[str, np.ndarray]:
        """Table `tag`'s whole logical state as plain numpy arrays, rows in ascending ID order (two tables holding
        the same rows give equal arrays, whatever their slots or group): ids, values, optimizer_state, versions,
        times, count_ids, counts, step. The counters (ids_seen, ...) and the admission RNG's position are not in
        it."""
        count_ids, counts = self._counts.items(tag)
        return {
            **self._rows_of(tag),
            "count_ids": count_ids,
            "counts": counts,
            "step": np.array([self.steps[tag]], dtype=np.int64),
        }

    @classmethod
    def from_states(
        cls,
        specs: Sequence[TableSpec],
        optimizer: str,
        lr: float,
        states: Sequence[dict[str, np.ndarray]],
        seed_rng: int = 0,
        direct: bool = False,
    ) -> RowGroup:
        """A group holding exactly what each table's `state()` returned; ValueError when the arrays do not fit."""
        group = cls(specs, optimizer, lr, seed_rng, direct)
        if len(states) != len(group.specs):
            raise ValueError(f"{len(states)} table states for a group of {len(group.specs)} tables")
        for tag, (spec, state) in enumerate(zip(group.specs, states, strict=True)):
            group.load(tag, checked_state(spec, group.state_cols, state))
        return group

    def load(self, tag: int, a: dict[str, np.ndarray]) -> None:
        """Add the rows of a checked state (table_state.checked_state) to table `tag`, none of whose IDs it holds."""
        self.steps[tag] = int(a["step"][0])
        self.rows_held[tag] += self._put_rows(tag, a)
        count_ids = a["count_ids"]
        self._counts.insert(count_ids, a["counts"], np.full(len(count_ids), tag, np.int32) if self.tagged else None)

    def state_bytes(self, tag: int = 0) -> bytes:
        """Table `tag`'s logical state (state()) as one deterministic byte string (table_state.state_bytes)."""
        return state_bytes(self.state(tag))


class RowTable(RowGroup):
    """One sparse table's rows on one shard: a group of one table, with that table's figures as plain ints."""

    def __init__(self, spec: TableSpec, optimizer: str, lr: float, seed_rng: int = 0) -> None:
        super().__init__([spec], optimizer, lr, seed_rng)
        self.spec = spec

    @classmethod
    def from_state(
        cls, spec: TableSpec, optimizer: str, lr: float, state: dict[str, np.ndarray], seed_rng: int = 0
    ) -> RowTable:
        """A table holding exactly what `state()` returned; ValueError when the arrays do not fit together."""
        table = cls(spec, optimizer, lr, seed_rng)
        table.load(0, checked_state(spec, table.state_cols, state))
        return table
