"""ParameterServerStrategy: PyTorch Lightning's Trainer trains through the parameter servers, as DeepSpeed and FSDP
ship a Strategy of their own.

    trainer = pl.Trainer(strategy=ParameterServerStrategy("hostA:50051", sparse=True), accelerator="cpu", devices=1)
    trainer.fit(task)                      # one such process per worker, started as any process is

What it does for a LightningModule left as it is: joins the job (the worker's rank and the job's world size become
the Trainer's), converts its embeddings (`sparse`: make_sparse's options), registers it with the servers once it is
on its device, puts the optimizer `configure_optimizers` returns behind a PSOptimizer (the servers' optimizer, rate
and schedule train: ps-server --optimizer, --lr, --lr-schedule), and gives each rank its part of the data: Lightning
puts a DistributedSampler with the client's rank and world size on the train, validation and test loaders, as it
does for its own distributed strategies (Trainer(use_distributed_sampler=False) leaves the loaders alone).

There is no collective among workers: `reduce`, `broadcast` and `all_gather` return this worker's own value and
`barrier` returns at once (the servers' sync rounds are the job's only barrier); a metric logged with
`sync_dist=True` is each worker's own.

Lightning itself is imported by this module alone (`pytorch_lightning`, or the unified `lightning` package's
`lightning.pytorch`), so that `import worker` never needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

try:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ParallelStrategy
except ImportError:  # the unified package
    import lightning.pytorch as pl  # type: ignore[no-redef]
    from lightning.pytorch.strategies import ParallelStrategy  # type: ignore[no-redef]
from lightning_utilities.core.rank_zero import rank_zero_only  # Lightning's own rank_zero_only is this one

from worker.client.psclient import PSClient
from worker.models.convert import make_sparse
from worker.train.optimizer import PSOptimizer

log = logging.getLogger(__name__)

__all__ = ["ParameterServerStrategy"]


class ParameterServerStrategy(ParallelStrategy):
    """Train a LightningModule through the parameter servers at `server` (any one shard's "host:port", or a joined
    PSClient this strategy then uses and leaves to its owner); see the module docstring.

    `sparse`: convert the module's nn.Embedding / nn.EmbeddingBag layers into tables on the shards before it is
    registered: True for make_sparse's defaults, or a mapping of its keywords ({"unbounded": ["user"]}); False
    leaves the module as it is. `loss_reduction`: PSOptimizer's ("sum" for a loss summed over the batch).
    `client_options`: PSClient's keywords (tls_ca, auth_token, ...) for the client made from an address.

    The client made from an address joins when the Trainer starts (`setup_environment`), leaves the job as finished
    when training ends (`on_train_end`), and stays open for what follows (`strategy.client.save(task, path)`,
    validation, tests) until `close()`, or the end of a `with ParameterServerStrategy(...) as strategy:` block.
    One process per worker and one device each: `devices=1`.
    """

    strategy_name = "parameter_server"

    def __init__(
        self,
        server: str | PSClient,
        *,
        sparse: bool | Mapping[str, Any] = False,
        loss_reduction: str = "mean",
        client_options: Mapping[str, Any] | None = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._address = server if isinstance(server, str) else ""
        self._client = None if isinstance(server, str) else server
        self._owned = isinstance(server, str)
        self._sparse: dict[str, Any] | None = (
            None if sparse is False else {} if sparse is True else dict(sparse)  # type: ignore[arg-type]
        )
        self.loss_reduction = loss_reduction
        self._client_options = dict(client_options or {})

    # -- the job -----------------------------------------------------------------------------------------------

    @property
    def client(self) -> PSClient:
        """The PSClient this strategy trains with (made when the Trainer starts, for a strategy given an address)."""
        if self._client is None:
            raise RuntimeError("the strategy joins the job when the Trainer starts (fit, validate, test, predict)")
        return self._client

    @property
    def _module(self) -> pl.LightningModule:
        if self.lightning_module is None:
            raise RuntimeError("no LightningModule: the Trainer connects it before setting the strategy up")
        return self.lightning_module

    def setup_environment(self) -> None:
        devices = self.parallel_devices or []
        if len(devices) > 1:
            raise ValueError(
                f"ParameterServerStrategy trains on one device per process, not {len(devices)}: start one process "
                "per device (each a worker of the job) with Trainer(devices=1)"
            )
        super().setup_environment()
        if self._client is None:
            self._client = PSClient(self._address, **self._client_options)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # what Lightning does on rank 0 only

    def setup(self, trainer: pl.Trainer) -> None:
        if self._sparse is not None:
            make_sparse(self._module, **self._sparse)
        super().setup(trainer)

    def model_to_device(self) -> None:
        """Move the module to its device, then register it: the servers' weights (or this module's, for the first
        worker of a new job) are pulled into it there."""
        assert self.model is not None
        self.model.to(self.root_device)
        self.client.register(self._module)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Put the optimizer `configure_optimizers` returns behind a PSOptimizer (one exchange per step). Several
        optimizers, or a learning-rate scheduler, are refused: the job has one optimizer and one schedule, the
        servers'."""
        super().setup_optimizers(trainer)
        if self.lr_scheduler_configs:
            raise TypeError(
                "configure_optimizers returned a learning-rate scheduler: the schedule is the servers' (ps-server "
                "--lr-schedule step|cosine|linear, --warmup-versions, ...)"
            )
        if len(self.optimizers) > 1:
            raise ValueError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers: a job has one, the servers' "
                "(ps-server --optimizer), over every parameter of the registered module"
            )
        self.optimizers = [self._wrapped(opt) for opt in self.optimizers]

    def _wrapped(self, optimizer: torch.optim.Optimizer) -> PSOptimizer:
        if isinstance(optimizer, PSOptimizer):
            return optimizer
        job = self.client.topology.job
        name = type(optimizer).__name__.lower()
        if name == "sgd" and optimizer.defaults.get("momentum"):
            name = "momentum"
        lr = optimizer.defaults.get("lr")
        if name in ("sgd", "momentum", "adam", "adamw", "adagrad") and (name != job.optimizer or lr != job.lr):
            log.warning(
                "configure_optimizers returned %s (lr %s); the servers train with %s at lr %s (ps-server "
                "--optimizer, --lr), and theirs is the one that runs",
                type(optimizer).__name__,
                lr,
                job.optimizer,
                job.lr,
            )
        return PSOptimizer(self._module, self.client, loss_reduction=self.loss_reduction, register=False)

    def on_train_end(self) -> None:
        """Leave the job as finished (a client of this strategy's own): a sync round waits for this worker no more,
        and shards run with --exit-when-done stop once every worker has."""
        if self._owned and self._client is not None:
            self._client.leave(finished=True)

    def close(self) -> None:
        """Close the client this strategy made (leaving the job if it is still in it)."""
        if self._owned and self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> ParameterServerStrategy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- ranks and devices -------------------------------------------------------------------------------------

    @property
    def is_distributed(self) -> bool:
        """True: Lightning then puts a DistributedSampler on the loaders (distributed_sampler_kwargs)."""
        return True

    @property
    def global_rank(self) -> int:
        return self._client.rank if self._client is not None else 0

    @property
    def local_rank(self) -> int:
        return 0  # one device per process

    @property
    def node_rank(self) -> int:
        return self.global_rank

    @property
    def world_size(self) -> int:
        return self._client.world_size if self._client is not None else 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        return devices[0] if devices else torch.device("cpu")

    # -- no collective among workers ---------------------------------------------------------------------------

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor
