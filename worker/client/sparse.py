"""SparseEmbedding: an embedding table held by the parameter server, of which a worker fetches only the rows its batch
touches.

    class Recommender(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = SparseEmbedding(dim=32)                          # unbounded int64 IDs
            self.item = SparseEmbedding(dim=32, num_embeddings=100_000)  # bounded IDs 0..N-1
            ...

    client.register(model)    # the dense tensors, and the tables (rows start empty on the shards)
    loss = loss_fn(model(user_ids, item_ids)); loss.backward()
    client.push_pull(model)   # dense gradients, and the summed gradient of each row the batch touched

A forward pass looks up the batch's unique IDs on the shards that hold them (paramserver.tables.shard_of), one
exchange per shard, and gathers them as `nn.Embedding` does (or pools bags of them as `nn.EmbeddingBag` does,
`mode="sum"|"mean"`); backward sums the gradients of an ID that occurs more than once. The next push sends each
touched row's gradient to its shard with the dense gradients, in the same exchange.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.tables import TableSpec
from worker.client.prepared import Prepared, UniqueCache, prepare

MODES = (None, "sum", "mean")
# Rows this narrow are gathered with index_select, whose backward (index_add_) measured 0.3-0.65x F.embedding's for
# 2,048 IDs at dim 1 and 16 (embedding's dense backward has a fixed cost of about 0.1 ms); wider, F.embedding is
# faster (0.75x index_select's at dim 64). Both give each row the sum of its IDs' gradients.
NARROW = 32
READY_KEPT = 4  # prefetched batches a table holds the rows of; more are dropped, oldest first (never read)
PREPARED_KEPT = 4  # prefetched batches a table keeps the unique IDs of


class _StepState:
    """A table's state between steps: where it reads rows, what it touched, what it prefetched.

    A push may take what a table sends on another thread than the one running the next forward pass
    (worker.train.overlap `seal`s it first), and hands the rows it fetched back from there: `ready` is the only part
    both threads write, under its lock."""

    def __init__(self, source: RowSource | None = None, uniques: UniqueCache | None = None) -> None:
        self.source = source
        self.uniques = uniques
        # (unique IDs, their rows as a leaf tensor, each shard's slice of the IDs where prefetch grouped them) of each
        # forward pass since the last push
        self.touched: list[tuple[np.ndarray, torch.Tensor, list[slice | None] | None]] = []
        self.planned: Prepared | None = None  # the IDs the next push_pull looks up (prefetch), until it takes them
        self.sealed: Outgoing | None = None  # what the next push sends, set aside by seal()
        # Rows pushes fetched, not yet used by a forward pass: id(unique IDs) -> (unique IDs, rows, the push count
        # they were fetched at). Up to READY_KEPT: an overlapped loop prefetches two batches ahead.
        self.ready: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        self.ready_lock = threading.Lock()
        # prefetch's IDs, oldest first: a forward pass on one of them needs no torch.unique
        self.prepared: list[Prepared] = []
        # Pushes taken so far; rows fetched by the exchange of push n are read only while pushes - n <= lag (0: before
        # the next push; 1 when sealed, as an overlapped loop reads rows an exchange older), never after more updates.
        self.pushes = 0
        self.lag = 0
        self.queued = False  # expect() was used: a push with nothing planned fetches the oldest expected batch

    def __deepcopy__(self, memo: dict[int, object]) -> _StepState:
        """A copied model's table reads rows where the original does, with nothing of its steps in flight."""
        return _StepState(self.source, self.uniques)

    def __reduce__(self) -> tuple[type[_StepState], tuple[()]]:
        """A pickled model's table comes back unregistered (its rows live on the shards; register it again)."""
        return (_StepState, ())


@dataclass
class Outgoing:
    """What a table sends with a push: its touched rows' summed gradients (None: none) and the IDs it prefetches."""

    gradients: tuple[np.ndarray, np.ndarray, list[slice | None] | None] | None
    planned: Prepared | None


