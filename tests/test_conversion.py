"""make_sparse keeps a model's behaviour: an unbounded table starts its rows as the replaced module's weights were
drawn (the rule inferred from them, overridable), each table from a seed of its own. Pure: no servers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from paramserver.tables import initial_rows
from worker import SparseEmbedding, make_sparse
from worker.models.convert import initial_rule


class Two(nn.Module):
    def __init__(self, init: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users = nn.Embedding(5_000, 8, padding_idx=0)
        self.items = nn.EmbeddingBag(3_000, 8, mode="sum")
        for module in (self.users, self.items):
            if init == "uniform":
                nn.init.uniform_(module.weight, -0.05, 0.05)
            elif init == "small":  # deepctr-torch's init_std
                nn.init.normal_(module.weight, 0.0, 1e-4)
            elif init == "zeros":
                nn.init.zeros_(module.weight)


@pytest.mark.parametrize(
    ("init", "rule", "scale"),
    [("default", "normal", 1.0), ("small", "normal", 1e-4), ("uniform", "uniform", 0.05), ("zeros", "zeros", 0.0)],
)
def test_an_unbounded_table_starts_from_the_distribution_of_the_modules_weights(
    init: str, rule: str, scale: float
) -> None:
    model = Two(init)
    weights = model.users.weight.detach()[1:].numpy().copy()
    make_sparse(model, unbounded=["users", "items"])
    spec = model.users.spec("users")
    assert (spec.init, model.users.num_embeddings) == (rule, None)
    assert spec.init_scale == pytest.approx(scale, rel=0.05, abs=1e-12)
    rows = initial_rows(spec, np.arange(1, 20_001, dtype=np.int64))
    assert rows.std() == pytest.approx(weights.std(), rel=0.05, abs=1e-12)
    assert np.abs(rows).max() <= max(scale * 6, 1e-12) + 1e-6
    if rule == "uniform":
        assert np.abs(rows).max() == pytest.approx(np.abs(weights).max(), rel=0.02)


def test_each_unbounded_table_has_a_seed_of_its_own() -> None:
    model = make_sparse(Two("default"), unbounded=["users", "items"])
    ids = np.arange(100, dtype=np.int64)
    users, items = model.users.spec("users"), model.items.spec("items")
    assert users.seed != items.seed
    assert not np.allclose(initial_rows(users, ids), initial_rows(items, ids))


def test_init_options_given_override_the_inferred_rule() -> None:
    model = make_sparse(Two("small"), unbounded=["users"], init="uniform", seed=5)
    spec = model.users.spec("users")
    assert (spec.init, spec.init_scale, spec.seed) == ("uniform", 0.0, 5)  # 0: the table's default scale
    scaled = make_sparse(Two("small"), unbounded=["users"], init_scale=0.3).users.spec("users")
    assert (scaled.init, scaled.init_scale) == ("normal", 0.3)
    bounded = make_sparse(Two("small"))
    assert isinstance(bounded.users, SparseEmbedding) and bounded.users.given is not None  # its own rows, sent


def test_the_rule_leaves_the_padding_row_out_and_reads_a_large_table_through_a_sample() -> None:
    weight = torch.zeros(10, 4)
    weight[0] = 100.0  # the padding row, never drawn from the rule
    weight[1:] = torch.rand(9, 4) * 0.2 - 0.1
    assert initial_rule(weight, padding_idx=0)[0] == "uniform"
    big = torch.randn(2_000_000, 1) * 0.01
    rule, scale = initial_rule(big)
    assert rule == "normal" and scale == pytest.approx(0.01, rel=0.02)


def test_models_drawn_with_other_seeds_name_the_same_rule() -> None:
    """Every worker builds its own model: the specs the shards check must not depend on the draw."""
    specs = []
    for seed in range(5):
        torch.manual_seed(seed)
        model = make_sparse(nn.Sequential(nn.Embedding(2_000, 8), nn.Embedding(300, 4)), unbounded=["0", "1"])
        specs.append([m.spec(str(k)) for k, m in enumerate(model)])
    assert all(s == specs[0] for s in specs), specs
