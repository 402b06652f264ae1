"""A one-shard job reached by raw gRPC stub and raw frames, for what a well-behaved PSClient never sends.

`raw_job` starts it (the `raw` fixture in tests/conftest.py): an async shard holding `small_model()`, WORKER and
OTHER joined, none attached. `Bell` speaks the frames of paramserver/wire/frames.py by hand, to a shard's doorbell
or its data socket; `error` reads a refused frame's reply.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from paramserver.config import ServerConfig
from paramserver.errors import ERROR_KEY
from paramserver.server.cluster import LocalCluster
from paramserver.shard.state import Shard
from paramserver.transport import shm
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import frames
from worker.client import PSClient

CALL_TIMEOUT = 5.0  # seconds for any call expected to answer at once
JOB = "shm-test"
WORKER = "worker-a"
OTHER = "worker-b"
OK_BYTE = 0  # a reply frame's first byte when the request succeeded (else its gRPC status code's value)
REQUEST_HEAD = struct.Struct("<IdQ")  # message length, timeout, payload length
REPLY_HEAD = struct.Struct("<IQ")  # body length, payload length

# Async, so a push applies at once whoever else is joined (two workers may hold segments side by side).
RAW_CONFIG = ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.5, job_name=JOB)


def small_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A 15-element model: a 4 x 3 weight and a bias."""
    gen = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(4, 3, generator=gen), "fc.bias": torch.randn(3, generator=gen)}


def refusal(err: grpc.RpcError) -> tuple[grpc.StatusCode, str | None]:
    """A refused call's status code and the error type the shard named (paramserver/errors.py)."""
    return err.code(), dict(err.trailing_metadata() or ()).get(ERROR_KEY)


@dataclass
class Raw:
    """A one-shard job holding `small_model()`, WORKER and OTHER joined by raw stub, none attached yet."""

    cluster: LocalCluster
    stub: ps_pb2_grpc.ParameterServerStub
    digest: str
    elements: int
    tmp: Path
    segments: list[shm.Segment] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)  # closed after the test
    never_open: list[str] = field(default_factory=list)  # paths the shard must refuse without opening them

    @property
    def shard(self) -> Shard:
        return self.cluster.shards[0]

    def segment(self, elements: int | None = None) -> shm.Segment:
        """A new segment sized for this shard (or `elements`); closed after the test."""
        seg = shm.Segment.create(self.elements if elements is None else elements)
        self.segments.append(seg)
        return seg

    def offer(self, fd: int) -> str:
        """The "<pid>/<fd>" name of an fd of this process (closed after the test)."""
        self.fds.append(fd)
        return f"{os.getpid()}/{fd}"

    def hello(self, seg: shm.Segment, worker_id: str = WORKER, **changes: object) -> ps_pb2.AttachRequest:
        fields: dict[str, object] = {
            "worker_id": worker_id,
            "shared_memory": ps_pb2.SharedMemory(name=seg.name),
            "nonce": seg.nonce,
            "elements": seg.elements,
            "model_digest": self.digest,
        }
        fields.update(changes)
        if "name" in fields:  # the segment's name, in the oneof
            fields["shared_memory"] = ps_pb2.SharedMemory(name=str(fields.pop("name")))
        return ps_pb2.AttachRequest(**fields)

    def attach(self, seg: shm.Segment, worker_id: str = WORKER, **changes: object) -> ps_pb2.AttachResponse:
        return self.stub.Attach(self.hello(seg, worker_id, **changes), timeout=CALL_TIMEOUT)

    def request(self, worker_id: str = WORKER, **fields: object) -> ps_pb2.ExchangeRequest:
        return ps_pb2.ExchangeRequest(worker_id=worker_id, model_digest=self.digest, **fields)

    def exchange(self, worker_id: str = WORKER, **fields: object) -> ps_pb2.ExchangeResponse:
        return self.stub.Exchange(self.request(worker_id, **fields), timeout=CALL_TIMEOUT)

    def refused(self, call: Callable[[], object]) -> tuple[grpc.StatusCode, str | None, str]:
        with pytest.raises(grpc.RpcError) as info:
            call()
        code, name = refusal(info.value)
        return code, name, info.value.details() or ""

    def params(self) -> np.ndarray:
        model = self.shard.model
        assert model is not None
        return model.params.numpy().copy()