class RowSource(Protocol):
    """Where a table reads its rows: its PSClient (see PSClient.register), or a saved model's file (worker.load)."""

    trains: bool  # whether its rows take gradients (pushed to the shards), or only serve lookups

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The current rows of these unique int64 IDs, float32 [len(ids), dim]."""


class SparseEmbedding(nn.Module):
    """An embedding table on the parameter server's shards: `dim`-wide rows keyed by int64 IDs.

    `num_embeddings`: None for unbounded IDs (any int64, e.g. hashes of user IDs: a row is made on the shards the
    first time an update touches it), or N for IDs 0..N-1 (others are refused). `mode`: None gathers one row per
    ID (`forward(ids)` -> [*ids.shape, dim], as nn.Embedding); "sum" or "mean" pools bags of IDs
    (`forward(ids, offsets)` with 1-D ids and the offsets where each bag starts -> [len(offsets), dim], as
    nn.EmbeddingBag).

    The table's policy on the shards (part of the model: two workers must agree on it):
    - `init` "normal" (default; standard deviation `init_scale`, 0 meaning 1/sqrt(dim)), "uniform" (on
      [-init_scale, init_scale)) or "zeros": a row's value before any update, the same for an ID on every
      shard and in every run for a given `seed` (paramserver.tables.initial_rows computes it anywhere).
    - `optimizer`: "sgd", "adagrad" (torch.optim.Adagrad on sparse gradients), "rowwise_adagrad" (one accumulator
      per row, as TorchRec's), "adam" (torch.optim.SparseAdam, lazy); "" (default) the job's counterpart. `lr`:
      0 (default) the job's learning rate.
    - `admit_after` k: a row is made only once its ID was in k updates; `admit_probability` p: with probability p
      in each update. Until then it reads as its initial value and its gradients are dropped.
    - `evict_after_versions`, `evict_after_seconds`: rows no update touched for that long are dropped (they read
      as initial again); `capacity`: rows per shard, the least recently updated dropped beyond it.

    As in nn.Embedding and nn.EmbeddingBag: `padding_idx` names an ID whose row gets no gradient (and which a bag
    leaves out); `include_last_offset` says the offsets end with the last bag's end; `forward(ids)` of a bag table
    takes 2-D ids as bags of equal length, and `per_sample_weights` weighs a "sum" bag's rows.

    `given`: the rows of IDs 0..N-1 that the first `client.register` sends the shards (a converted nn.Embedding's
    weights: worker.make_sparse); dropped once registered. None: the rows start as `init` says.

    The module holds no tensors of its own, and `state_dict()` never drops the table silently (worker.client.plain):
    a bounded table puts its rows there as `<path>.weight`, float32 [num_embeddings, dim] on the CPU, shaped as the
    nn.Embedding it stands for (gathered from its row source: the shards, a loaded file, serving copies), so that a
    `torch.save(model.state_dict())` or a Lightning checkpoint is whole and loads into the unconverted model. An
    unbounded table raises there once it holds rows, pointing to `PSClient.save` (the whole model, every table, in
    one file: `worker.load` reads it back); `in_state_dict = False` leaves a table out on purpose. `load_state_dict`
    takes a bounded table's weight as its given rows while the table is not registered yet; once registered, only
    the rows it already holds (others are refused: they live on the shards).
    """

    def __init__(
        self,
        dim: int,
        num_embeddings: int | None = None,
        *,
        mode: str | None = None,
        init: str = "normal",
        init_scale: float = 0.0,
        seed: int = 0,
        optimizer: str = "",
        lr: float = 0.0,
        admit_after: int = 0,
        admit_probability: float = 1.0,
        evict_after_versions: int = 0,
        evict_after_seconds: float = 0.0,
        capacity: int = 0,
        padding_idx: int | None = None,
        include_last_offset: bool = False,
        given: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be None, 'sum' or 'mean', not {mode!r}")
        if given is not None and (given.dim() != 2 or given.shape[1] != dim):
            raise ValueError(f"given rows must be [N, {dim}], not {list(given.shape)}")
        self.dim = dim
        self.num_embeddings = num_embeddings
        self.mode = mode
        self.padding_idx = padding_idx
        self.include_last_offset = include_last_offset
        self.given = given
        self.in_state_dict = True  # False: state_dict and load_state_dict leave the table out (PSClient.save has it)
        self._options = dict(
            dim=dim,
            num_embeddings=num_embeddings or 0,
            init=init,
            init_scale=init_scale,
            seed=seed,
            optimizer=optimizer,
            lr=lr,
            admit_after=admit_after,
            admit_probability=admit_probability,
            evict_after_versions=evict_after_versions,
            evict_after_seconds=evict_after_seconds,
            capacity=capacity,
        )
        self.spec("table")  # ValueError now, not at registration, for options out of range
        # What changes at every step lives in a plain object: nn.Module's __setattr__ costs microseconds a call, and
        # a step makes several per table.
        self._step = _StepState()

    def spec(self, name: str) -> TableSpec:
        """This table's spec under `name` (its path in the model, as PSClient.register names it)."""
        return TableSpec(name=name, **self._options)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        bound = f", num_embeddings={self.num_embeddings}" if self.num_embeddings else ""
        pooled = f", mode={self.mode!r}" if self.mode else ""
        padded = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"dim={self.dim}{bound}{pooled}{padded}"

    def _save_to_state_dict(self, destination: dict[str, object], prefix: str, keep_vars: bool) -> None:
        if self.in_state_dict and not _ROWS_LEFT_OUT.get():
            from worker.client.plain import table_weight

            weight = table_weight(self, prefix[:-1])
            if weight is not None:
                destination[prefix + "weight"] = weight

    def _load_from_state_dict(
        self,
        state_dict: dict[str, torch.Tensor],
        prefix: str,
        local_metadata: dict[str, object],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        from worker.client.plain import load_weight

        key = prefix + "weight"
        taken = self.in_state_dict and (key in state_dict or self.num_embeddings is not None)
        if taken and key in state_dict:
            problem = load_weight(self, prefix[:-1], state_dict[key])
            if problem is not None:
                error_msgs.append(problem)
        elif taken:
            missing_keys.append(key)
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and not (taken and k == key))

    def attach(self, source: RowSource | None, uniques: UniqueCache | None = None) -> None:
        """Read rows from `source` from now on (PSClient.register calls this; `uniques`: shared by the model's
        tables); None detaches."""
        self._step = _StepState(source, uniques)

    def prefetch(self, ids: torch.Tensor) -> None:
        """Say which IDs a coming forward pass will look up: the next `client.push_pull(model)` then fetches their
        rows in the same exchange, after its update applied (the rows of the version it pulls), and a forward pass
        on those IDs uses them instead of asking the shards again: one round trip per step instead of two. A
        forward pass with other IDs looks them up as usual. A loop that overlaps its exchanges (worker.train.overlap)
        prefetches two batches ahead: the exchange in flight fetches the rows of the batch after next."""
        st = self._step
        # A copy of the IDs is kept with them: the caller may reuse its tensor before the forward pass.
        prepared = st.uniques.of(ids) if st.uniques is not None else prepare(ids, None)
        st.prepared.append(prepared)
        del st.prepared[:-PREPARED_KEPT]
        st.planned = prepared

    def expect(self, ids: torch.Tensor, *, queue: bool = True) -> Prepared:
        """Say that a coming forward pass will look these IDs up, after those expected before it (worker.prefetching
        calls this as it reads batches ahead): each push fetches the rows of the oldest expected batch no forward pass
        has used yet, so a loop that reads its batches further ahead (Lightning reads one) still gets the right ones.
        `queue=False`: only prepare them for that forward pass (rows fetched otherwise: worker.prefetch's grouped
        lookup). Returns them prepared."""
        st = self._step
        prepared = st.uniques.of(ids) if st.uniques is not None else prepare(ids, None)
        if queue:
            st.prepared.append(prepared)
            del st.prepared[:-PREPARED_KEPT]
            st.queued = True
        else:  # the forward pass about to run: in place of its batch's expected IDs, before any expected after it
            st.prepared = [p for p in st.prepared if not _same(p.given, ids)]
            st.prepared.insert(0, prepared)
        return prepared

    @property
    def source(self) -> RowSource | None:
        """Where this table reads its rows (None: not registered)."""
        return self._step.source

    def seal(self) -> None:
        """Set aside what the next push sends (the touched rows' gradients, the prefetched IDs), so that a push on
        another thread takes exactly these while this thread runs the next forward pass (worker.train.overlap)."""
        st = self._step
        gradients = self._summed(st.touched)
        st.touched = []
        planned, st.planned = self._planned(), None
        st.pushes += 1
        st.lag = 1
        before = st.sealed
        if before is not None:  # a push that never took the last ones (it failed first): send both
            both = [g for g in (before.gradients, gradients) if g is not None]
            gradients = self._merged(both) if len(both) == 2 else (both[0] if both else None)
            planned = planned or before.planned
        st.sealed = Outgoing(gradients, planned)

    def take_push(self) -> Outgoing:
        """What the next push sends, once: what `seal` set aside, else what the forward passes since the last push
        left (PSClient's push and push_pull take it)."""
        st = self._step
        sealed, st.sealed = st.sealed, None
        if sealed is not None:
            return sealed
        touched, st.touched = st.touched, []
        planned, st.planned = self._planned(), None
        st.pushes += 1
        return Outgoing(self._summed(touched), planned)

    def _planned(self) -> Prepared | None:
        """The IDs the next exchange fetches: those prefetch named, else the oldest expected batch's."""
        st = self._step
        if st.planned is None and st.queued and st.prepared:
            return st.prepared[0]
        return st.planned

    @property
    def pushes(self) -> int:
        """How many pushes have taken this table's rows (fetched rows are tagged with it: see `fetched`)."""
        return self._step.pushes

    def has_ready_rows(self) -> bool:
        """Whether fetched rows wait for a forward pass, still of the current version."""
        st = self._step
        return any(st.pushes - tag <= st.lag for _, _, tag in list(st.ready.values()))

    def fetched(self, ids: np.ndarray, rows: np.ndarray, pushes: int | None = None) -> None:
        """Hold prefetched rows for the forward pass on these IDs (PSClient's push_pull gives them, on whichever
        thread ran the exchange). `pushes`: the push count when the exchange took its push (default: now); once
        another push has gone (two when sealed), they are of an older version and no forward pass reads them."""
        st = self._step
        with st.ready_lock:
            st.ready[id(ids)] = (ids, rows, st.pushes if pushes is None else pushes)
            while len(st.ready) > READY_KEPT:
                del st.ready[next(iter(st.ready))]

    def _ready_rows(self, wanted: np.ndarray) -> np.ndarray | None:
        """The prefetched rows of exactly these unique IDs, once (None: none were fetched)."""
        st = self._step
        if not st.ready:
            return None
        with st.ready_lock:
            for key in [k for k, (_, _, tag) in st.ready.items() if st.pushes - tag > st.lag]:
                del st.ready[key]  # of an older version: an update went since
            hit = st.ready.pop(id(wanted), None)
            if hit is not None and hit[0] is wanted:
                return hit[1]
            for key, (ids, rows, _) in st.ready.items():
                if np.array_equal(ids, wanted):
                    del st.ready[key]
                    return rows
        return None

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        st = self._step
        if st.source is None:
            raise RuntimeError(
                "this SparseEmbedding is not registered with a PSClient: call client.register(model) first (its "
                "rows live on the parameter server)"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(
                f"embedding IDs are integers, not {ids.dtype}: a float tensor rounds IDs (float32 from 2^24 on), so "
                "two IDs could read one row; keep the IDs in an integer tensor (as nn.Embedding takes them)"
            )
        recorder = CAPTURING.get()
        if recorder is not None:  # a capture pass (worker.prefetch): the IDs noted, no rows read
            return recorder.record(self, ids, offsets)
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise ValueError("mode None takes ids alone; mode 'sum' or 'mean' pools bags (offsets, or 2-D ids)")
        if self.mode is not None and (ids.dim() != 2 if offsets is None else ids.dim() != 1):
            raise ValueError(
                f"mode {self.mode!r} takes 1-D ids and the offsets where each bag starts, or 2-D ids (a bag a row), "
                f"not {ids.dim()}-D ids {'with' if offsets is not None else 'without'} offsets"
            )
        wanted, inverse, parts = self._unique(ids)
        fetched = self._ready_rows(wanted)
        rows = torch.from_numpy(fetched if fetched is not None else st.source.lookup(wanted))
        if rows.shape != (len(wanted), self.dim):
            raise RuntimeError(
                f"the shards sent rows of shape {tuple(rows.shape)} for {len(wanted)} IDs of dim {self.dim}"
            )
        rows = rows.to(ids.device)
        if torch.is_grad_enabled() and st.source.trains:
            rows.requires_grad_(True)
            st.touched.append((wanted, rows, parts))
        pad = None
        if self.padding_idx is not None:
            at = np.flatnonzero(wanted == self.padding_idx)
            pad = int(at[0]) if len(at) else None
        if self.mode is None:
            if self.dim <= NARROW and pad is None:
                return rows.index_select(0, inverse.reshape(-1)).reshape(*ids.shape, self.dim)
            return F.embedding(inverse.reshape(ids.shape), rows, padding_idx=pad)
        return F.embedding_bag(
            inverse.reshape(ids.shape),
            rows,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=pad,
        )

    def _unique(self, ids: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, list[slice | None] | None]:
        """The unique IDs (int64, on the CPU), each ID's position among them, and each shard's slice of them: those
        prefetch computed when these are IDs it was given (the usual loop), else computed now (no slices)."""
        st = self._step
        for k, prepared in enumerate(st.prepared):
            if _same(prepared.given, ids):
                del st.prepared[: k + 1]  # this one, and any older ones the loop skipped
                return prepared.ids, prepared.inverse.to(ids.device), prepared.parts
        unique_t, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        return unique_t.to("cpu", torch.int64).numpy(), inverse, None

    def _summed(
        self, touched: list[tuple[np.ndarray, torch.Tensor, list[slice | None] | None]]
    ) -> tuple[np.ndarray, np.ndarray, list[slice | None] | None] | None:
        """The unique IDs of these forward passes' rows, each row's summed gradient (float32 [n, dim], on the CPU)
        and each shard's slice of the IDs where known; None if no row has a gradient."""
        parts = [(ids, rows.grad, split) for ids, rows, split in touched if rows.grad is not None]
        if not parts:
            return None
        if len(parts) == 1:
            ids, grad, split = parts[0]
            return ids, grad.detach().to("cpu", torch.float32).contiguous().numpy(), split
        return self._merged([(ids, grad.detach().to("cpu", torch.float32), None) for ids, grad, _ in parts])

    def _merged(
        self, parts: Sequence[tuple[np.ndarray, np.ndarray | torch.Tensor, list[slice | None] | None]]
    ) -> tuple[np.ndarray, np.ndarray, None]:
        """Several forward passes before one push (gradient accumulation): one row per ID, their gradients summed."""
        all_ids = np.concatenate([p[0] for p in parts])
        unique, inverse = np.unique(all_ids, return_inverse=True)
        summed = torch.zeros((len(unique), self.dim), dtype=torch.float32)
        grads = torch.cat([torch.as_tensor(g) for _, g, _ in parts])
        summed.index_add_(0, torch.from_numpy(inverse.reshape(-1).astype(np.int64)), grads)
        return unique, summed.numpy(), None


def _same(given: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether two ID tensors are the same IDs (shape, device, dtype and values)."""
    return (
        given.shape == ids.shape and given.device == ids.device and given.dtype == ids.dtype and torch.equal(given, ids)
    )


class Recorder(Protocol):
    """What a capture pass (worker.prefetch.capture) sets: each table's forward hands it its IDs instead of reading
    rows, and returns what it returns (zeros of the output's shape)."""

    def record(self, table: SparseEmbedding, ids: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor: ...


CAPTURING: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("capturing", default=None)
_ROWS_LEFT_OUT: contextvars.ContextVar[bool] = contextvars.ContextVar("rows_left_out", default=False)


@contextlib.contextmanager
def without_rows() -> Iterator[None]:
    """Within it, a model's `state_dict()` holds its dense tensors and buffers alone, none of its tables (PSClient.save
    and worker.load, which move the tables themselves; ServingClient.pull)."""
    token = _ROWS_LEFT_OUT.set(True)
    try:
        yield
    finally:
        _ROWS_LEFT_OUT.reset(token)


def tables_of(module: nn.Module) -> list[tuple[str, SparseEmbedding]]:
    """A module's sparse tables, named by their path in it, in named_modules() order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, SparseEmbedding)]


def touched_rows(module: nn.Module) -> list[torch.Tensor]:
    """The rows a module's tables gathered since the last push, as the leaf tensors backward fills: their gradients
    are the model's too, for clipping and loss scaling (worker.train.gradients)."""
    return [rows for _, table in tables_of(module) for _, rows, _ in table._step.touched]


def forget_touched(module: nn.Module) -> None:
    """Drop what a module's tables gathered since the last push (a step computed again starts afresh)."""
    for _, table in tables_of(module):
        table._step.touched = []
