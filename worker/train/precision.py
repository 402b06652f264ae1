"""Mixed precision on the worker: the forward pass under torch.autocast, the gradient always float32 and unscaled.

The model's parameters stay float32 on the worker (autocast casts copies of them per operation), so backward
leaves float32 gradients, and the shards keep float32 masters whatever the worker computes in. bfloat16 has
float32's range and needs nothing more. float16 does: small gradients underflow to zero, so the loss is multiplied
by a scale before backward and the gradients divided by it after, before clipping and before the push. The scale
is dynamic, as torch.amp.GradScaler's: halved when the scaled gradient overflows, doubled after a run of steps
that did not. torch's GradScaler is not used because it is built around a local optimizer's step (unscale_ and
step take one), and here the optimizer is on the servers.

What is pushed when the scaled gradient overflows: the shards refuse a gradient holding Inf or NaN, a zero
gradient is not neutral (Adam's and momentum's moments decay by a step, and Adam's step count advances), and
skipping the push would stall a sync round until the worker is evicted. So the step is computed again at half
the scale, and again, until its gradient is finite (BatchNorm's running statistics put back first, so the step
moves them once): at most log2(scale) times, since the scale never falls below 1. Only a step whose loss is itself
not finite, or whose gradient overflows even at scale 1, which no scale cures, pushes a zero gradient instead,
with a warning, counted in `skipped`. (gradients.compute_gradients runs this loop.)
"""

# Depends on torch only.

from __future__ import annotations

import warnings
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float16")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class LossScaler:
    """A dynamic loss scale: take the loss `scaled` before backward, then `unscale` the gradients and learn whether
    they are finite; `update` moves the scale as torch.amp.GradScaler does (backoff on overflow, growth after
    `growth_interval` finite steps in a row), but never below `min_scale`."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        if not init_scale >= min_scale > 0:
            raise ValueError(f"the loss scale must start at min_scale ({min_scale}) or above, not {init_scale}")
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("a loss scale needs growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.skipped = 0  # steps that pushed a zero gradient
        self.retries = 0  # overflows: backward passes done again at a lower scale
        self._good_steps = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on."""
        return loss * self.scale

    def unscale(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients by the scale in place; return whether every element is finite."""
        grads = list(grads)
        if not grads:
            return True
        # The reciprocal of a power of two is exact, so a gradient that did not overflow comes back bit for bit.
        inverse = 1.0 / self.scale
        for g in grads:
            g.mul_(inverse)
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())  # one sync, not one per tensor

    def can_back_off(self) -> bool:
        """Whether a lower scale is left to try."""
        return self.scale > self.min_scale

    def update(self, finite: bool) -> None:
        """After a backward pass: on overflow, lower the scale (not below min_scale); after enough finite ones in a
        row, raise it."""
        if not finite:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self._good_steps = 0
            self.retries += 1
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0


class MixedPrecision:
    """How a worker computes: the autocast dtype of the forward pass (None: float32, no autocast) and, for float16,
    the loss scaler. `MixedPrecision.for_device` checks that the device can do it."""

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, scaler: LossScaler | None = None) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.scaler = scaler

    @classmethod
    def for_device(cls, precision: str, device: torch.device) -> MixedPrecision:
        """The precision `precision` (float32, bfloat16, float16) on `device`, or a ValueError saying why the
        device cannot run it."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        if precision == "float32":
            return cls(device.type)
        dtype = _DTYPES[precision]
        if not _autocast_works(device, dtype):
            hint = "use --precision bfloat16 or float32" if precision == "float16" else "use --precision float32"
            raise ValueError(
                f"--precision {precision}: torch {torch.__version__} cannot autocast to {precision} on {device}; {hint}"
            )
        return cls(device.type, dtype, LossScaler() if precision == "float16" else None)

    def autocast(self) -> AbstractContextManager[object]:
        """The context to run the forward pass (and a user's step) in."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def name(self) -> str:
        """float32, bfloat16 or float16."""
        return "float32" if self.dtype is None else str(self.dtype).removeprefix("torch.")


def _autocast_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a matrix product under autocast to `dtype` on `device` comes out in `dtype` (torch warns and runs
    in float32 where a device type does not support a dtype, or raises, as CUDA does for bfloat16 on old GPUs)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(device.type, dtype=dtype):
                a = torch.ones(2, 2, device=device)
                return (a @ a).dtype == dtype
    except (RuntimeError, ValueError):
        return False
