"""How one model's tensors map onto the shards' pieces: views into the model's own memory, per shard.

A model's tensors are its parameters, then its buffers (the persistent ones, those its state_dict holds: BatchNorm's
running statistics...). A parameter pushes its gradient; a buffer pushes its current value, and pulls the value the
shards hold. Buffers always travel through a float32 host mirror: an integer buffer (num_batches_tracked) is cast
on the way out and rounded back on the way in (exact up to 2^24), and the exchange never writes into a buffer the
model may be using until it has completed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from paramserver.placement import Placement
from worker.client.sparse import SparseEmbedding, UniqueCache


class TensorDict(dict[str, torch.Tensor]):
    """A mapping of name -> tensor that names which of its entries are buffers (sent as their values, not as
    gradients), and the model's sparse tables (named by their path in it) whose rows travel with its exchanges: a
    module's tensors as a mapping, e.g. for worker.train.overlap. A plain mapping holds parameters only."""

    def __init__(
        self,
        items: Iterable[tuple[str, torch.Tensor]] = (),
        buffers: Iterable[str] = (),
        tables: Iterable[tuple[str, SparseEmbedding]] = (),
    ) -> None:
        super().__init__(items)
        self.buffers = frozenset(buffers)
        self.tables = list(tables)


Tensors = torch.nn.Module | Mapping[str, torch.Tensor]


@dataclass
class Binding:
    """How one model's tensors map onto the shards' pieces (computed once per model object)."""

    names: list[str]
    tensors: list[torch.Tensor]
    placement: Placement
    host: list[torch.Tensor | None]  # a CPU float32 mirror for buffers and tensors that are not CPU-contiguous
    largest_part: int = 0  # elements of the largest shard's part
    tables: list[SparseEmbedding] = field(default_factory=list)  # the model's sparse tables, placement.tables' order
    uniques: UniqueCache = field(init=False)  # the tables' prefetched IDs, computed once, split by shard

    def __post_init__(self) -> None:
        self.uniques = UniqueCache(self.placement.num_shards)
        self.buffer = [s.buffer for s in self.placement.specs]
        # Elements of each shard's part, summed once here rather than at every exchange.
        self.elements = [self.placement.shard_elements(k) for k in range(self.placement.num_shards)]
        self.largest_part = max(self.elements)
        self._index = {n: i for i, n in enumerate(self.names)}
        self._copying: torch.cuda.Event | None = None  # the last host-to-device copy out of the mirrors

    def settle(self) -> None:
        """Wait until the mirrors are no longer read by a copy to the GPU (before anything writes them)."""
        if self._copying is not None:
            self._copying.synchronize()
            self._copying = None

    @property
    def digest(self) -> str:
        return self.placement.digest

    def flat(self, i: int) -> np.ndarray:
        """A float32 numpy view of tensor i, via its host mirror if it has one."""
        mirror = self.host[i]
        if mirror is None:
            return self.tensors[i].detach().view(-1).numpy()
        return mirror.numpy()

    def flats(self) -> list[np.ndarray]:
        """`flat` of every tensor (to write into: the mirrors are settled first)."""
        self.settle()
        return [self.flat(i) for i in range(len(self.tensors))]

    def views(self, shard: int, flats: Sequence[np.ndarray]) -> list[np.ndarray]:
        """One view per piece of `shard`, into the flat arrays of the tensors."""
        return [flats[self._index[p.name]][p.start : p.start + p.length] for p in self.placement.shards[shard]]

    def labels(self, shard: int) -> list[str]:
        """Names of `shard`'s pieces for error messages: tensor[start:end]."""
        return [f"{p.name}[{p.start}:{p.start + p.length}]" for p in self.placement.shards[shard]]

    def regions(self, shard: int, region: np.ndarray) -> list[np.ndarray]:
        """One view per piece of `shard`, into a segment region (the pieces back to back, as the shard stores)."""
        out, at = [], 0
        for p in self.placement.shards[shard]:
            out.append(region[at : at + p.length])
            at += p.length
        return out

    def weights_now(self) -> list[np.ndarray]:
        """Flat float32 host arrays of the model's current weights, to read (an Init): the tensor's own memory
        where it is a contiguous CPU float32 tensor, else a copy of its own. Never the host mirrors: a shard
        re-initialised during an exchange must not overwrite the gradient another shard's part is being sent
        from."""
        out = []
        for i, t in enumerate(self.tensors):
            if self.host[i] is None:
                out.append(t.detach().view(-1).numpy())
            else:
                out.append(t.detach().reshape(-1).to("cpu", torch.float32).numpy())
        return out

    def unmirror_weights(self) -> None:
        """Copy pulled weights from the host mirrors into the model's tensors (CUDA, non-contiguous). A copy to the
        GPU runs on while the worker goes on (the mirror is pinned); the next write to a mirror waits for it."""
        to_gpu = False
        with torch.no_grad():
            for t, mirror in zip(self.tensors, self.host, strict=True):
                if mirror is not None:
                    pulled = mirror.view(t.shape)
                    if not t.is_floating_point():
                        pulled = pulled.round()  # an integer buffer: the mean of counts need not be whole
                    t.copy_(pulled.to(t.device, non_blocking=True))
                    to_gpu = to_gpu or t.device.type == "cuda"
        if to_gpu:
            self._copying = torch.cuda.Event()
            self._copying.record()

    def gradients(self, of_module: bool) -> list[np.ndarray]:
        """Flat float32 host views of each parameter's gradient (the tensors themselves for a mapping) and each
        buffer's value, through the host mirror where that is not a contiguous CPU float32 tensor (a buffer's
        always: a copy of its value now)."""
        self.settle()
        return [self.gradient(i, of_module) for i in range(len(self.tensors))]

    def gradient(self, i: int, of_module: bool) -> np.ndarray:
        """`gradients` of tensor i alone (the mirrors settled first: see `settle`)."""
        t = self.tensors[i]
        g = t.grad if of_module and not self.buffer[i] else t
        if g is None:
            g = torch.zeros_like(t)
        mirror = self.host[i]
        if mirror is not None or not g.is_contiguous() or g.device.type != "cpu":
            if mirror is None:
                mirror = self.host[i] = torch.empty(t.numel(), dtype=torch.float32)
            mirror.copy_(g.detach().reshape(-1))
            return mirror.numpy()
        return g.detach().view(-1).numpy()

    def index(self, name: str) -> int:
        """The position of the tensor called `name` in `names`."""
        return self._index[name]


