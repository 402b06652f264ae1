"""How one model's tensors map onto the shards' pieces: views into the model's own memory, per shard."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paramserver.placement import Placement

Tensors = torch.nn.Module | Mapping[str, torch.Tensor]


@dataclass
class Binding:
    """How one model's tensors map onto the shards' pieces (computed once per model object)."""

    names: list[str]
    tensors: list[torch.Tensor]
    placement: Placement
    host: list[torch.Tensor | None]  # a CPU float32 mirror for tensors that are not CPU-contiguous
    largest_part: int = 0  # elements of the largest shard's part

    def __post_init__(self) -> None:
        self.largest_part = max(self.placement.shard_elements(k) for k in range(self.placement.num_shards))
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

    def mirror_weights(self) -> None:
        """Copy the model's weights into the host mirrors (before they are read from there)."""
        self.settle()
        for t, mirror in zip(self.tensors, self.host, strict=True):
            if mirror is not None:
                mirror.copy_(t.detach().reshape(-1))

    def unmirror_weights(self) -> None:
        """Copy pulled weights from the host mirrors into the model's tensors (CUDA, non-contiguous). A copy to the
        GPU runs on while the worker goes on (the mirror is pinned); the next write to a mirror waits for it."""
        to_gpu = False
        with torch.no_grad():
            for t, mirror in zip(self.tensors, self.host, strict=True):
                if mirror is not None:
                    t.copy_(mirror.view(t.shape).to(t.device, non_blocking=True))
                    to_gpu = to_gpu or t.device.type == "cuda"
        if to_gpu:
            self._copying = torch.cuda.Event()
            self._copying.record()

    def gradients(self, of_module: bool) -> list[np.ndarray]:
        """Flat float32 host views of each tensor's gradient (the tensors themselves for a mapping), through the
        host mirror where the gradient is not a contiguous CPU tensor."""
        self.settle()
        grads: list[np.ndarray] = []
        for i, t in enumerate(self.tensors):
            g = t.grad if of_module else t
            if g is None:
                g = torch.zeros_like(t)
            mirror = self.host[i]
            if mirror is not None or not g.is_contiguous() or g.device.type != "cpu":
                if mirror is None:
                    mirror = self.host[i] = torch.empty(t.numel(), dtype=torch.float32)
                mirror.copy_(g.detach().reshape(-1))
                grads.append(mirror.numpy())
            else:
                grads.append(g.detach().view(-1).numpy())
        return grads


def tensors_of(obj: Tensors) -> tuple[list[str], list[torch.Tensor]]:
    """The named float32 tensors of a module (its parameters) or of a mapping; TypeError/ValueError otherwise."""
    items: list[tuple[str, torch.Tensor]]
    if isinstance(obj, torch.nn.Module):
        items = list(obj.named_parameters())
    elif isinstance(obj, Mapping):
        items = list(obj.items())
    else:
        raise TypeError(f"expected an nn.Module or a mapping of name -> tensor, not {type(obj).__name__}")
    if not items:
        raise ValueError("the model has no parameters")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} is a {type(t).__name__}, not a tensor")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} is {t.dtype}; the parameter server holds float32 tensors")
    return [n for n, _ in items], [t for _, t in items]
