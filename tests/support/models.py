"""Small models and gradients built by hand, seeded."""

from __future__ import annotations

import torch

from paramserver.placement import SLICE_ELEMENTS


def big_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor sliced over both shards of a two-shard job, and two small ones."""
    gen = torch.Generator().manual_seed(seed)
    assert 1100 * 1024 > SLICE_ELEMENTS
    return {
        "big": torch.randn(1100, 1024, generator=gen),
        "small.weight": torch.randn(10, 7, generator=gen),
        "small.bias": torch.randn(7, generator=gen),
    }


def like(model: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A 'gradient' of the model's shapes (a mapping's push sends the tensors themselves)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) for k, v in model.items()}


def clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies of the tensors."""
    return {k: v.detach().clone() for k, v in tensors.items()}