@contextlib.contextmanager
def raw_job(cluster_factory: Callable[..., LocalCluster], tmp: Path) -> Iterator[Raw]:
    """Start the one-shard job (`cluster_factory`: the ps_cluster_factory fixture, which stops it); close every
    segment and fd the test made afterwards."""
    cluster = cluster_factory(RAW_CONFIG, shards=1)
    model = small_model()
    # A client on streams only registers the model and leaves: no segment of its own on the shard.
    with PSClient(cluster.address, worker_id="registrar", job_name=JOB, shared_memory=False) as client:
        client.register(model)
        digest = client.digest(model)
    channel = grpc.insecure_channel(cluster.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    for worker in (WORKER, OTHER):
        stub.Join(ps_pb2.JoinRequest(worker_id=worker, job_name=JOB), timeout=CALL_TIMEOUT, wait_for_ready=True)
    env = Raw(cluster, stub, digest, 15, tmp)
    assert cluster.shards[0].model is not None and cluster.shards[0].model.numel == env.elements
    try:
        yield env
    finally:
        channel.close()
        for fd in env.fds:
            os.close(fd)
        for seg in env.segments:
            seg.close()


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly `n` bytes from `sock`, or None when the peer closed or reset the connection first."""
    buf = b""
    while len(buf) < n:
        try:
            part = sock.recv(n - len(buf))
        except ConnectionResetError:
            return None
        if not part:
            return None
        buf += part
    return buf


class Bell:
    """A connection to a shard's doorbell (an abstract Unix socket name) or data socket ((host, port)) speaking the
    frames of paramserver/wire/frames.py by hand."""

    def __init__(self, address: str | tuple[str, int]) -> None:
        if isinstance(address, str):
            assert address.startswith("\0"), "the doorbell is an abstract socket name"
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(CALL_TIMEOUT + 5)
        self.sock.connect(address)
        self.payload = b""  # the payload of the last reply

    def send(
        self,
        message: ps_pb2.AttachRequest | ps_pb2.ExchangeRequest,
        timeout: float = CALL_TIMEOUT,
        payload: bytes = b"",
    ) -> None:
        body = message.SerializeToString()
        head = REQUEST_HEAD.pack(len(body), timeout, len(payload)) + body
        self.sock.sendall(head + payload + frames.end_of(head))

    def reply(self) -> bytes | None:
        """One reply frame's body (its payload kept in self.payload), or None when the shard closed the
        connection."""
        head = recv_exact(self.sock, REPLY_HEAD.size)
        if head is None:
            return None
        length, size = REPLY_HEAD.unpack(head)
        body = recv_exact(self.sock, length)
        assert body is not None, "a reply frame was cut off"
        payload = recv_exact(self.sock, size) if size else b""
        assert payload is not None, "a reply payload was cut off"
        self.payload = payload
        assert recv_exact(self.sock, frames.END.size) == frames.end_of(head + body), "a reply's end is wrong"
        return body

    def call(
        self,
        message: ps_pb2.AttachRequest | ps_pb2.ExchangeRequest,
        timeout: float = CALL_TIMEOUT,
        payload: bytes = b"",
    ) -> bytes:
        self.send(message, timeout, payload)
        body = self.reply()
        assert body is not None, "the shard closed the connection instead of answering"
        return body

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def error(body: bytes) -> tuple[int, str, str]:
    """(status byte, error type name, message) of an error reply."""
    assert body[0] != OK_BYTE, f"expected an error reply, got OK: {body!r}"
    n = body[1]
    return body[0], body[2 : 2 + n].decode(), body[2 + n :].decode()