def buffers_of(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's persistent buffers (those its state_dict holds), named and in named_buffers() order."""
    # Non-persistent buffers (masks, caches a module rebuilds) are not state: they stay with each worker.
    transient = {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in getattr(sub, "_non_persistent_buffers_set", ())
    }
    return [(n, b) for n, b in module.named_buffers() if n not in transient]


def tensors_of(obj: Tensors) -> tuple[list[str], list[torch.Tensor], list[bool]]:
    """The named tensors of a module (its parameters, then its persistent buffers) or of a mapping (a TensorDict's
    `buffers` are buffers), and which are buffers. Parameters must be float32, buffers of a real dtype (held as
    float32 by the shards); TypeError/ValueError otherwise."""
    items: list[tuple[str, torch.Tensor]]
    if isinstance(obj, torch.nn.Module):
        params = list(obj.named_parameters())
        items = params + buffers_of(obj)
        buffer = [i >= len(params) for i in range(len(items))]
    elif isinstance(obj, Mapping):
        items = list(obj.items())
        marked = obj.buffers if isinstance(obj, TensorDict) else frozenset()
        buffer = [name in marked for name, _ in items]
    else:
        raise TypeError(f"expected an nn.Module or a mapping of name -> tensor, not {type(obj).__name__}")
    if not items:
        raise ValueError("the model has no parameters")
    for (name, t), is_buffer in zip(items, buffer, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} is a {type(t).__name__}, not a tensor")
        if is_buffer:
            if t.is_complex():
                raise TypeError(f"buffer {name} is {t.dtype}; the parameter server holds real values")
        elif t.dtype != torch.float32:
            raise TypeError(f"{name} is {t.dtype}; the parameter server holds float32 tensors")
    return [n for n, _ in items], [t for _, t in items], buffer
