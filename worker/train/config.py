"""TrainConfig: what one ps-worker trains and how (its flags); the job's dynamics (mode, optimizer, lr) live on the
servers."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from paramserver.config import config_field
from paramserver.wire import dtypes
from worker.client.compress import DEFAULT_WARMUP, Scheme
from worker.models.builtin import BUILTIN_MODELS
from worker.models.clicks import CLICK_MODELS, TableOptions
from worker.train.losses import LOSSES, check_loss_spec, check_step_spec
from worker.train.precision import PRECISIONS

# The batch when none is given: the digits default, and what the recsys demo trains click models at (77k samples/s
# against 6.1k at 32 on 2 workers x 2 shards, same AUC: issue 40).
DENSE_BATCH, CLICK_BATCH = 32, 2048


@dataclass(frozen=True)
class TrainConfig:
    """What one worker trains and how; the job's dynamics (mode, optimizer, lr) live on the servers."""

    server: str = config_field("127.0.0.1:50051", "address of any one shard (host:port)")
    model: str = config_field(
        "cnn",
        f"model: {', '.join(BUILTIN_MODELS)}; for a dataset with categorical features (click logs) "
        f"{', '.join(CLICK_MODELS)}; or package.module:factory for your own nn.Module factory (given in_shape= and "
        "num_classes=, or schema= and tables= for click logs, where it takes them)",
    )
    dataset: str = config_field(
        "digits",
        "dataset: digits (scikit-learn's handwritten digits), synthetic (both classification), diabetes "
        "(scikit-learn's, a regression, standardised), or PATH.npz with x_train, y_train, x_test, y_test (integer y: "
        "class labels; float y of shape (N,) or (N, k): regression targets, the model built with k outputs), or "
        "a dataset ps-prepare wrote: its directory or its manifest's URL (file://, s3://, hdfs://, http(s)://), "
        "streamed: each worker reads the shards of its rank",
    )
    prefetch: int = config_field(
        2,
        "prepared datasets: shards to fetch and decode ahead of the step, on a thread of their own (the worker "
        "holds about this many shards in memory)",
    )
    follow: bool = config_field(
        False,
        "train a prepared dataset as it grows (ps-prepare --follow writes it): each train shard, once listed in the "
        "manifest, is claimed by one worker of the job (the claims are kept on the servers) and trained once, in one "
        "pass; caught up, the worker waits, heartbeating, and reads the manifest again every --follow-poll-seconds. "
        "A worker that dies or is stopped holding a shard frees it, and another trains it again from its start. "
        "SIGTERM stops the worker at its next step. Ignores --epochs and --steps",
    )
    follow_poll_seconds: float = config_field(
        2.0, "with --follow: seconds between readings of the manifest while caught up (and between claims)"
    )
    follow_stop_when_idle: float = config_field(
        0.0,
        "with --follow: leave the job (finished) once caught up for this many seconds; 0 (default): wait for new "
        "shards until stopped",
    )
    epochs: int = config_field(10, "passes over this worker's part of the training data")
    steps: int | None = config_field(None, "train exactly this many steps instead of --epochs")
    batch_size: int = config_field(
        0,
        f"samples per step on this worker; 0 (the default): {DENSE_BATCH}, or {CLICK_BATCH} for click logs (a "
        "dataset with categorical features: tables learn from thousands of rows a step) (in sync mode the server "
        "averages the workers' gradients, so one step sees batch-size x workers samples)",
    )
    device: str = config_field("auto", "auto (CUDA when available), cpu, cuda or cuda:N")
    seed: int = config_field(0, "seed of the model's initial weights and of the data order")
    wire_dtype: str = config_field(
        "float32",
        f"dtype of tensors on the wire: {', '.join(dtypes.NAMES)} (the servers keep float32)",
        choices=dtypes.NAMES,
    )
    shared_memory: bool = config_field(
        True,
        "exchange tensors with shards on this host through shared memory and a Unix socket",
    )
    data_socket: bool = config_field(
        True,
        "exchange tensors with shards on other hosts as raw bytes over their TCP data socket (gRPC only for "
        "control); off, or where a shard serves none or its port is closed: gRPC streams (the data socket is "
        "tried again after 30 s, then less and less often)",
    )
    push_in_turn: str = config_field(
        "auto",
        "push a large model's parts to the shards' data sockets one shard after the other, so one shard's weights "
        "come back while the next one's gradient goes out (25 MB over 400 Mbit/s: 0.82 s against 1.01 s a step); "
        "auto: for shards reached over a network, not for a loopback address (copies, not a link, are the limit)",
        choices=("auto", "on", "off"),
    )
    compress: str | None = config_field(
        None,
        "compress each push over a data socket (a shard on another host): topk:RATIO sends about RATIO of the "
        "gradient's elements, the largest; powersgd:RANK each weight matrix as two rank-RANK factors. What a push "
        "leaves out is added to the next (error feedback), so nothing is lost, only delayed. The first "
        f"{DEFAULT_WARMUP} steps push whole (a warm-up: top-k 1 %% on digits ends 0.955 against 0.923 without); "
        "topk:RATIO:warmup=K or powersgd:RANK:warmup=K sets K (0: none). Combines with --wire-dtype. Applies over "
        "the data socket only: shared memory and gRPC push whole. Default: pushes go whole",
    )
    clip_grad_norm: float | None = config_field(
        None,
        "clip the gradient to this global norm before each push (torch.nn.utils.clip_grad_norm_ over the whole "
        "model: every shard's part scaled by the same factor); default: no clipping",
    )
    accumulate: int = config_field(
        1,
        "split each batch into this many micro-batches, one forward/backward each, their gradients summed into "
        "the batch's before the push (the same gradient as the whole batch, in a fraction of the activation memory)",
    )
    loss: str = config_field(
        "auto",
        f"what each step minimises: {', '.join(LOSSES)} (auto: cross_entropy for a classification dataset, bce for "
        "one with categorical features (a click model's one logit), mse for a regression), or package.module:fn, "
        "your fn(outputs, targets) -> the batch's mean loss as a scalar tensor, given the model's outputs in float32 "
        "(a single output column against (N,) targets as (N,))",
    )
    train_step: str | None = config_field(
        None,
        "package.module:fn, your whole step fn(model, x, y) -> the batch's mean loss as a scalar tensor, for a model "
        "whose forward is not model(x) or a loss that needs more than its outputs (replaces --loss; runs under "
        "--precision's autocast; the worker still does backward, --accumulate, --clip-grad-norm and loss scaling). "
        "Evaluation then reports its mean loss over the test split, no accuracy",
    )
    precision: str = config_field(
        "float32",
        "the forward pass's precision: float32, or torch.autocast to bfloat16 or float16 (parameters, gradients and "
        "the shards' weights stay float32). float16 also scales the loss (dynamically) and unscales the gradient "
        "before clipping and the push; where the scaled gradient overflows, the step is computed again at half the "
        "scale, so no Inf is pushed and no step lost. Only a loss that is itself NaN or Inf, or a gradient that "
        "overflows at scale 1, pushes a zero gradient, with a warning (skipped_steps in the metrics)",
        choices=PRECISIONS,
    )
    overlap: bool = config_field(
        False,
        "async and ssp jobs: send each step's gradient and receive the next weights while the next step computes, "
        "so a step costs about max(compute, exchange) instead of their sum, and each gradient is one step staler. "
        "Pays where both can run at once (a slow link, cores to spare); refused in sync jobs",
    )
    overlap_backward: bool = config_field(
        False,
        "send each layer's gradient to the shards as soon as backward has made it, the last layers first, while "
        "backward computes the earlier ones (as DDP's buckets do; any mode). Applies where the gradient is final "
        "as backward leaves it: not with --accumulate over 1, --clip-grad-norm, --precision float16 (loss scaling), "
        "sparse tables, --overlap, --compress or a host group, nor where each shard's part fits one message (1 MiB on "
        "the wire): those exchange after backward. Over a link, 1.03-1.09x a 25 M-parameter MLP's samples/s",
    )
    embedding_dim: int = config_field(16, "click models (a dataset with categorical features): the tables' width")
    table_size: int = config_field(
        0,
        "click models: 0 (default) keys each table by the raw IDs (unbounded: a row is made on the shards when an ID "
        "is first trained); N bounds each table to N rows, an ID going to row ID mod N (the hashing trick)",
    )
    table_optimizer: str = config_field(
        "",
        "click models: the tables' row optimizer (sgd, adagrad, rowwise_adagrad, adam); default: the job's "
        "counterpart of --optimizer",
    )
    table_lr: float = config_field(0.0, "click models: the tables' learning rate (default: the job's)")
    admit_after: int = config_field(
        0,
        "click models: make a row only once its ID was in this many updates (until then it reads as its initial "
        "value and its gradients are dropped)",
    )
    evict_after_versions: int = config_field(
        0, "click models: drop rows no update touched for this many versions (0: never)"
    )
    table_capacity: int = config_field(
        0, "click models: rows per shard per table, the least recently updated dropped beyond it (0: no cap)"
    )
    job_name: str = config_field("", "job to join; refused if the servers run another (default: any)")
    threads: int = config_field(1, "torch CPU threads (1 is fastest when shards and workers share the cores)")
    timeout: float = config_field(120.0, "seconds to wait for a shard before giving up on a call")
    connect_timeout: float = config_field(
        60.0,
        "seconds to keep trying to reach --server at the start (it may still be starting), a warning per try, "
        "before giving up",
    )
    round_timeout: float = config_field(
        1800.0,
        "seconds to wait for a round to close before giving up: in sync mode for the job's other workers to "
        "join (pods may start minutes apart) or to push; the wait is logged every --pull-timeout of the servers",
    )
    tls_ca: str | None = config_field(None, "PEM CA that signed the shards' certificates (enables TLS)")
    tls_cert: str | None = config_field(None, "PEM client certificate, for shards that require mutual TLS")
    tls_key: str | None = config_field(None, "PEM private key of the client certificate")
    tls_server_name: str | None = config_field(
        None, "name to expect in the shards' certificates, when it is not the address's host"
    )
    auth_token_file: str | None = config_field(None, "file holding the job's shared bearer token")
    metrics_out: str | None = config_field(
        None,
        "write a JSON summary of the run to this file; in a job of several workers each writes FILE-RANK.EXT, its "
        "rank in the job before the extension (m.json: m-0.json, m-1.json, ...), so that workers given one path "
        "keep every rank's summary",
    )
    eval_every_epoch: bool = config_field(
        False,
        "test after every epoch, not only at the end (--metrics-out's eval_history: seconds, step and test "
        "metrics of each; --plot and --tensorboard do this anyway)",
    )
    plot: str | None = config_field(
        None,
        "draw the loss and the test accuracy (classification) over time into this PNG (needs matplotlib: pip install "
        "'paramserver[plot]')",
    )
    save_model: str | None = config_field(
        None,
        "save the trained model to this safetensors file (PSClient.save): its weights, buffers and every table's "
        "rows as the shards hold them at the end; worker.load(model, path) serves it without servers. Written to a "
        "temporary file of this worker's own, then renamed: workers given the same path each succeed, and it holds "
        "the file of the last to finish",
    )
    tensorboard: str | None = config_field(
        None,
        "write TensorBoard scalars into this directory (worker-RANK/ under it): loss, samples/s, exchange seconds "
        "and staleness each step (and the wait for a prepared dataset's shards), test loss (and, classification, "
        "test accuracy) each epoch (needs tensorboard: pip install 'paramserver[tensorboard]')",
    )
    progress: bool = config_field(True, "show a progress bar")

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs must be at least 1, not {self.epochs}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be at least 1 shard, not {self.prefetch}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, not {self.steps}")
        if self.batch_size < 0:
            raise ValueError(f"batch-size must be at least 1 (or 0: chosen for the data), not {self.batch_size}")
        if self.round_timeout <= 0:
            raise ValueError(f"round-timeout must be positive, not {self.round_timeout}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip-grad-norm must be positive, not {self.clip_grad_norm}")
        if not 1 <= self.accumulate <= (self.batch_size or DENSE_BATCH):
            raise ValueError(f"accumulate must be in [1, batch-size], not {self.accumulate}")
        if self.compress is not None:
            Scheme.parse(self.compress)  # a ValueError that names the flag and what it takes
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.embedding_dim < 1 or self.table_size < 0 or self.table_capacity < 0:
            raise ValueError("embedding-dim must be at least 1, and table-size and table-capacity 0 or more")
        if not self.follow_poll_seconds > 0 or self.follow_stop_when_idle < 0:
            raise ValueError("follow-poll-seconds must be positive and follow-stop-when-idle 0 or more")
        check_loss_spec(self.loss)
        if self.train_step is not None:
            check_step_spec(self.train_step)
            if self.loss != "auto":
                raise ValueError(f"--train-step computes its own loss: leave --loss auto, not {self.loss!r}")

    def for_data(self, click_logs: bool) -> TrainConfig:
        """This config with its batch size chosen for the data where none was given (0)."""
        if self.batch_size:
            return self
        return replace(self, batch_size=CLICK_BATCH if click_logs else DENSE_BATCH)

    def tables(self) -> TableOptions:
        """The click model's table options these flags set."""
        return TableOptions(
            dim=self.embedding_dim,
            table_size=self.table_size,
            optimizer=self.table_optimizer,
            lr=self.table_lr,
            admit_after=self.admit_after,
            evict_after_versions=self.evict_after_versions,
            capacity=self.table_capacity,
        )


# Set by ps-worker --nproc in each process it starts: their output files are numbered already (-0, -1, ...: each
# process's place on the host).
NUMBERED_ENV = "PS_WORKER_OUTPUT_NUMBERED"


def numbered(path: str, i: int) -> str:
    """`path` with -i before its extension (m.json: m-1.json)."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{i}{p.suffix}"))


def metrics_path(path: str, rank: int, world_size: int) -> str:
    """Where a worker writes --metrics-out `path`: `path` itself in a job of one worker, and for a process of
    ps-worker --nproc (its launcher numbered it); else -RANK before the extension, so that workers given one path
    keep every rank's summary."""
    if world_size <= 1 or os.environ.get(NUMBERED_ENV):
        return path
    return numbered(path, rank)
