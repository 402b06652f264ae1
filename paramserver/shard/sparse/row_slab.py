"""Where a row group's rows live (paramserver.shard.sparse.row_store.RowGroup stands on it): values in one float32 slab
[capacity, dim], optimizer state in another [capacity, state_cols] (one slab of both measured slower: lookups gather
from a strided view), an index from (tag, ID) to slot, and per slot the ID, the tag, the version and time of its last
update and whether it is live. Slots are handed out from a free-slot stack (evicted rows' slots) first, then above
the high-water mark; the slab grows by 1.25x, never shrinks. What a row is worth (admission, eviction, the
optimizer, the tables' figures) is the group's; this class only keeps the rows where they are."""

from __future__ import annotations

import math

import numpy as np
import torch

from paramserver.shard.sparse.id_hash import DirectIndex, IdHash

_MIN_SLOTS = 16
_SLOT_GROWTH = 1.25  # not 2: the slab is most of a group's memory, and a doubling would leave half of it idle
_INT32_MAX = np.iinfo(np.int32).max


class RowSlab:
    """The slots of one row group: values, optimizer state, index and per-slot arrays. No lock: the group's caller
    serialises calls."""

    def __init__(
        self, dim: int, state_cols: int, index: IdHash | DirectIndex, tagged: bool, updates: bool = True
    ) -> None:
        self.dim = dim
        # Whether each slot keeps the version and time of its last update (eviction by age, written_since, state):
        # a serving copy's values-only slab does not (16 bytes a row).
        self.updates = updates
        self.state_cols = state_cols
        self.tagged = tagged
        self._index = index
        self._capacity = 0
        self._high = 0  # slots below this were handed out at least once; above, never
        self._values = torch.empty((0, dim), dtype=torch.float32)
        self._state = torch.empty((0, state_cols), dtype=torch.float32)
        self._slot_ids = np.empty(0, dtype=np.int64)
        self._slot_tags = np.empty(0, dtype=np.int32)
        self._versions = np.empty(0, dtype=np.int64)
        self._times = np.empty(0, dtype=np.float64)
        self._live = np.empty(0, dtype=bool)
        self._free = np.empty(0, dtype=np.int64)  # a stack of released slots, top at _nfree
        self._nfree = 0

    @property
    def rows(self) -> int:
        """Rows held, of every table of the group."""
        return self._index.live

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's value and optimizer state."""
        return 4 * (self.dim + self.state_cols)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the slots: both slabs, the index, the per-slot arrays and the free stack."""
        arrays: list[np.ndarray] = [self._slot_ids, self._slot_tags, self._versions, self._times, self._live]
        arrays.append(self._free)
        slabs = self._values.untyped_storage().nbytes() + self._state.untyped_storage().nbytes()
        return int(slabs + self._index.nbytes + sum(a.nbytes for a in arrays))

    def _gather(self, slots: np.ndarray) -> np.ndarray:
        return self._values.index_select(0, torch.from_numpy(slots)).numpy()

    def _held_of(self, tag: int) -> np.ndarray:
        """The live slots of table `tag`."""
        live = self._live[: self._high]
        if self.tagged:
            live = live & (self._slot_tags[: self._high] == tag)
        return np.flatnonzero(live)

    def written_since(self, version: int, tag: int = 0) -> np.ndarray:
        """The IDs of table `tag`'s rows last updated after `version`, ascending (a scan of every slot)."""
        high = self._high
        hit = self._live[:high] & (self._versions[:high] > version)
        if self.tagged:
            hit &= self._slot_tags[:high] == tag
        return np.sort(self._slot_ids[:high][hit])

    def page(self, tag: int, start: int, slots: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Table `tag`'s rows held in slots [start, start + slots): their IDs and values (copies), and the slot the
        next page starts at (`end_slot` once there is none)."""
        high = self._high
        stop = min(high, start + slots)
        held = np.flatnonzero(self._live[start:stop]) + start
        if self.tagged and len(held):
            held = held[self._slot_tags[held] == tag]
        return self._slot_ids[held], self._gather(held), stop

    def put(self, ids: np.ndarray, values: np.ndarray, tags: np.ndarray | None = None) -> None:
        """Hold these unique IDs' rows with these values (a serving copy's: no optimizer step), overwriting the
        rows held and placing the new ones."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        slots = self._index.get(ids, tags)
        new = np.flatnonzero(slots < 0)
        if len(new):
            fresh = self._take_slots(len(new))
            self._claim(fresh, ids[new], None if tags is None else tags[new])
            slots[new] = fresh
        values = np.ascontiguousarray(values, dtype=np.float32)
        rows = torch.from_numpy(values if values.flags.writeable else values.copy())
        self._values.index_copy_(0, torch.from_numpy(slots.astype(np.int64, copy=False)), rows)

    @property
    def end_slot(self) -> int:
        """The slot above every slot ever handed out (where `page` ends)."""
        return self._high

    def _take_slots(self, n: int) -> np.ndarray:
        """n slots for new rows: released ones first, then fresh ones (growing the slab as needed)."""
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

    def _claim(self, slots: np.ndarray, ids: np.ndarray, tags: np.ndarray | None) -> None:
        """These slots (their values written) now hold these new rows, with zero optimizer state."""
        if self.state_cols:
            self._state.index_fill_(0, torch.from_numpy(slots), 0.0)
        self._slot_ids[slots] = ids
        self._slot_tags[slots] = 0 if tags is None else tags
        self._live[slots] = True
        self._index.insert(ids, slots, tags)

    def _release(self, slots: np.ndarray, tags: np.ndarray | None) -> None:
        """Take the rows in these (live, distinct) slots out of the index and put the slots on the free stack."""
        self._index.remove_cells(self._index.find(self._slot_ids[slots], tags))
        self._live[slots] = False
        if self._nfree + len(slots) > len(self._free):
            free = np.empty(max(self._nfree + len(slots), 2 * len(self._free)), dtype=np.int64)
            free[: self._nfree] = self._free[: self._nfree]
            self._free = free
        self._free[self._nfree : self._nfree + len(slots)] = slots
        self._nfree += len(slots)

    def _rows_of(self, tag: int) -> dict[str, np.ndarray]:
        """Table `tag`'s rows in ascending ID order: ids, values, optimizer_state, versions, times."""
        held = self._held_of(tag)
        slots = held[np.argsort(self._slot_ids[held], kind="stable")]
        s = torch.from_numpy(slots)
        return {
            "ids": self._slot_ids[slots],
            "values": self._values.index_select(0, s).numpy(),
            "optimizer_state": self._state.index_select(0, s).numpy(),
            "versions": self._versions[slots],
            "times": self._times[slots],
        }

    def _put_rows(self, tag: int, a: dict[str, np.ndarray]) -> int:
        """Place checked rows (the arrays `_rows_of` gives) of table `tag`, none of whose IDs it holds; how many."""
        n = len(a["ids"])
        if n:
            slots = self._take_slots(n)
            s = torch.from_numpy(slots)
            self._values.index_copy_(0, s, torch.from_numpy(np.ascontiguousarray(a["values"])))
            self._state.index_copy_(0, s, torch.from_numpy(np.ascontiguousarray(a["optimizer_state"])))
            self._slot_ids[slots] = a["ids"]
            self._slot_tags[slots] = tag
            self._versions[slots] = a["versions"]
            self._times[slots] = a["times"]
            self._live[slots] = True
            self._index.insert(a["ids"], slots, np.full(n, tag, dtype=np.int32) if self.tagged else None)
        return n

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
        self._slot_tags = grown(self._slot_tags, 0)
        if self.updates:
            self._versions = grown(self._versions, 0)
            self._times = grown(self._times, 0.0)
        self._live = grown(self._live, False)
        self._capacity = capacity
        if capacity > _INT32_MAX and self._index.value_dtype != np.int64:
            self._index.widen()
