"""Overlap: each step's exchange runs in the background while the next step computes (async and ssp jobs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from paramserver import ServerConfig
from paramserver.tables import initial_rows
from worker import Overlap, PSClient, SparseEmbedding
from worker.train.trainer import TrainConfig, train

Tensors = dict[str, torch.Tensor]


class _Recorder:
    """An exchange that keeps what it was sent and answers exchange k with weights all equal to k (1-based)."""

    def __init__(self, fail_at: int = 0) -> None:
        self.sent: list[Tensors] = []
        self.dicts: list[Tensors] = []
        self.fail_at = fail_at
        self.thread_names: list[str] = []

    def __call__(self, tensors: Tensors) -> int:
        self.thread_names.append(threading.current_thread().name)
        self.sent.append({k: v.clone() for k, v in tensors.items()})
        self.dicts.append(tensors)
        k = len(self.sent)
        if k == self.fail_at:
            raise RuntimeError(f"exchange {k} failed")
        for v in tensors.values():
            v.fill_(float(k))
        return k


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _backward(model: torch.nn.Module, scale: float) -> Tensors:
    """Fill .grad through a real backward; return the gradient it produced."""
    model.zero_grad(set_to_none=False)
    (scale * model(torch.ones(2, 4)).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_each_step_sends_its_own_gradient_and_takes_the_previous_exchanges_weights():
    model, exchange = _model(), _Recorder()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    with Overlap(model, exchange) as overlap:
        g1 = _backward(model, 1.0)
        assert overlap.step() is None  # nothing was in flight
        # Step 2 still computes on the initial weights: exchange 1 is (as far as the model knows) on its way.
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), initial[n])
        g2 = _backward(model, 2.0)
        assert overlap.step() == 1
        for p in model.parameters():
            assert torch.all(p.detach() == 1.0)  # exchange 1's weights
        g3 = _backward(model, 3.0)
        assert overlap.step() == 2
        assert overlap.finish() == 3
        for p in model.parameters():
            assert torch.all(p.detach() == 3.0)
        assert overlap.finish() is None  # nothing left in flight
    for sent, grad in zip(exchange.sent, (g1, g2, g3), strict=True):
        assert sent.keys() == grad.keys()
        for n in grad:
            assert torch.equal(sent[n], grad[n])
    assert all(name.startswith("ps-overlap") for name in exchange.thread_names)


def test_storages_take_turns_with_no_new_tensor_after_the_first_steps():
    model, exchange = _model(), _Recorder()
    seen: dict[str, set[int]] = {n: set() for n, _ in model.named_parameters()}
    with Overlap(model, exchange) as overlap:
        for step in range(12):
            _backward(model, 1.0 + step)
            overlap.step()
            for n, p in model.named_parameters():
                seen[n].add(p.data_ptr())
                seen[n].add(p.grad.data_ptr())  # type: ignore[union-attr]
                assert p.data_ptr() != p.grad.data_ptr()  # type: ignore[union-attr]
        overlap.finish()
    for n in seen:
        assert len(seen[n]) == 3, n  # data, gradient and the set in flight: three storages, reused
    # Three dicts of the same tensor objects take turns, so a client binds each one once.
    distinct = {id(d): d for d in exchange.dicts}
    assert len(distinct) == 3
    for d in exchange.dicts:
        assert all(d[n] is distinct[id(d)][n] for n in d)


def test_a_frozen_parameter_is_exchanged_too_so_the_servers_see_the_registered_model(ps_cluster_factory):
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), shards=2)
    model = _model()
    model.bias.requires_grad_(False)
    bias = model.bias.detach().clone()
    with PSClient(cluster.address) as client, Overlap(model, client.push_pull) as overlap:
        client.register(model)
        for _ in range(3):
            _backward(model, 1.0)
            overlap.step()
        overlap.finish()
        assert client.versions == [3, 3]
    assert torch.equal(model.bias.detach(), bias)  # pushed as zeros: SGD leaves it as it was


def test_a_parameter_without_a_gradient_sends_zeros():
    model, exchange = _model(), _Recorder()
    with Overlap(model, exchange) as overlap:
        model.zero_grad(set_to_none=True)
        assert model.bias.grad is None
        model.weight.grad = torch.ones_like(model.weight)
        overlap.step()
        overlap.finish()
    assert torch.equal(exchange.sent[0]["bias"], torch.zeros(3))
    assert torch.equal(exchange.sent[0]["weight"], torch.ones(3, 4))


def test_a_failed_exchange_is_raised_by_the_next_step_and_leaves_the_weights_alone():
    model, exchange = _model(), _Recorder(fail_at=2)
    with Overlap(model, exchange) as overlap:
        _backward(model, 1.0)
        overlap.step()
        _backward(model, 1.0)
        overlap.step()  # takes exchange 1's weights, sends exchange 2 (which fails)
        _backward(model, 1.0)
        with pytest.raises(RuntimeError, match="exchange 2 failed"):
            overlap.step()
        for p in model.parameters():
            assert torch.all(p.detach() == 1.0)
    # Leaving the block after a failure in flight raises nothing more and stops the thread.
    model2, failing = _model(), _Recorder(fail_at=1)
    with Overlap(model2, failing) as overlap:
        _backward(model2, 1.0)
        overlap.step()
    assert not any(t.name.startswith("ps-overlap") and t.is_alive() for t in threading.enumerate())


def _delayed_gradient_sgd(
    twin: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    lr: float,
) -> list[torch.Tensor]:
    """The servers' states S_0..S_n computed locally from the twin's parameters (S_0), gradient t computed on
    S_max(t-2, 0) as an overlapped worker computes it; returns S_n."""
    states = [[p.detach().clone() for p in twin.parameters()]]
    for t, (x, y) in enumerate(batches, start=1):
        with torch.no_grad():
            for p, w in zip(twin.parameters(), states[max(t - 2, 0)], strict=True):
                p.copy_(w)
        twin.zero_grad()
        loss(twin, x, y).backward()
        states.append([w - lr * p.grad for w, p in zip(states[-1], twin.parameters(), strict=True)])
    return states[-1]


def test_overlapped_async_training_is_delayed_gradient_sgd(ps_cluster_factory):
    """Against real shards: step t's gradient is computed on the weights after step t-2's push (the initial
    ones for steps 1 and 2), each push is applied exactly once, and the last weights come back with finish()."""
    lr, steps = 0.1, 8
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=lr), shards=2)
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(5, 6, generator=gen), torch.randint(0, 4, (5,), generator=gen)) for _ in range(steps)]
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    reference = [p.detach().clone() for p in model.parameters()]

    def loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(net(x), y)

    with PSClient(cluster.address) as client:
        client.register(model)
        with Overlap(model, client.push_pull) as overlap:
            for x, y in batches:
                model.zero_grad(set_to_none=False)
                loss(model, x, y).backward()
                overlap.step()
            overlap.finish()
        assert client.versions == [steps, steps]
        pulled = {n: torch.empty_like(p) for n, p in model.named_parameters()}
        client.pull(pulled)

    # The same arithmetic locally: the servers' states S_0..S_n, and gradient t computed on S_max(t-2, 0).
    twin = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    for p, w in zip(twin.parameters(), reference, strict=True):
        p.data.copy_(w)
    final = _delayed_gradient_sgd(twin, batches, loss, lr)
    for p, w, (name, q) in zip(model.parameters(), final, pulled.items(), strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-6)
        torch.testing.assert_close(q, p.detach(), rtol=0, atol=0, msg=name)


def test_overlap_is_refused_in_a_sync_job_with_a_message_naming_the_flag(ps_cluster):
    with pytest.raises(ValueError, match=r"--overlap needs an async or ssp job.*sync job"):
        train(TrainConfig(server=ps_cluster.address, model="logreg", steps=2, overlap=True, progress=False))


def test_overlapped_tables_prefetched_two_ahead_train_as_delayed_gradient_sgd(ps_cluster_factory):
    """A model with a SparseEmbedding: step t's exchange pushes the rows step t touched and brings the rows of batch
    t+2, so step t computes on the rows and dense weights after step t-2's push (the initial ones for steps 1 and
    2). Step 2's rows were prefetched by nobody: its forward pass looks them up after exchange 1, and its IDs are
    apart from step 1's, so those rows are still the initial ones. A row read after the wrong update, or a gradient
    taken by the wrong exchange, changes the result."""
    lr, steps, n, dim = 0.2, 8, 32, 4
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=lr), shards=2)
    gen = torch.Generator().manual_seed(5)
    batches = []
    for t in range(steps):
        low, high = (0, n // 2) if t == 0 else (n // 2, n) if t == 1 else (0, n)
        batches.append((torch.randint(low, high, (6, 2), generator=gen), torch.randn(6, generator=gen)))

    class Model(torch.nn.Module):
        def __init__(self, table: torch.nn.Module) -> None:
            super().__init__()
            self.table = table
            self.head = torch.nn.Linear(2 * dim, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.table(ids).reshape(len(ids), -1)).squeeze(-1)

    def loss(net: torch.nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((net(ids) - y) ** 2).mean()

    torch.manual_seed(2)
    model = Model(SparseEmbedding(dim, num_embeddings=n, init_scale=0.3, seed=5))
    head0 = {k: v.clone() for k, v in model.head.state_dict().items()}
    with PSClient(cluster.address) as client:
        client.register(model)
        with Overlap(model, client.push_pull) as overlap:
            for t, (ids, y) in enumerate(batches):
                model.zero_grad(set_to_none=False)
                loss(model, ids, y).backward()
                if t + 2 < steps:
                    model.table.prefetch(batches[t + 2][0])  # the exchange about to start brings its rows
                overlap.step()
            overlap.finish()
        assert client.versions == [steps, steps]
        rows = torch.from_numpy(client.lookup(model, 0, np.arange(n)))

    # The same arithmetic locally, the table dense: the states S_0..S_n, gradient t computed on S_max(t-2, 0).
    twin = Model(torch.nn.Embedding(n, dim))
    with torch.no_grad():
        twin.table.weight.copy_(torch.from_numpy(initial_rows(model.table.spec("table"), np.arange(n))))
        twin.head.load_state_dict(head0)
    table, *dense = _delayed_gradient_sgd(twin, batches, loss, lr)
    torch.testing.assert_close(rows, table, rtol=0, atol=1e-6)
    for p, w in zip(model.head.parameters(), dense, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-6)


def test_a_parameter_through_the_host_mirror_is_not_changed_under_the_next_steps_backward(ps_cluster_factory):
    """A parameter that is not a contiguous CPU tensor (a CUDA one, here a transposed one) gets the pulled weights
    through a torch copy, which counts as an in-place change of that storage's tensor. The storage Overlap takes the
    parameter's data from must not share the parameter's version counter, or the exchange in flight, writing into
    it, changes a tensor that the next step's backward saved (autograd raises)."""
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), shards=2)
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5))
    model[2].weight = torch.nn.Parameter(torch.randn(6, 5).t())  # transposed: its weights go through the mirror
    x = torch.randn(8, 6)
    with PSClient(cluster.address) as client:
        client.register(model)
        with Overlap(model, client.push_pull) as overlap:
            for _ in range(6):
                model.zero_grad(set_to_none=False)
                loss = model(x).square().sum()
                time.sleep(0.05)  # the exchange in flight lands between this forward pass and its backward
                loss.backward()
                overlap.step()
            overlap.finish()
        assert client.versions == [6, 6]
        pulled = {n: torch.empty(p.shape) for n, p in model.named_parameters()}
        client.pull(pulled)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), pulled[name], rtol=0, atol=0, msg=name)
