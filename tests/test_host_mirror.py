"""PSClient's host mirror: parameters and gradients that are not contiguous CPU tensors (a CUDA tensor's path, here
taken by transposed and strided CPU views) go through a flat host copy in both directions, over every transport.

Each test trains a model whose parameters and gradients mix contiguous, transposed and strided layouts for two
steps on real shards (2 shards in threads, sync, 1 worker, SGD with lr 1/2 and values in multiples of 1/16, so
every update is exact) and checks: the shards start from the model's logical values (read back by a second,
non-joined client into fresh contiguous tensors); after each push_pull the model's own tensors, in place and with
their strides kept, hold w - lr * g exactly; the gradients are left as they were; and the shards end in the state
that the same run with contiguous tensors leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from paramserver import LocalCluster, ServerConfig
from paramserver.errors import NotAttached
from paramserver.transport import shm
from worker import PSClient

pytestmark = pytest.mark.timeout(180)

LR = 0.5
CLIENT_TIMEOUT = 60.0  # seconds for any client call: generous, for a heavily loaded machine
CONFIG = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR)

TRANSPORTS: dict[str, dict[str, Any]] = {  # PSClient keyword arguments
    "shared-memory": {"shared_memory": True},
    "data-socket": {"shared_memory": False, "data_socket": True},
    "grpc": {"shared_memory": False, "data_socket": False},
}

# name -> (shape, layout of the parameter, layout of its gradient)
Layouts = dict[str, tuple[tuple[int, ...], str, str]]
SMALL: Layouts = {
    "both_transposed": ((5, 3), "transposed", "transposed"),
    "param_transposed": ((4, 6), "transposed", "contiguous"),
    "grad_transposed": ((3, 4), "contiguous", "transposed"),
    "both_strided": ((7,), "strided", "strided"),
    "contiguous": ((6,), "contiguous", "contiguous"),
}
# Over SLICE_ELEMENTS (cut across both shards) and over INLINE_BYTES per shard (the streamed / large paths).
LARGE: Layouts = {**SMALL, "big_transposed": ((1100, 1000), "transposed", "transposed")}


def _values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Distinct-looking multiples of 1/16 (exact in float32, and so are w - g / 2), never symmetric under a
    transpose, so that reading a view's storage in memory order instead of logical order shows."""
    n = torch.Size(shape).numel()
    return ((torch.arange(n) * (seed + 2) % 29 - 14) / 16).reshape(shape).to(torch.float32)


def _laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A new tensor holding `values` (logically) in the given memory layout."""
    if layout == "contiguous":
        out = values.clone()
    elif layout == "transposed":
        out = values.t().contiguous().t()
    elif layout == "strided":
        storage = torch.full((2 * values.numel(),), 99.0)
        out = storage[::2]
        out.copy_(values)
    else:
        raise ValueError(layout)
    assert torch.equal(out, values) and out.is_contiguous() == (layout == "contiguous")
    return out


class _Model(torch.nn.Module):
    """A module whose parameters are exactly the given tensors (views included, strides kept)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, torch.nn.Parameter(t))


def _initial(layouts: Layouts) -> dict[str, torch.Tensor]:
    return {name: _values(shape, seed) for seed, (name, (shape, _, _)) in enumerate(layouts.items())}


def _gradient(layouts: Layouts, step: int) -> dict[str, torch.Tensor]:
    return {name: _values(shape, 10 * step + seed) for seed, (name, (shape, _, _)) in enumerate(layouts.items())}


def _on_the_servers(cluster: LocalCluster, layouts: Layouts) -> dict[str, torch.Tensor]:
    """The shards' current weights, pulled by a reader that did not join into fresh contiguous tensors."""
    fresh = {name: torch.full(shape, -99.0) for name, (shape, _, _) in layouts.items()}
    with PSClient(cluster.address, join=False, timeout=CLIENT_TIMEOUT) as reader:
        reader.pull(fresh)
    return fresh


def _check_transport(cluster: LocalCluster, client: PSClient, transport: str) -> None:
    """Every shard exchanges with `client` over the transport under test (no silent fallback)."""
    for shard in cluster.shards:
        if transport == "grpc":
            with pytest.raises(NotAttached):
                shard.attachments.get(client.worker_id, shard.model)
        else:  # a shared-memory segment, or else a data-socket ticket
            attached = shard.attachments.get(client.worker_id, shard.model)
            assert isinstance(attached, shm.Segment) == (transport == "shared-memory"), transport


