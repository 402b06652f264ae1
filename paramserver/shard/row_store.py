"""One sparse embedding table's rows on one shard: a vectorised hash index, row and optimizer-state slabs, admission
and eviction.

A batch of IDs is the unit of work: a lookup or an update of a few thousand IDs costs a fixed number of numpy and
torch calls, never a Python step per ID, and no work that grows with the table (the hash index's probes stay
short), so a table of ten million rows answers nearly as fast as one of a hundred thousand: the difference is the
cache misses of its scattered rows.

- `_IdHash`: open addressing from any int64 ID to a non-negative int (a row's slot, or an ID's update count).
  Linear probing runs over the whole batch at once: each round looks at a window of cells for every ID still
  unresolved, so most IDs resolve in the first round and the loop is over rounds, not IDs.
- `RowTable`: the rows (one float32 slab [capacity, dim]) and their optimizer state (one slab [capacity,
  state_cols]), indexed by slot; a free-slot stack reuses an evicted row's slot; per slot, the ID, the version and
  time of its last update. Rows are made on admission and dropped by the capacity (least recently updated first)
  and by age.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from paramserver.shard.row_optimizers import row_optimizer
from paramserver.tables import Initialiser, TableSpec, as_ids, mix64

EMPTY = -1  # an index cell that never held a key since the last rebuild: a probe for a key stops here
DELETED = -2  # a tombstone: a removed key's cell, which a probe passes over and an insert may reuse
_MIN_CELLS = 16
_WINDOW = 16  # cells a round of probing looks at per ID, after the first round's one
_OFFSETS = np.arange(_WINDOW, dtype=np.int64)[:, None]
_INDEX_CHUNK = 1 << 20  # IDs per pass through the index, to bound the temporaries of a huge batch
_STEP_CHUNK_ELEMENTS = 1 << 22  # floats per gathered chunk in an optimizer step (16 MiB a temporary)
_MIN_SLOTS = 16
_SLOT_GROWTH = 1.25  # not 2: the slabs are most of a table's memory, and a doubling would leave half of it idle
_INT32_MAX = np.iinfo(np.int32).max
_STATE_KEYS = ("ids", "values", "optimizer_state", "versions", "times", "count_ids", "counts", "step")


class _IdHash:
    """An open-addressing map from int64 keys to non-negative ints, whole batches at a time.

    Every int64 is a valid key: emptiness lives in the value array (EMPTY, DELETED), not in a reserved key. The
    capacity is a power of two and live keys plus tombstones stay at most half of it, so an unsuccessful probe is
    short and always ends at an EMPTY cell. A key's first cell is the top bits of mix64(key): a shard's IDs share
    mix64(ID) mod num_shards, which is in the low bits.
    """

    def __init__(self, value_dtype: type[np.signedinteger], cells: int = _MIN_CELLS) -> None:
        self.value_dtype = np.dtype(value_dtype)
        self.live = 0
        self.dead = 0
        self._allocate(cells)

    def _allocate(self, cells: int) -> None:
        self.keys = np.zeros(cells, dtype=np.int64)
        self.vals = np.full(cells, EMPTY, dtype=self.value_dtype)
        self.mask = cells - 1
        self.shift = np.uint64(64 - (cells.bit_length() - 1))
        self.dead = 0

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.vals.nbytes)

    def widen(self) -> None:
        """Hold values beyond int32 (a table of more than 2^31 slots)."""
        self.vals = self.vals.astype(np.int64)
        self.value_dtype = np.dtype(np.int64)

    def _start(self, ids: np.ndarray) -> np.ndarray:
        return (mix64(ids.view(np.uint64)) >> self.shift).astype(np.int64)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The cell holding each key, -1 where it is absent (int64, one per ID; duplicates allowed)."""
        return self._probe(ids, values=False)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Each key's value, -1 where it is absent (int64)."""
        return self._probe(ids, values=True)

    def _probe(self, ids: np.ndarray, values: bool) -> np.ndarray:
        out = np.full(len(ids), -1, dtype=np.int64)
        if self.live == 0:
            return out
        for begin in range(0, len(ids), _INDEX_CHUNK):
            part = ids[begin : begin + _INDEX_CHUNK]
            out[begin : begin + len(part)] = self._find(part, values)
        return out

    def _find(self, ids: np.ndarray, values: bool) -> np.ndarray:
        keys, vals, mask = self.keys, self.vals, self.mask
        # Round one looks at each ID's home cell only, on flat arrays: at load <= 1/2 it settles about 80% of
        # them, at the fewest operations per ID.
        pos = self._start(ids)
        v = vals.take(pos)
        hit = keys.take(pos) == ids
        hit &= v >= 0
        out = np.where(hit, v if values else pos, -1).astype(np.int64, copy=False)
        go_on = v != EMPTY
        go_on &= ~hit
        todo = np.flatnonzero(go_on)
        pos, want = pos[todo] + 1, ids[todo]
        # Then windows of _WINDOW cells per ID, laid out [window, IDs] so every operation runs along contiguous
        # memory; one window nearly always reaches the key or an EMPTY cell.
        while len(todo):
            cells = (pos + _OFFSETS) & mask
            v = vals.take(cells)
            hit = keys.take(cells) == want
            hit &= v >= 0
            stop = v == EMPTY
            stop |= hit
            first = stop.argmax(axis=0)
            cols = np.arange(len(todo))
            found = hit[first, cols]
            out[todo[found]] = (v if values else cells)[first[found], cols[found]]
            go_on = ~stop[first, cols]
            todo, pos, want = todo[go_on], pos[go_on] + _WINDOW, want[go_on]
        return out

    def remove_cells(self, cells: np.ndarray) -> None:
        """Remove the keys in these (live, distinct) cells: they become tombstones until the next rebuild."""
        self.vals[cells] = DELETED
        self.live -= len(cells)
        self.dead += len(cells)

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Add keys that are absent and distinct (the caller knows), with their values (>= 0)."""
        n = len(ids)
        if n == 0:
            return
        cells = len(self.keys)
        if self.live + self.dead + n > cells // 2:
            # Tombstones alone: clean them up in place while that leaves room for a run of later removals (1/16
            # of the cells), so churn at a steady size costs O(1) per key; otherwise double.
            if (self.live + n) * 16 <= cells * 7:
                self._rebuild(cells)
            else:
                cells *= 2
                while (self.live + n) * 2 > cells:
                    cells *= 2
                self._rebuild(cells)
        for begin in range(0, n, _INDEX_CHUNK):
            self._insert(ids[begin : begin + _INDEX_CHUNK], values[begin : begin + _INDEX_CHUNK])
        self.live += n

    def _insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        todo = np.arange(len(ids))
        pos = self._start(ids)
        # Round one tries each key's home cell, as _find does; then windows from the next cell on.
        home = self.vals.take(pos) < 0
        taken = self._claim(ids, values, todo[home], pos[home])
        left = np.ones(len(ids), dtype=bool)
        left[taken] = False
        todo = np.flatnonzero(left)
        pos = pos[todo] + 1
        while len(todo):
            cells = (pos + _OFFSETS) & self.mask
            free = self.vals.take(cells) < 0
            has = free.any(axis=0)
            target = cells[free.argmax(axis=0), np.arange(len(todo))]
            taken = self._claim(ids, values, todo[has], target[has])
            left = np.ones(len(todo), dtype=bool)
            left[np.searchsorted(todo, taken)] = False
            # A key that lost its free cell to another probes on from that (now taken) cell.
            pos = np.where(has, target, pos + _WINDOW)
            todo, pos = todo[left], pos[left]

    def _claim(self, ids: np.ndarray, values: np.ndarray, claimers: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """Put keys ids[claimers] into these free cells; which claimers got theirs (ascending, as claimers is).

        Two keys may reach one free cell in the same round: both write their key, one write stays (keys are
        distinct, so exactly one matches), and the others must probe on."""
        keys, vals = self.keys, self.vals
        want = ids[claimers]
        keys[cells] = want
        won = keys.take(cells) == want
        winners = cells[won]
        self.dead -= int(np.count_nonzero(vals.take(winners) == DELETED))
        vals[winners] = values[claimers[won]]
        return claimers[won]

    def _rebuild(self, cells: int) -> None:
        live = np.flatnonzero(self.vals >= 0)
        keys, vals = self.keys[live], self.vals[live]
        self._allocate(cells)
        for begin in range(0, len(keys), _INDEX_CHUNK):
            self._insert(keys[begin : begin + _INDEX_CHUNK], vals[begin : begin + _INDEX_CHUNK])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every live key and its value, in ascending key order."""
        live = np.flatnonzero(self.vals >= 0)
        keys = self.keys[live]
        order = np.argsort(keys, kind="stable")
        return keys[order], self.vals[live][order].astype(np.int64)


