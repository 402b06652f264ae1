"""Raw frames over a shard's data socket (the one-shard job of support/raw_job.py): tickets, connections that
said their hello, replies read."""

from __future__ import annotations

import contextlib
import secrets
import ssl
from collections.abc import Iterator

import grpc
import numpy as np
import torch

from paramserver.shard.state import Shard
from paramserver.v1 import ps_pb2
from support.raw_job import CALL_TIMEOUT, OK_BYTE, RAW_CONFIG, WORKER, Bell, Raw, error

MALFORMED = (grpc.StatusCode.INVALID_ARGUMENT.value[0], "MalformedStream")  # (status byte, error type)
GRAD = (np.arange(15, dtype=np.float32) - 7) / 4  # a gradient of the raw job's model, exact in bf16


def hello(worker_id: str, shard: Shard, **changes: object) -> ps_pb2.AttachRequest:
    """A data-socket Attach (and hello) for `shard`'s model with a fresh 16-byte nonce, as a PSClient sends it."""
    assert shard.model is not None
    fields: dict[str, object] = {
        "nonce": secrets.token_bytes(16),
        "elements": shard.model.numel,
        "model_digest": shard.model.digest,
        **changes,
    }
    if "name" in fields:  # a segment's name instead of the data-socket kind
        return ps_pb2.AttachRequest(
            worker_id=worker_id, shared_memory=ps_pb2.SharedMemory(name=str(fields.pop("name"))), **fields
        )
    return ps_pb2.AttachRequest(worker_id=worker_id, data_socket=ps_pb2.DataSocket(), **fields)


def ticket(raw: Raw, worker_id: str = WORKER, **changes: object) -> ps_pb2.AttachRequest:
    """A data-socket Attach for the raw job's shard."""
    return hello(worker_id, raw.shard, **changes)


def attach(raw: Raw, request: ps_pb2.AttachRequest) -> int:
    """Attach by gRPC; the data port the shard answers."""
    return raw.stub.Attach(request, timeout=CALL_TIMEOUT).data_port


def port(raw: Raw) -> tuple[str, int]:
    """The raw job's data socket address."""
    data_port = raw.cluster.servers[0].data_port
    assert data_port, "the shard serves no data socket"
    return "127.0.0.1", data_port


@contextlib.contextmanager
def bell(address: tuple[str, int], tls: ssl.SSLContext | None = None) -> Iterator[Bell]:
    """A raw connection to a data socket (in TLS with `tls`), closed afterwards."""
    connection = Bell(address)
    try:
        if tls is not None:
            connection.sock = tls.wrap_socket(connection.sock, server_hostname=address[0])
        yield connection
    finally:
        connection.close()


@contextlib.contextmanager
def session(raw: Raw, request: ps_pb2.AttachRequest | None = None) -> Iterator[Bell]:
    """A data-socket connection that said its hello (attaching a new ticket for WORKER unless one is given)."""
    if request is None:
        request = ticket(raw)
        attach(raw, request)
    with bell(port(raw)) as connection:
        assert connection.call(request) == bytes([OK_BYTE]), "the shard refused a good hello"
        yield connection


def ok(body: bytes) -> ps_pb2.ExchangeResponse:
    """A successful reply's message (AssertionError naming the error otherwise)."""
    assert body[0] == OK_BYTE, error(body)
    return ps_pb2.ExchangeResponse.FromString(body[1:])


def f32(values: np.ndarray) -> bytes:
    """The values as a float32 payload."""
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def sgd(params: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """The raw job's SGD step on `params`, computed here."""
    return torch.from_numpy(params.copy()).add_(torch.from_numpy(grad), alpha=-RAW_CONFIG.lr).numpy()