def _train(cluster: LocalCluster, transport: str, layouts: Layouts, contiguous: bool) -> dict[str, torch.Tensor]:
    """Register, then two push_pull steps, checking the model after each; return its final weights."""
    param_layout = {name: "contiguous" if contiguous else p for name, (_, p, _) in layouts.items()}
    grad_layout = {name: "contiguous" if contiguous else g for name, (_, _, g) in layouts.items()}
    expected = _initial(layouts)
    model = _Model({name: _laid_out(v, param_layout[name]) for name, v in expected.items()})
    params = dict(model.named_parameters())
    where = {name: (p.data_ptr(), p.stride()) for name, p in params.items()}
    if not contiguous:
        assert not all(p.is_contiguous() for p in params.values())

    with PSClient(cluster.address, timeout=CLIENT_TIMEOUT, **TRANSPORTS[transport]) as client:
        assert client.register(model) == 0
        _check_transport(cluster, client, transport)
        _assert_equal(_on_the_servers(cluster, layouts), expected, "the shards' initial weights")
        _assert_equal(params, expected, "the weights after register")
        for step in (1, 2):
            grads = _gradient(layouts, step)
            for name, p in params.items():
                p.grad = _laid_out(grads[name], grad_layout[name])
            sent = {name: p.grad.clone() for name, p in params.items()}  # type: ignore[union-attr]
            assert client.push_pull(model) == step
            expected = {name: w - LR * grads[name] for name, w in expected.items()}
            _assert_equal(params, expected, f"the model's weights after step {step}")
            _assert_equal({n: p.grad for n, p in params.items()}, sent, f"the gradients of step {step}")
            assert {name: (p.data_ptr(), p.stride()) for name, p in params.items()} == where, "not written in place"
        _assert_equal(_on_the_servers(cluster, layouts), expected, "the shards' final weights")
        assert [s.describe().version for s in cluster.shards] == [2, 2]
    return {name: p.detach().clone() for name, p in params.items()}


def _assert_equal(got: dict[str, Any], want: dict[str, torch.Tensor], what: str) -> None:
    """Exact equality, tensor by tensor, naming the first one that differs."""
    assert list(got) == list(want), what
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{what}: {name} differs"


@pytest.mark.parametrize("layouts", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_non_contiguous_parameters_and_gradients_round_trip_exactly(
    ps_cluster_factory: Callable[..., LocalCluster], transport: str, layouts: Layouts
) -> None:
    if transport == "shared-memory" and not shm.available():
        pytest.skip("no shared memory (sealed memfds) on this machine")
    mirrored = ps_cluster_factory(CONFIG, shards=2)
    reference = ps_cluster_factory(CONFIG, shards=2)

    got = _train(mirrored, transport, layouts, contiguous=False)
    want = _train(reference, transport, layouts, contiguous=True)

    _assert_equal(got, want, "the non-contiguous run against the contiguous one")
    assert [s.state_bytes() for s in mirrored.shards] == [s.state_bytes() for s in reference.shards]


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_mapping_of_non_contiguous_tensors_pushes_the_tensors_themselves(
    ps_cluster_factory: Callable[..., LocalCluster], transport: str
) -> None:
    """A plain mapping: push sends each tensor itself as the gradient, read through the mirror, and the weights
    come back into the same views: w - lr * w after one step."""
    if transport == "shared-memory" and not shm.available():
        pytest.skip("no shared memory (sealed memfds) on this machine")
    cluster = ps_cluster_factory(CONFIG, shards=2)
    initial = _initial(SMALL)
    tensors = {name: _laid_out(initial[name], p) for name, (_, p, _) in SMALL.items()}
    with PSClient(cluster.address, timeout=CLIENT_TIMEOUT, **TRANSPORTS[transport]) as client:
        client.register(tensors)
        _assert_equal(_on_the_servers(cluster, SMALL), initial, "the shards' initial weights")
        assert client.push_pull(tensors) == 1
    expected = {name: w - LR * w for name, w in initial.items()}
    _assert_equal(tensors, expected, "the mapping's weights after one step")
    _assert_equal(_on_the_servers(cluster, SMALL), expected, "the shards' weights after one step")
    assert all(t.is_contiguous() == (SMALL[name][1] == "contiguous") for name, t in tensors.items())
