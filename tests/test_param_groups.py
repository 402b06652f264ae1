"""Parameter groups on the shards: --no-weight-decay exempts the tensors its name patterns match from the job's
weight decay, as torch's optimizer built with two param groups (`weight_decay` and 0) does.

The shard keeps its one flat parameter and applies the decay itself over the element ranges of the tensors that
keep it (paramserver.shard.optimizers.WeightDecay). Checked here: each optimizer's ShardModel, its tensors sliced
across two shards, against torch with two groups over several steps at a changing rate; a sync job through real
shards and PSClient against local training with torch's groups and scheduler; the flag's parsing and refusals; a
checkpoint written with patterns that resumes as if never stopped, and the settings a resumed run takes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from support.references import torch_scheduler

from paramserver.config import ServerConfig, from_arguments
from paramserver.placement import SLICE_ELEMENTS, Placement, TensorSpec, place
from paramserver.server.cli import build_parser
from paramserver.server.cluster import LocalCluster, config_to_args
from paramserver.shard.durability import checkpoint, persistence
from paramserver.shard.model import ShardModel, build_model
from paramserver.shard.optimizers import decay_patterns
from paramserver.shard.reshard_source import replay_config
from worker import PSClient

pytestmark = pytest.mark.timeout(60)

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adagrad")
PATTERNS = "*.bias,norm.*"
SPECS = (
    TensorSpec("fc1.weight", (6, 5)),  # 30 elements: sliced across 2 shards at slice_elements 16
    TensorSpec("fc1.bias", (6,)),
    TensorSpec("norm.weight", (6,)),
    TensorSpec("norm.bias", (6,)),
    TensorSpec("fc2.weight", (3, 6)),  # 18: sliced too
    TensorSpec("fc2.bias", (3,)),
    TensorSpec("norm.running_mean", (6,), buffer=True),  # a buffer: never decays, whatever the patterns
)
WD = 0.1


def _torch_optimizer(name: str, decayed: Sequence[torch.Tensor], exempt: Sequence[torch.Tensor], lr: float) -> Any:
    """torch's own optimizer (its default implementation) with the two param groups a user would write."""
    kinds: dict[str, Any] = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adam": torch.optim.Adam}
    kinds |= {"adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad}
    extra = {"momentum": 0.9} if name == "momentum" else {}
    groups = [{"params": list(decayed), "weight_decay": WD}, {"params": list(exempt), "weight_decay": 0.0}]
    return kinds[name](groups, lr=lr, **extra)


def _shards(config: ServerConfig, slice_elements: int = 16) -> tuple[Placement, list[ShardModel]]:
    placement = place(SPECS, 2, slice_elements=slice_elements)
    return placement, [build_model(placement, i, config) for i in range(2)]


def _scatter(models: list[ShardModel], tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each shard's flat part of a set of named tensors."""
    return [torch.cat([tensors[p.name].reshape(-1)[p.start : p.start + p.length] for p in m.pieces]) for m in models]


def _gather(models: list[ShardModel]) -> dict[str, torch.Tensor]:
    """The named tensors the shards hold between them."""
    out = {s.name: torch.empty(s.numel) for s in SPECS}
    for m in models:
        for piece, view in zip(m.pieces, m.views(m.params.numpy()), strict=True):
            out[piece.name][piece.start : piece.start + piece.length] = torch.from_numpy(view)
    return {s.name: out[s.name].reshape(s.shape) for s in SPECS}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_each_optimizer_on_two_shards_equals_torchs_two_param_groups(optimizer: str) -> None:
    config = ServerConfig(optimizer=optimizer, lr=0.05, weight_decay=WD, no_weight_decay=PATTERNS)
    _, models = _shards(config)
    assert len(models[0].pieces) + len(models[1].pieces) > len(SPECS), "no tensor was sliced across the shards"
    gen = torch.Generator().manual_seed(1)
    initial = {s.name: torch.randn(s.shape, generator=gen) for s in SPECS}
    for m, flat in zip(models, _scatter(models, initial), strict=True):
        m.params.copy_(flat)
    reference = {s.name: torch.nn.Parameter(initial[s.name].clone()) for s in SPECS if not s.buffer}
    decayed = [reference[n] for n in ("fc1.weight", "fc2.weight")]
    exempt = [reference[n] for n in ("fc1.bias", "norm.weight", "norm.bias", "fc2.bias")]
    opt = _torch_optimizer(optimizer, decayed, exempt, config.lr)
    for step in range(8):
        lr = config.lr * 0.8**step  # a changing rate, as a schedule gives: AdamW's decay must use it
        grads = {s.name: torch.randn(s.shape, generator=gen) for s in SPECS}
        for m, flat in zip(models, _scatter(models, grads), strict=True):
            m.step(flat, lr)
        for group in opt.param_groups:
            group["lr"] = lr
        for name, p in reference.items():
            p.grad = grads[name].clone()
        opt.step()
    held = _gather(models)
    for name, p in reference.items():
        torch.testing.assert_close(held[name], p.detach(), rtol=1e-6, atol=1e-6, msg=f"{optimizer}: {name}")
    torch.testing.assert_close(held["norm.running_mean"], grads["norm.running_mean"], rtol=0, atol=0)
    assert models[0].decay is not None and models[0].optimizer.param_groups[0]["weight_decay"] == 0


def test_the_patterns_change_nothing_without_weight_decay_and_nothing_matched_changes_nothing() -> None:
    """No decay: torch's optimizer as before. Patterns matching no tensor: the shard's own decay gives what torch's
    one-group decay gives (to a rounding), and the log says the pattern matched nothing."""
    _, plain = _shards(ServerConfig(optimizer="adam", weight_decay=0.0, no_weight_decay=PATTERNS))
    assert plain[0].decay is None and plain[0].optimizer.param_groups[0]["weight_decay"] == 0
    _, unpatterned = _shards(ServerConfig(optimizer="momentum", weight_decay=WD))
    assert unpatterned[0].decay is None and unpatterned[0].optimizer.param_groups[0]["weight_decay"] == WD
    _, unmatched = _shards(ServerConfig(optimizer="momentum", weight_decay=WD, no_weight_decay="nothing.*"))
    gen = torch.Generator().manual_seed(2)
    for a, b in zip(unpatterned, unmatched, strict=True):
        b.params.copy_(a.params.copy_(torch.randn(a.numel, generator=gen)))
    for _ in range(3):
        grads = {s.name: torch.randn(s.shape, generator=gen) for s in SPECS}
        for models in (unpatterned, unmatched):
            for m, flat in zip(models, _scatter(models, grads), strict=True):
                m.step(flat)
    for a, b in zip(unpatterned, unmatched, strict=True):
        torch.testing.assert_close(a.params, b.params, rtol=1e-6, atol=1e-7)


def test_a_pattern_that_matches_no_tensor_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="paramserver.shard.model"):
        _shards(ServerConfig(weight_decay=WD, no_weight_decay="*.bias,*layernorm*"))
    assert "'*layernorm*' exempts none" in caplog.text and "'*.bias'" not in caplog.text


def test_the_caller_s_gradient_is_left_as_it_was() -> None:
    """The write-ahead log and a backup's stream read the gradient an update applied: the decay must not write
    into it."""
    _, models = _shards(ServerConfig(optimizer="adam", weight_decay=WD, no_weight_decay=PATTERNS))
    models[0].params.normal_()
    grad = torch.randn(models[0].numel)
    kept = grad.clone()
    models[0].step(grad, 0.01)
    assert torch.equal(grad, kept)


# -- a sync job through real shards -------------------------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def test_a_sync_adamw_job_equals_local_training_with_torchs_param_groups(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    """AdamW, weight decay 0.1 but not for biases and the LayerNorm, under a warmup-cosine schedule (the decay
    takes each update's rate) on 2 shards: the weights equal local training's to 1e-5."""
    settings: dict[str, Any] = {"lr_schedule": "cosine", "warmup_versions": 3, "decay_versions": 15, "min_lr": 1e-3}
    config = ServerConfig(
        mode="sync",
        workers=1,
        optimizer="adamw",
        lr=0.05,
        weight_decay=0.1,
        no_weight_decay="*.bias,norm.*",
        **settings,
    )
    cluster = ps_cluster_factory(config, 2)
    torch.manual_seed(0)
    model, local, everywhere = _Net(), _Net(), _Net()
    with torch.no_grad():  # LayerNorm starts at 1 and 0: move it, so that a decay there shows more
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    local.load_state_dict(model.state_dict())
    everywhere.load_state_dict(model.state_dict())
    named = dict(local.named_parameters())
    exempt = ["fc1.bias", "norm.weight", "norm.bias", "fc2.bias"]
    groups = [
        {"params": [p for n, p in named.items() if n not in exempt], "weight_decay": 0.1},
        {"params": [named[n] for n in exempt], "weight_decay": 0.0},
    ]
    steppers = []
    for net, opt in (
        (local, torch.optim.AdamW(groups, lr=config.lr)),
        (everywhere, torch.optim.AdamW(everywhere.parameters(), lr=config.lr, weight_decay=0.1)),
    ):
        steppers.append((net, opt, torch_scheduler(opt, config)))
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(18)]
    with PSClient(cluster.address) as client:
        client.register(model)
        for x, y in batches:
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            client.push_pull(model)
            for net, opt, scheduler in steppers:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
                scheduler.step()
    for (name, served), ours in zip(model.named_parameters(), local.parameters(), strict=True):
        assert torch.allclose(served, ours, atol=1e-5), (name, float((served - ours).detach().abs().max()))
    # and the groups matter at this tolerance: decaying every tensor ends elsewhere
    assert float((model.norm.weight - everywhere.norm.weight).detach().abs().max()) > 1e-3


# -- the flag --------------------------------------------------------------------------------------------------


def test_the_flag_parses_from_the_command_line_and_bad_patterns_are_refused() -> None:
    parser = build_parser()
    args = parser.parse_args(["--weight-decay", "0.05", "--no-weight-decay", "*.bias, *norm*.weight,bn*"])
    config = from_arguments(ServerConfig, args)
    assert config.no_weight_decay == "*.bias, *norm*.weight,bn*"
    assert decay_patterns(config.no_weight_decay) == ("*.bias", "*norm*.weight", "bn*")
    assert from_arguments(ServerConfig, parser.parse_args([])).no_weight_decay == ""
    assert decay_patterns("") == ()
    assert "param group with weight_decay=0" in " ".join(parser.format_help().split())
    for given in (config, ServerConfig()):  # what LocalCluster hands a shard process: "" included
        assert from_arguments(ServerConfig, parser.parse_args(config_to_args(given))) == given
    for bad in ("*.bias,", ",*.bias", "*.bias,,bn*", " ", "*.bias, ,bn*"):
        with pytest.raises(ValueError, match=r"--no-weight-decay\) must be comma-separated non-empty name patterns"):
            from_arguments(ServerConfig, parser.parse_args(["--no-weight-decay", bad]))
    with pytest.raises(ValueError, match="must be a string of comma-separated name patterns"):
        ServerConfig(no_weight_decay=["*.bias"])  # type: ignore[arg-type]


# -- checkpoints ---------------------------------------------------------------------------------------------------


def _snapshot(model: ShardModel, index: int, version: int, optimizer: str) -> checkpoint.Snapshot:
    return checkpoint.Snapshot(
        shard_index=index,
        num_shards=model.placement.num_shards,
        specs=model.placement.specs,
        digest=model.digest,
        version=version,
        optimizer=optimizer,
        params=model.params.detach().clone(),
        optimizer_state=model.optimizer.state_dict(),
    )


@pytest.mark.parametrize("optimizer", ["adamw", "momentum"])
def test_a_checkpoint_written_with_patterns_resumes_as_if_never_stopped(optimizer: str, tmp_path: Path) -> None:
    config = ServerConfig(
        optimizer=optimizer, lr=0.05, weight_decay=WD, no_weight_decay=PATTERNS, checkpoint_dir=str(tmp_path)
    )
    _, models = _shards(config, SLICE_ELEMENTS)  # a restore places the model as a job does
    gen = torch.Generator().manual_seed(3)
    for m in models:
        m.params.copy_(torch.randn(m.numel, generator=gen))
    grads = [[torch.randn(m.numel, generator=gen) for m in models] for _ in range(6)]
    for step in grads[:3]:
        for m, g in zip(models, step, strict=True):
            m.step(g, 0.05)
    for i, m in enumerate(models):
        checkpoint.save(tmp_path, _snapshot(m, i, 3, optimizer))
    group = checkpoint.load_latest(tmp_path, 0).optimizer_state["param_groups"][0]  # type: ignore[union-attr]
    assert (group["weight_decay"], group["masked_weight_decay"], group["no_weight_decay"]) == (0, WD, PATTERNS)
    resumed = []
    for i in range(2):
        snap = checkpoint.load_latest(tmp_path, i)
        assert snap is not None
        resumed.append(persistence.model_of(config, i, snap))
    for step in grads[3:]:
        for m, r, g in zip(models, resumed, step, strict=True):
            m.step(g, 0.04)
            r.step(g, 0.04)
    for m, r in zip(models, resumed, strict=True):
        assert torch.equal(m.params, r.params)

    # ps-reshard replays a log under the checkpoint's settings: the job's decay and patterns, not the group's 0
    replay = replay_config(checkpoint.load_latest(tmp_path, 0), tmp_path, None)  # type: ignore[arg-type]
    assert (replay.weight_decay, replay.no_weight_decay) == (WD, PATTERNS)


def test_a_resumed_run_takes_its_own_flags_whatever_the_checkpoint_ran(tmp_path: Path) -> None:
    """A checkpoint of a run without patterns (any older one) resumes with them, and the other way round."""
    plain = ServerConfig(optimizer="adam", lr=0.05, weight_decay=WD)
    patterned = plain.replace(no_weight_decay=PATTERNS)
    for written, resumed_with in ((plain, patterned), (patterned, plain)):
        _, models = _shards(written, SLICE_ELEMENTS)
        models[0].step(torch.randn(models[0].numel), 0.05)
        snap = _snapshot(models[0], 0, 1, "adam")
        resumed = persistence.model_of(resumed_with, 0, snap)
        group = resumed.optimizer.param_groups[0]
        if resumed_with is patterned:
            assert resumed.decay is not None and group["weight_decay"] == 0 and group["masked_weight_decay"] == WD
        else:
            assert resumed.decay is None and group["weight_decay"] == WD and "masked_weight_decay" not in group
            assert "no_weight_decay" not in group