class RowTable:
    """One sparse table's rows on one shard, with their optimizer state, admission and eviction.

    The caller (the shard) resolves the optimizer name and the learning rate, validates and de-duplicates IDs,
    and serialises calls: a RowTable has no lock of its own.
    """

    def __init__(self, spec: TableSpec, optimizer: str, lr: float, seed_rng: int = 0) -> None:
        self.spec = spec
        self.dim = spec.dim
        self.optimizer = row_optimizer(optimizer)
        self.lr = float(lr)
        self.state_cols = self.optimizer.state_cols(spec.dim)
        self.initialiser = Initialiser(spec)  # one per table: it caches the codebooks every initial row reads
        self._rng = np.random.default_rng(np.random.SeedSequence([spec.seed, seed_rng]))
        self._index = _IdHash(np.int32)
        self._counts = _IdHash(np.int64)  # IDs without a row -> how many updates they were in (admit_after > 1)
        self.steps = 0  # updates applied: SparseAdam's bias correction counts per table
        self.ids_seen = 0
        self.rows_admitted = 0
        self.rows_evicted = 0
        self._capacity = 0
        self._high = 0  # slots below this were handed out at least once; above, never
        self._values = torch.empty((0, self.dim), dtype=torch.float32)
        self._state = torch.empty((0, self.state_cols), dtype=torch.float32)
        self._slot_ids = np.empty(0, dtype=np.int64)
        self._versions = np.empty(0, dtype=np.int64)
        self._times = np.empty(0, dtype=np.float64)
        self._live = np.empty(0, dtype=bool)
        self._free = np.empty(0, dtype=np.int64)  # a stack of released slots, top at _nfree
        self._nfree = 0
        # The oldest rows as of the last LRU scan, oldest first: later evictions take from it while its entries
        # are unchanged (same ID, same version), so a table at its capacity pays one O(rows) scan per many applies.
        self._lru = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64))
        self._lru_next = 0
        self._ids_since_sweep = 0

    # --- sizes -------------------------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        """Rows held."""
        return self._index.live

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's value and optimizer state."""
        return 4 * (self.dim + self.state_cols)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for this table: slabs, both indexes, per-slot arrays, free stack and LRU queue (the
        Initialiser's codebooks, a constant per table, are not counted)."""
        arrays = (self._slot_ids, self._versions, self._times, self._live, self._free, *self._lru)
        slabs = self._values.untyped_storage().nbytes() + self._state.untyped_storage().nbytes()
        return int(slabs + self._index.nbytes + self._counts.nbytes + sum(a.nbytes for a in arrays))

    # --- reads -------------------------------------------------------------------------------------------------

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        return self._index.get(ids)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The current rows of these IDs, float32 [n, dim]; an ID without a row reads as its initial row. Makes no
        row (a read must not let a reader fill the table)."""
        ids = np.ascontiguousarray(as_ids(ids))
        slots = self._slots(ids)
        found = slots >= 0
        if found.all():
            return self._gather(slots)
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        if found.any():
            out[found] = self._gather(slots[found])
        out[~found] = self.initialiser.rows(ids[~found])
        return out

    def _gather(self, slots: np.ndarray) -> np.ndarray:
        return self._values.index_select(0, torch.from_numpy(slots)).numpy()

    def missing(self, ids: np.ndarray) -> int:
        """How many of these IDs have no row (what an apply could add at most, for the caller's memory cap)."""
        ids = np.ascontiguousarray(as_ids(ids))
        return int(np.count_nonzero(self._slots(ids) < 0))

    # --- updates -----------------------------------------------------------------------------------------------

    def apply(self, ids: np.ndarray, grads: np.ndarray | torch.Tensor, version: int, now: float) -> None:
        """Apply one update: the gradients of these unique IDs, float32 [n, dim], summed per ID.

        IDs without a row go through admission first (the rest of their gradient is dropped); then one optimizer
        step on every row the IDs now have, which become this version's and this time's; then eviction.
        """
        ids = np.ascontiguousarray(as_ids(ids))
        if isinstance(grads, torch.Tensor):
            g = grads.detach().to(torch.float32)
        else:
            g = torch.from_numpy(np.ascontiguousarray(grads, dtype=np.float32))
        if tuple(g.shape) != (len(ids), self.dim):
            raise ValueError(f"table {self.spec.name!r}: gradients of shape {tuple(g.shape)} for {len(ids)} IDs")
        self.steps += 1
        self.ids_seen += len(ids)
        slots = self._slots(ids)
        if self._ages_evict():
            # A row too old to be kept is re-made as a new one even when no sweep has dropped it yet, so that what
            # an update does never depends on when the last sweep ran.
            held = np.flatnonzero(slots >= 0)
            stale = held[self._too_old(slots[held], version, now)]
            if len(stale):
                self._drop(slots[stale])
                slots[stale] = -1
        absent = np.flatnonzero(slots < 0)
        if len(absent):
            admitted = absent[self._admit(ids[absent])]
            slots[admitted] = self._make_rows(ids[admitted])
        if len(absent) == 0:
            self._step(slots, g)
        else:
            present = np.flatnonzero(slots >= 0)
            self._step(slots[present], g[torch.from_numpy(present)])
            slots = slots[present]
        self._versions[slots] = version
        self._times[slots] = now
        self._ids_since_sweep += len(ids)
        if self._ages_evict() and self._ids_since_sweep * 8 >= self.rows:
            self.expire(version, now)
        if self.spec.capacity and self.rows > self.spec.capacity:
            self.evict_lru(self.spec.capacity)

    def _step(self, slots: np.ndarray, grads: torch.Tensor) -> None:
        if len(slots) == 0:
            return
        chunk = max(1, _STEP_CHUNK_ELEMENTS // max(self.dim, self.state_cols))
        for begin in range(0, len(slots), chunk):
            s = torch.from_numpy(slots[begin : begin + chunk])
            g = grads[begin : begin + chunk]
            values = self._values.index_select(0, s)
            state = self._state.index_select(0, s)
            self.optimizer.step(values, state, g, self.lr, self.steps)
            self._values.index_copy_(0, s, values)
            if self.state_cols:
                self._state.index_copy_(0, s, state)

    def _admit(self, ids: np.ndarray) -> np.ndarray:
        """Which of these row-less IDs get a row now (bool); counts the others' updates."""
        spec = self.spec
        counting = spec.admit_after > 1
        if not counting and spec.admit_probability >= 1:
            return np.ones(len(ids), dtype=bool)
        admit = np.zeros(len(ids), dtype=bool)
        if counting:
            cells = self._counts.find(ids)
            known = cells >= 0
            counts = np.ones(len(ids), dtype=np.int64)
            counts[known] += self._counts.vals[cells[known]]
            admit |= counts >= spec.admit_after
        if spec.admit_probability < 1:
            admit |= self._rng.random(len(ids)) < spec.admit_probability
        if counting:
            self._counts.remove_cells(cells[admit & known])
            kept = ~admit & known
            self._counts.vals[cells[kept]] = counts[kept]
            new = ~admit & ~known
            self._counts.insert(ids[new], counts[new])
        return admit

    def _make_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows at their initial value and zero state for these new IDs; their slots."""
        slots = self._take_slots(len(ids))
        chunk = max(1, _STEP_CHUNK_ELEMENTS // self.dim)  # the initial rows are computed in float64
        for begin in range(0, len(ids), chunk):
            part = torch.from_numpy(self.initialiser.rows(ids[begin : begin + chunk]))
            self._values.index_copy_(0, torch.from_numpy(slots[begin : begin + chunk]), part)
        if self.state_cols:
            self._state.index_fill_(0, torch.from_numpy(slots), 0.0)
        self._slot_ids[slots] = ids
        self._live[slots] = True
        self._index.insert(ids, slots)
        self.rows_admitted += len(ids)
        return slots

    def _take_slots(self, n: int) -> np.ndarray:
        reused = min(n, self._nfree)
        fresh = n - reused
        if self._high + fresh > self._capacity:
            self._grow(max(self._high + fresh, math.ceil(self._capacity * _SLOT_GROWTH), _MIN_SLOTS))
        slots = np.empty(n, dtype=np.int64)
        slots[:reused] = self._free[self._nfree - reused : self._nfree]
        self._nfree -= reused
        slots[reused:] = np.arange(self._high, self._high + fresh)
        self._high += fresh
        return slots

    def _grow(self, capacity: int) -> None:
        high = self._high

        def grown(old: np.ndarray, fill: object) -> np.ndarray:
            new = np.empty(capacity, dtype=old.dtype)
            new[:high] = old[:high]
            new[high:] = fill
            return new

        values = torch.empty((capacity, self.dim), dtype=torch.float32)
        values[:high] = self._values[:high]
        state = torch.empty((capacity, self.state_cols), dtype=torch.float32)
        state[:high] = self._state[:high]
        self._values, self._state = values, state
        self._slot_ids = grown(self._slot_ids, 0)
        self._versions = grown(self._versions, 0)
        self._times = grown(self._times, 0.0)
        self._live = grown(self._live, False)
        self._capacity = capacity
        if capacity > _INT32_MAX and self._index.value_dtype != np.int64:
            self._index.widen()

    # --- eviction ----------------------------------------------------------------------------------------------

    def _ages_evict(self) -> bool:
        return bool(self.spec.evict_after_versions or self.spec.evict_after_seconds)

    def _too_old(self, slots: np.ndarray, version: int, now: float) -> np.ndarray:
        spec = self.spec
        old = np.zeros(len(slots), dtype=bool)
        if spec.evict_after_versions:
            old |= self._versions[slots] < version - spec.evict_after_versions
        if spec.evict_after_seconds:
            old |= self._times[slots] < now - spec.evict_after_seconds
        return old

    def _drop(self, slots: np.ndarray) -> None:
        """Remove the rows in these (live, distinct) slots and release the slots."""
        if len(slots) == 0:
            return
        self._index.remove_cells(self._index.find(self._slot_ids[slots]))
        self._live[slots] = False
        if self._nfree + len(slots) > len(self._free):
            free = np.empty(max(self._nfree + len(slots), 2 * len(self._free)), dtype=np.int64)
            free[: self._nfree] = self._free[: self._nfree]
            self._free = free
        self._free[self._nfree : self._nfree + len(slots)] = slots
        self._nfree += len(slots)
        self.rows_evicted += len(slots)

    def expire(self, version: int, now: float) -> int:
        """Drop now every row whose last update is more than evict_after_versions versions before `version` or more
        than evict_after_seconds seconds before `now`; how many were dropped. apply runs this every few updates."""
        self._ids_since_sweep = 0
        if not self._ages_evict():
            return 0
        held = np.flatnonzero(self._live[: self._high])
        old = held[self._too_old(held, version, now)]
        self._drop(old)
        return len(old)

    def evict_lru(self, rows_to_keep: int) -> int:
        """Drop the least recently updated rows down to `rows_to_keep`; how many were dropped. Least recent is by
        version, then time, then ID: a function of the logical state (state()), so a restored table evicts as the
        original would."""
        excess = self.rows - max(0, rows_to_keep)
        if excess <= 0:
            return 0
        left = excess
        while left:
            slots, ids, versions, times = self._lru
            if self._lru_next >= len(slots):
                self._scan_lru(left)
                continue
            window = slice(self._lru_next, self._lru_next + 2 * left + 64)
            s = slots[window]
            # An entry still stands for its row while the slot holds the same ID, not updated since the scan.
            valid = self._live[s] & (self._slot_ids[s] == ids[window])
            valid &= (self._versions[s] == versions[window]) & (self._times[s] == times[window])
            taken = np.flatnonzero(valid)[:left]
            if len(taken) == left:
                self._lru_next += int(taken[-1]) + 1
            else:
                self._lru_next += len(s)
            self._drop(s[taken])
            left -= len(taken)
        return excess

    def _scan_lru(self, needed: int) -> None:
        """Queue the oldest rows, oldest first: `needed` of them and a reserve for later evictions.

        Rows updated after the scan are newer than all of them while versions and times do not go back, so the
        queue's unchanged entries stay the oldest rows until it is used up: one O(rows) scan serves many applies
        of a table at its capacity."""
        held = np.flatnonzero(self._live[: self._high])
        versions = self._versions[held]
        take = min(len(held), max(8 * needed, len(held) // 16))
        if take < len(held):
            bound = np.partition(versions, take - 1)[take - 1]
            held = held[versions <= bound]  # the oldest `take`, and every row tied with the newest of them
            versions = self._versions[held]
        ids, times = self._slot_ids[held], self._times[held]
        order = np.lexsort((ids, times, versions))[:take]
        self._lru = (held[order], ids[order], versions[order], times[order])
        self._lru_next = 0

    # --- checkpoints -------------------------------------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        """The table's whole logical state as plain numpy arrays, rows in ascending ID order (two tables holding
        the same rows give equal arrays, whatever their slots): ids, values, optimizer_state, versions, times,
        count_ids, counts, step. The counters (ids_seen, ...) and the admission RNG's position are not in it."""
        held = np.flatnonzero(self._live[: self._high])
        order = np.argsort(self._slot_ids[held], kind="stable")
        slots = held[order]
        s = torch.from_numpy(slots)
        count_ids, counts = self._counts.items()
        return {
            "ids": self._slot_ids[slots],
            "values": self._values.index_select(0, s).numpy(),
            "optimizer_state": self._state.index_select(0, s).numpy(),
            "versions": self._versions[slots],
            "times": self._times[slots],
            "count_ids": count_ids,
            "counts": counts,
            "step": np.array([self.steps], dtype=np.int64),
        }

    @classmethod
    def from_state(
        cls, spec: TableSpec, optimizer: str, lr: float, state: dict[str, np.ndarray], seed_rng: int = 0
    ) -> RowTable:
        """A table holding exactly what `state()` returned; ValueError when the arrays do not fit together."""
        table = cls(spec, optimizer, lr, seed_rng)
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"table {spec.name!r}: the state lacks {', '.join(missing)}")
        a = {k: np.asarray(state[k]) for k in _STATE_KEYS}
        n = len(a["ids"]) if a["ids"].ndim == 1 else -1
        shapes = {
            "ids": ((n,), np.int64),
            "values": ((n, spec.dim), np.float32),
            "optimizer_state": ((n, table.state_cols), np.float32),
            "versions": ((n,), np.int64),
            "times": ((n,), np.float64),
            "count_ids": ((len(a["count_ids"]),), np.int64),
            "counts": ((len(a["count_ids"]),), np.int64),
            "step": ((1,), np.int64),
        }
        for key, (shape, dtype) in shapes.items():
            if a[key].shape != shape or a[key].dtype != dtype:
                raise ValueError(
                    f"table {spec.name!r}: state {key!r} is {a[key].dtype}{list(a[key].shape)}, "
                    f"expected {np.dtype(dtype)}{list(shape)}"
                )
        ids, count_ids = a["ids"], a["count_ids"]
        if n > 1 and not (np.diff(ids) > 0).all():
            raise ValueError(f"table {spec.name!r}: state ids are not unique and ascending")
        if len(count_ids) > 1 and not (np.diff(count_ids) > 0).all():
            raise ValueError(f"table {spec.name!r}: state count_ids are not unique and ascending")
        if len(count_ids) and ((a["counts"] < 1).any() or np.isin(count_ids, ids).any()):
            raise ValueError(f"table {spec.name!r}: state counts must be >= 1 and only for IDs without a row")
        if a["step"][0] < 0:
            raise ValueError(f"table {spec.name!r}: state step is negative")
        table.steps = int(a["step"][0])
        if n:
            slots = table._take_slots(n)
            table._values[:n] = torch.from_numpy(np.ascontiguousarray(a["values"]))
            table._state[:n] = torch.from_numpy(np.ascontiguousarray(a["optimizer_state"]))
            table._slot_ids[slots] = ids
            table._versions[slots] = a["versions"]
            table._times[slots] = a["times"]
            table._live[slots] = True
            table._index.insert(ids, slots)
        table._counts.insert(count_ids, a["counts"])
        return table

    def state_bytes(self) -> bytes:
        """The whole logical state (state()) as one deterministic byte string: equal exactly when the states are."""
        parts = []
        for key, arr in sorted(self.state().items()):
            arr = np.ascontiguousarray(arr)
            parts.append(f"{key}:{arr.dtype.str}:{arr.shape};".encode())
            parts.append(arr.tobytes())
        return b"".join(parts)
