"""IdHash: open addressing from int64 IDs (or (table tag, ID) pairs) to non-negative ints, whole batches at a time.

A shard's row groups (paramserver.shard.sparse.row_store) find a row's slot, and an ID's admission count, here. Linear
probing runs over the whole batch at once: each round looks at a window of cells for every key still unresolved,
so most keys resolve in the first round and the loop is over rounds, not keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paramserver.tables import mix64

EMPTY = -1  # a cell that never held a key since the last rebuild: a probe for a key stops here
DELETED = -2  # a tombstone: a removed key's cell, which a probe passes over and an insert may reuse
_MIN_CELLS = 16
_WINDOW = 16  # cells a round of probing looks at per key, after the first round's one
_OFFSETS = np.arange(_WINDOW, dtype=np.int64)[:, None]
_INDEX_CHUNK = 1 << 20  # keys per pass through the index, to bound the temporaries of a huge batch
# A tag's multiple, xored into the ID before hashing: the same ID of two tables starts at unrelated cells.
_TAG_SALT = np.uint64(0xD6E8FEB86659FD93)


class IdHash:
    """An open-addressing map from int64 keys, or (tag, key) pairs when `tagged`, to non-negative ints.

    Every int64 is a valid key: emptiness lives in the value array (EMPTY, DELETED), not in a reserved key. The
    capacity is a power of two and live keys plus tombstones stay at most half of it, so an unsuccessful probe is
    short and always ends at an EMPTY cell. A key's first cell is the top bits of mix64(key xor tag * salt): a
    shard's IDs share mix64(ID) mod num_shards, which is in the low bits. A tagged map takes a `tags` array (int32,
    one per key) with every call; an untagged one takes None.
    """

    def __init__(self, value_dtype: type[np.signedinteger], tagged: bool = False, cells: int = _MIN_CELLS) -> None:
        self.value_dtype = np.dtype(value_dtype)
        self.tagged = tagged
        self.live = 0
        self.dead = 0
        self._allocate(cells)

    def _allocate(self, cells: int) -> None:
        self.keys = np.zeros(cells, dtype=np.int64)
        self.tags = np.zeros(cells if self.tagged else 0, dtype=np.int32)
        self.vals = np.full(cells, EMPTY, dtype=self.value_dtype)
        self.mask = cells - 1
        self.shift = np.uint64(64 - (cells.bit_length() - 1))
        self.dead = 0

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.tags.nbytes + self.vals.nbytes)

    def widen(self) -> None:
        """Hold values beyond int32 (a group of more than 2^31 slots)."""
        self.vals = self.vals.astype(np.int64)
        self.value_dtype = np.dtype(np.int64)

    def _start(self, ids: np.ndarray, tags: np.ndarray | None) -> np.ndarray:
        u = ids.view(np.uint64)
        if tags is not None:
            u = u ^ (tags.astype(np.uint64) * _TAG_SALT)
        return (mix64(u) >> self.shift).astype(np.int64)

    def _check_tags(self, ids: np.ndarray, tags: np.ndarray | None) -> np.ndarray | None:
        if self.tagged != (tags is not None):
            raise ValueError("a tagged IdHash takes a tag per key, an untagged one none")
        if tags is not None and len(tags) != len(ids):
            raise ValueError(f"{len(tags)} tags for {len(ids)} keys")
        return tags

    def find(self, ids: np.ndarray, tags: np.ndarray | None = None) -> np.ndarray:
        """The cell holding each key, -1 where it is absent (int64, one per key; duplicates allowed)."""
        return self._probe(ids, self._check_tags(ids, tags), values=False)

    def get(self, ids: np.ndarray, tags: np.ndarray | None = None) -> np.ndarray:
        """Each key's value, -1 where it is absent (int64)."""
        return self._probe(ids, self._check_tags(ids, tags), values=True)

    def _probe(self, ids: np.ndarray, tags: np.ndarray | None, values: bool) -> np.ndarray:
        out = np.full(len(ids), -1, dtype=np.int64)
        if self.live == 0:
            return out
        for begin in range(0, len(ids), _INDEX_CHUNK):
            part = slice(begin, begin + _INDEX_CHUNK)
            out[part] = self._find(ids[part], None if tags is None else tags[part], values)
        return out

    def _find(self, ids: np.ndarray, tags: np.ndarray | None, values: bool) -> np.ndarray:
        keys, vals, mask = self.keys, self.vals, self.mask
        # Round one looks at each key's home cell only, on flat arrays: at load <= 1/2 it settles about 80% of
        # them, at the fewest operations per key.
        pos = self._start(ids, tags)
        v = vals.take(pos)
        hit = keys.take(pos) == ids
        if tags is not None:
            hit &= self.tags.take(pos) == tags
        hit &= v >= 0
        out = np.where(hit, v if values else pos, -1).astype(np.int64, copy=False)
        go_on = v != EMPTY
        go_on &= ~hit
        todo = np.flatnonzero(go_on)
        pos, want = pos[todo] + 1, ids[todo]
        want_tags = None if tags is None else tags[todo]
        # Then windows of _WINDOW cells per key, laid out [window, keys] so every operation runs along contiguous
        # memory; one window nearly always reaches the key or an EMPTY cell.
        while len(todo):
            cells = (pos + _OFFSETS) & mask
            v = vals.take(cells)
            hit = keys.take(cells) == want
            if want_tags is not None:
                hit &= self.tags.take(cells) == want_tags
            hit &= v >= 0
            stop = v == EMPTY
            stop |= hit
            first = stop.argmax(axis=0)
            cols = np.arange(len(todo))
            found = hit[first, cols]
            out[todo[found]] = (v if values else cells)[first[found], cols[found]]
            go_on = ~stop[first, cols]
            todo, pos, want = todo[go_on], pos[go_on] + _WINDOW, want[go_on]
            if want_tags is not None:
                want_tags = want_tags[go_on]
        return out

    def remove_cells(self, cells: np.ndarray) -> None:
        """Remove the keys in these (live, distinct) cells: they become tombstones until the next rebuild."""
        self.vals[cells] = DELETED
        self.live -= len(cells)
        self.dead += len(cells)

    def insert(self, ids: np.ndarray, values: np.ndarray, tags: np.ndarray | None = None) -> None:
        """Add keys that are absent and distinct (the caller knows), with their values (>= 0)."""
        tags = self._check_tags(ids, tags)
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
            part = slice(begin, begin + _INDEX_CHUNK)
            self._insert(ids[part], values[part], None if tags is None else tags[part])
        self.live += n

    def _insert(self, ids: np.ndarray, values: np.ndarray, tags: np.ndarray | None) -> None:
        todo = np.arange(len(ids))
        pos = self._start(ids, tags)
        # Round one tries each key's home cell, as _find does; then windows from the next cell on.
        home = self.vals.take(pos) < 0
        taken = self._claim(ids, tags, values, todo[home], pos[home])
        left = np.ones(len(ids), dtype=bool)
        left[taken] = False
        todo = np.flatnonzero(left)
        pos = pos[todo] + 1
        while len(todo):
            cells = (pos + _OFFSETS) & self.mask
            free = self.vals.take(cells) < 0
            has = free.any(axis=0)
            target = cells[free.argmax(axis=0), np.arange(len(todo))]
            taken = self._claim(ids, tags, values, todo[has], target[has])
            left = np.ones(len(todo), dtype=bool)
            left[np.searchsorted(todo, taken)] = False
            # A key that lost its free cell to another probes on from that (now taken) cell.
            pos = np.where(has, target, pos + _WINDOW)
            todo, pos = todo[left], pos[left]

    def _claim(
        self, ids: np.ndarray, tags: np.ndarray | None, values: np.ndarray, claimers: np.ndarray, cells: np.ndarray
    ) -> np.ndarray:
        """Put keys ids[claimers] into these free cells; which claimers got theirs (ascending, as claimers is).

        Two keys may reach one free cell in the same round: each array keeps one of the writes to a cell, so the
        key is written first, and the tag only by the claimers whose key stayed (pairs are distinct: of those, one
        tag stays); the others probe on."""
        keys, vals = self.keys, self.vals
        want = ids[claimers]
        keys[cells] = want
        won = keys.take(cells) == want
        if tags is not None:
            want_tags = tags[claimers]
            self.tags[cells[won]] = want_tags[won]
            won &= self.tags.take(cells) == want_tags
        winners = cells[won]
        self.dead -= int(np.count_nonzero(vals.take(winners) == DELETED))
        vals[winners] = values[claimers[won]]
        return claimers[won]

    def _rebuild(self, cells: int) -> None:
        live = np.flatnonzero(self.vals >= 0)
        keys, vals = self.keys[live], self.vals[live]
        tags = self.tags[live] if self.tagged else None
        self._allocate(cells)
        for begin in range(0, len(keys), _INDEX_CHUNK):
            part = slice(begin, begin + _INDEX_CHUNK)
            self._insert(keys[part], vals[part], None if tags is None else tags[part])

    def items(self, tag: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every live key (of `tag`, in a tagged map) and its value, in ascending key order."""
        live = self.vals >= 0
        if self.tagged:
            live &= self.tags == (tag or 0)
        where = np.flatnonzero(live)
        keys = self.keys[where]
        order = np.argsort(keys, kind="stable")
        return keys[order], self.vals[where][order].astype(np.int64)


class DirectIndex:
    """IdHash's interface over bounded tables, as one array: (tag, ID) -> slot at [offset of the tag + ID].

    For a group whose tables are all bounded and small enough that an int32 per possible ID costs little beside
    their rows (ShardTables decides): a lookup is one `take`, against IdHash's hashing and probing. A cell is the
    position in that array. An ID outside its table's range is absent (the shard refuses such IDs before any
    update; a read of one answers its initial row)."""

    def __init__(self, sizes: Sequence[int], value_dtype: type[np.signedinteger] = np.int32) -> None:
        self.tagged = len(sizes) > 1
        self.sizes = np.array(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.vals = np.full(int(self.sizes.sum()), EMPTY, dtype=value_dtype)
        self.value_dtype = np.dtype(value_dtype)
        self.live = 0

    @property
    def nbytes(self) -> int:
        return int(self.vals.nbytes)

    def widen(self) -> None:
        """Hold values beyond int32."""
        self.vals = self.vals.astype(np.int64)
        self.value_dtype = np.dtype(np.int64)

    def _cells(self, ids: np.ndarray, tags: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Each key's cell (0 where out of range) and whether it is in range."""
        sizes = self.sizes[tags] if tags is not None else self.sizes[0]
        inside = (ids >= 0) & (ids < sizes)
        cells = ids + self.offsets[tags] if tags is not None else ids.copy()
        cells[~inside] = 0
        return cells, inside

    def find(self, ids: np.ndarray, tags: np.ndarray | None = None) -> np.ndarray:
        """The cell holding each key, -1 where it is absent (int64)."""
        cells, inside = self._cells(ids, tags)
        return np.where(inside & (self.vals.take(cells) >= 0), cells, -1)

    def get(self, ids: np.ndarray, tags: np.ndarray | None = None) -> np.ndarray:
        """Each key's value, -1 where it is absent (int64)."""
        cells, inside = self._cells(ids, tags)
        out = self.vals.take(cells).astype(np.int64)
        out[~inside] = -1
        return out

    def remove_cells(self, cells: np.ndarray) -> None:
        """Remove the keys in these (live, distinct) cells."""
        self.vals[cells] = EMPTY
        self.live -= len(cells)

    def insert(self, ids: np.ndarray, values: np.ndarray, tags: np.ndarray | None = None) -> None:
        """Add keys that are absent, distinct and in range (the caller knows), with their values (>= 0)."""
        cells, inside = self._cells(ids, tags)
        if not inside.all():
            raise ValueError("an ID outside its table's range has no cell")
        self.vals[cells] = values
        self.live += len(ids)

    def items(self, tag: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every live key (of `tag`) and its value, in ascending key order."""
        t = tag or 0
        part = self.vals[self.offsets[t] : self.offsets[t] + self.sizes[t]]
        keys = np.flatnonzero(part >= 0).astype(np.int64)
        return keys, part[keys].astype(np.int64)
