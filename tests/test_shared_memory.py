"""The same-host fast path: shared-memory segments (Attach) and Exchange calls, by gRPC and by the doorbell.

Real shards on 127.0.0.1 (threads, and processes where a shard must restart or may die), real segments (sealed
memfds, offered as "<pid>/<fd>" and opened by the shard through /proc), raw stubs and raw Unix sockets for what a
well-behaved PSClient never sends. Every refusal must carry the status and error type of the table in
paramserver/errors.py and leave the shard exactly as it was. "Nothing left behind" means: no fd and no mapping of
a segment's memfd (/proc/self/fd, /proc/self/maps) outlives its users.
"""

from __future__ import annotations

import fcntl
import gc
import os
import secrets
import signal
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from support.models import big_model, clone, like
from support.raw_job import (
    CALL_TIMEOUT,
    JOB,
    OK_BYTE,
    OTHER,
    RAW_CONFIG,
    REQUEST_HEAD,
    WORKER,
    Bell,
    Raw,
    error,
    refusal,
    small_model,
)
from support.references import local_sgd
from support.waiting import wait_for

from paramserver.config import ServerConfig
from paramserver.errors import NonFiniteGradient, NotAttached
from paramserver.placement import SLICE_ELEMENTS, TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.server.shard_server import ShardServer
from paramserver.transport import shm
from paramserver.transport.socket_client import FrameClient
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire.frames import MAX_FRAME
from worker.client import PSClient
from worker.client.transports import SharedMemory

pytestmark = [
    pytest.mark.skipif(not shm.available(), reason="no memfd or /proc on this host"),
    pytest.mark.timeout(60),
]

FP = grpc.StatusCode.FAILED_PRECONDITION
PERMISSION_DENIED_BYTE = grpc.StatusCode.PERMISSION_DENIED.value[0]
DEADLINE_EXCEEDED_BYTE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
GARBAGE = b"\x0a\x05ab"  # field 1, length 5, but only 2 bytes follow: no valid protobuf message
_U32 = struct.Struct("<I")
HEADER = struct.Struct("<8s16sQ")  # magic, nonce, elements: the layout of AttachRequest in ps.proto
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
SEGMENT_LINK = "/memfd:paramserver-segment"  # how /proc shows a segment's memfd (followed by " (deleted)")


# -- helpers ------------------------------------------------------------------------------------------------------


def _fds(pid: int | str = "self") -> Counter[int]:
    """Inode -> number of open fds, for every segment memfd a process has open. Besides the creator's own fd,
    each live mapping accounts for one: CPython's mmap keeps a dup of the fd it maps until it is closed."""
    gc.collect()  # a dropped Segment unmaps (and closes that dup) when it is collected
    out: Counter[int] = Counter()
    for entry in os.listdir(f"/proc/{pid}/fd"):
        link = f"/proc/{pid}/fd/{entry}"
        try:
            if os.readlink(link).startswith(SEGMENT_LINK):
                out[os.stat(link).st_ino] += 1
        except OSError:
            pass  # closed meanwhile (the listing's own fd among others)
    return out


def _mapped(pid: int | str = "self") -> Counter[int]:
    """Inode -> number of mappings, for every segment memfd a process has mapped."""
    gc.collect()  # a dropped Segment unmaps when it is collected
    out: Counter[int] = Counter()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(SEGMENT_LINK):
                out[int(parts[4])] += 1
    return out


def _pid_fd(seg: shm.Segment) -> tuple[int, int]:
    pid, fd = seg.name.split("/")
    return int(pid), int(fd)


def _inode(seg: shm.Segment) -> int:
    """The inode of a live segment's memfd (through its creator's fd)."""
    pid, fd = _pid_fd(seg)
    path = f"/proc/{pid}/fd/{fd}"
    assert os.readlink(path).startswith(SEGMENT_LINK), path
    return os.stat(path).st_ino


def _holds(fd: int, inode: int) -> bool:
    """Whether this process's fd `fd` is (still) the segment memfd `inode`; False once it was closed, also when
    the number was reused for something else."""
    path = f"/proc/self/fd/{fd}"
    try:
        return os.readlink(path).startswith(SEGMENT_LINK) and os.stat(path).st_ino == inode
    except OSError:
        return False


def _gone(inode: int) -> bool:
    """No fd and no mapping of this segment memfd is left in this process."""
    return inode not in _fds() and inode not in _mapped()


def _accounted(inodes: Iterable[int]) -> bool:
    """No fd of these live segments leaked: at most the creator's and one per mapping (see `_fds`)."""
    fds, maps = _fds(), _mapped()
    return all(fds[i] <= 1 + maps[i] for i in inodes)


def _eventually(probe: Callable[[], bool], what: str | Callable[[], str]) -> None:
    """Wait for `probe`, garbage collecting before each try (a dropped segment's mapping goes with its object)."""
    wait_for(lambda: gc.collect() >= 0 and probe(), 30, what, 0.05)


def _uses_shm(client: PSClient) -> bool:
    return all(isinstance(link.transport, SharedMemory) and link.transport.doorbell for link in client.links)


def _uses_streams(client: PSClient) -> bool:
    return all(link.transport.kind == "gRPC" for link in client.links)


def _segments(client: PSClient) -> list[shm.Segment]:
    """Each shard's attached segment (every shard on shared memory)."""
    out = []
    for link in client.links:
        assert isinstance(link.transport, SharedMemory), link.transport.kind
        out.append(link.transport.segment)
    return out


def _doorbells(client: PSClient) -> list[FrameClient]:
    """Each shard's doorbell connection (every shard on shared memory, with a doorbell)."""
    out = []
    for link in client.links:
        assert isinstance(link.transport, SharedMemory) and link.transport.doorbell is not None
        out.append(link.transport.doorbell)
    return out


# -- 1. the same training both ways ---------------------------------------------------------------------------------


def _train(client: PSClient, model: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """register / push / pull / push_pull on `model`; return the weights after each pull."""
    seen = []
    assert client.register(model) == 0
    seen.append(clone(model))
    assert client.push(like(model, 1)) == 1
    assert client.pull(model) == 1
    seen.append(clone(model))
    g = like(model, 2)
    assert client.push_pull(g) == 2  # pushes g, then pulls the weights into it
    seen.append(clone(g))
    assert client.pull(model) == 2
    seen.append(clone(model))
    g = like(model, 3)
    g["big"][0, 0] = 1e6  # an outlier on shard 0's slice, one on shard 1's
    g["big"][-1, -1] = -1e6
    assert client.push_pull(g) == 3
    seen.append(clone(g))
    assert client.pull(model) == 3
    seen.append(clone(model))
    return seen


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_shared_memory_data_socket_and_streams_train_to_bit_identical_weights(
    ps_cluster_factory: Callable[..., LocalCluster], optimizer: str
) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer=optimizer, lr=0.05, weight_decay=0.01, job_name=JOB)
    fast = ps_cluster_factory(config, shards=2)
    slow = ps_cluster_factory(config, shards=2)
    remote = ps_cluster_factory(config, shards=2)
    with (
        PSClient(fast.address, job_name=JOB) as a,
        PSClient(slow.address, job_name=JOB, shared_memory=False, data_socket=False) as b,
        PSClient(remote.address, job_name=JOB, shared_memory=False) as c,
    ):
        runs = [_train(a, big_model()), _train(b, big_model()), _train(c, big_model())]
        assert _uses_shm(a), "the shared-memory client never attached a segment or doorbell to every shard"
        assert all(link.fallback is None for link in a.links)
        assert _uses_streams(b) and b.shared_memory is False
        assert all(link.transport.kind == "data socket" for link in c.links)
        # The shards know the shm client's segments (the very ones it created), the streams client has none.
        for k, shard in enumerate(fast.shards):
            assert shard.attachments.segment(a.worker_id, shard.model).nonce == _segments(a)[k].nonce
        for shard in slow.shards:
            with pytest.raises(NotAttached):
                shard.attachments.segment(b.worker_id, shard.model)
    assert [s.model.numel for s in fast.shards] == [s.model.numel for s in slow.shards]
    assert min(s.model.numel for s in fast.shards) > SLICE_ELEMENTS // 2, "the big tensor is sliced over both"
    for step, (x, y, z) in enumerate(zip(*runs, strict=True)):
        for name in x:
            assert torch.equal(x[name], y[name]), f"{name} differs after step {step} ({optimizer})"
            assert torch.equal(x[name], z[name]), f"{name} differs after step {step} ({optimizer}, data socket)"
            assert torch.isfinite(x[name]).all()
    assert not torch.equal(runs[0][0]["big"], runs[0][-1]["big"]), "training changed nothing"
    # Weights, optimizer state and version, byte for byte on each shard.
    assert [s.state_bytes() for s in fast.shards] == [s.state_bytes() for s in slow.shards]
    assert [s.state_bytes() for s in fast.shards] == [s.state_bytes() for s in remote.shards]


# -- 2. a shard without shared memory --------------------------------------------------------------------------------


def test_shard_with_shared_memory_disabled_gets_streams_and_no_segment_stays(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    lr = 0.5
    config = ServerConfig(
        mode="sync", workers=1, optimizer="sgd", lr=lr, shared_memory=False, data_socket=False, job_name=JOB
    )
    cluster = ps_cluster_factory(config, shards=2)
    assert [s.servicer.doorbell for s in cluster.servers] == ["", ""]
    assert [s.data_port for s in cluster.servers] == [0, 0]
    before, mapped = _fds(), _mapped()
    model = big_model()
    start = clone(model)
    grads = [like(model, 1), like(model, 2)]
    with PSClient(cluster.address, job_name=JOB) as client:
        assert client.shared_memory, "the client offers shared memory; the shards refuse it"
        client.register(model)
        client.push(grads[0])
        client.pull(model)
        g = clone(grads[1])
        assert client.push_pull(g) == 2
        assert all(link.fallback is not None for link in client.links)
        assert _uses_streams(client)
        _eventually(lambda: _fds() == before, "the refused segment's memfd to close")
        _eventually(lambda: _mapped() == mapped, "the refused segment's mapping to go")
    expected = local_sgd(start, grads, lr)
    for name, value in expected.items():
        assert torch.equal(g[name], value), name
    # A raw offer is refused with the error type that sends the client to the streams.
    seg = shm.Segment.create(cluster.shards[0].model.numel)
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT)
            request = ps_pb2.AttachRequest(
                worker_id=WORKER,
                shared_memory=ps_pb2.SharedMemory(name=seg.name),
                nonce=seg.nonce,
                elements=seg.elements,
                model_digest=cluster.shards[0].model.digest,
            )
            with pytest.raises(grpc.RpcError) as info:
                stub.Attach(request, timeout=CALL_TIMEOUT)
        assert refusal(info.value) == (FP, "SharedMemoryUnavailable")
        assert "disabled" in (info.value.details() or "")
    finally:
        seg.close()
    _eventually(lambda: _fds() == before, "the refused segment's memfd to close")
    _eventually(lambda: _mapped() == mapped, "no mapping of the refused segment")


# -- 3. the segment itself, and nothing left behind ------------------------------------------------------------------


def test_segment_layout_and_seals() -> None:
    before, mapped = _fds(), _mapped()
    seg = shm.Segment.create(5)
    pid, fd = _pid_fd(seg)
    size = 4096 + 8 * 5
    path = f"/proc/self/fd/{fd}"
    try:
        assert pid == os.getpid() and shm.Segment.size(5) == size
        assert os.readlink(path).startswith(SEGMENT_LINK), "a segment is a memfd, not a file anywhere"
        inode = _inode(seg)
        assert _holds(fd, inode) and set(_fds()) == set(before) | {inode}
        assert _mapped() == mapped + Counter({inode: 1})
        assert _accounted([inode])
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read()
        assert stat.S_ISREG(st.st_mode) and st.st_ino == inode
        assert st.st_size == size == len(data)
        assert HEADER.unpack_from(data) == (b"PSSHM001", seg.nonce, 5) and len(seg.nonce) == 16
        assert not any(data[HEADER.size : 4096]), "the rest of the header page is zero"
        # Sealed against shrinking and growing, and against any change of the seals; not against writes.
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
        for length in (0, size - 1, size + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, length)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(fd).st_size == size
        seg.grad[:] = np.arange(5, dtype=np.float32)
        seg.weights[:] = -np.arange(5, dtype=np.float32)
        with open(path, "rb") as f:
            data = f.read()
        assert np.array_equal(np.frombuffer(data, "<f4", 5, 4096), np.arange(5, dtype=np.float32))
        assert np.array_equal(np.frombuffer(data, "<f4", 5, 4096 + 20), -np.arange(5, dtype=np.float32))
        # The shard's side maps the same memory, and keeps no fd but its mapping's.
        other = shm.Segment.open(seg.name, seg.nonce, 5)
        assert _mapped() == mapped + Counter({inode: 2})
        assert set(_fds()) == set(before) | {inode} and _accounted([inode])
        other.weights[2] = 42.0
        assert seg.weights[2] == 42.0
        assert np.array_equal(other.grad, np.arange(5, dtype=np.float32))
        other.close()
        assert _holds(fd, inode), "closing the shard's side closed the creator's memfd"
    finally:
        seg.close()
    assert not _holds(fd, inode), "Segment.close left the creator's memfd open"
    _eventually(lambda: _fds() == before, "the closed segment's memfd to close")
    _eventually(lambda: _mapped() == mapped, "the closed segment's mapping to go")
    assert _gone(inode)


def test_no_segment_outlives_its_client(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1), shards=2)
    before, mapped = _fds(), _mapped()
    model = small_model()
    client = PSClient(cluster.address)
    try:
        client.register(model)  # attaches on every shard (the pull)
        assert _uses_shm(client)
        fds = {_pid_fd(s)[1]: _inode(s) for s in _segments(client)}
        assert len(fds) == 2 and all(_pid_fd(s)[0] == os.getpid() for s in _segments(client))
        assert all(_holds(fd, inode) for fd, inode in fds.items())
        assert set(_fds()) == set(before) | set(fds.values())
        # Both sides map each segment: the client, and the shard it was attached to (a thread here); no fd leaked.
        assert _mapped() == mapped + Counter({inode: 2 for inode in fds.values()})
        assert _accounted(fds.values())
        client.push_pull(like(model, 1))
        assert set(_fds()) == set(before) | set(fds.values()) and _accounted(fds.values())
    finally:
        client.close()
    assert not any(_holds(fd, inode) for fd, inode in fds.items()), "the client left a memfd open"
    _eventually(lambda: _fds() == before, lambda: f"every fd to close (still open: {_fds() - before})")
    # The client unmapped its segments, and the shards dropped theirs when the worker left.
    _eventually(lambda: _mapped() == mapped, lambda: f"every mapping to go (still mapped: {_mapped() - mapped})")
    assert all(_gone(inode) for inode in fds.values())


# -- 4. NaN and Inf through shared memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_gradient_through_shared_memory_is_refused_and_changes_nothing(
    ps_cluster_factory: Callable[..., LocalCluster], bad: float
) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="adam", lr=0.01, job_name=JOB)
    cluster = ps_cluster_factory(config, shards=2)
    model = big_model()
    with PSClient(cluster.address, job_name=JOB, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        assert client.push_pull(like(model, 1)) == 1  # Adam's state exists now
        client.pull(model)
        assert _uses_shm(client)
        before = [s.state_bytes() for s in cluster.shards]
        g = like(model, 2)
        g["big"][0, 5] = bad  # on shard 0's slice
        g["big"][-1, 5] = bad  # on shard 1's slice
        with pytest.raises(NonFiniteGradient) as info:
            client.push(g)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "big" in str(info.value) and "NaN or Inf" in str(info.value)
        assert [s.state_bytes() for s in cluster.shards] == before
        # A good push afterwards applies as the next round, still through shared memory.
        g = like(model, 3)
        assert client.push_pull(g) == 2
        assert _uses_shm(client)
        assert [s.version for s in cluster.shards] == [2, 2]
    # What the shm client pulled is what a reader on the streams pulls: the shards' weights, all finite.
    with PSClient(cluster.address, job_name=JOB, join=False) as reader:
        check = clone(model)
        assert reader.pull(check) == 2
        assert _uses_streams(reader)
    for name, value in g.items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, check[name]), name


# -- 5. Attach refusals ------------------------------------------------------------------------------------------------


def _attach_cases() -> list[object]:
    Make = Callable[[Raw, shm.Segment], ps_pb2.AttachRequest]

    def named(name: Callable[[shm.Segment], str]) -> Make:
        return lambda env, seg: env.hello(seg, name=name(seg))

    def fake(env: Raw, seg: shm.Segment, fd: int) -> ps_pb2.AttachRequest:
        """`fd` filled like the segment (size, header with its nonce), offered in its place."""
        os.ftruncate(fd, shm.Segment.size(seg.elements))
        os.pwrite(fd, HEADER.pack(b"PSSHM001", seg.nonce, seg.elements), 0)
        return env.hello(seg, name=env.offer(fd))

    def regular_file(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        return fake(env, seg, os.open(env.tmp / "segment", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))

    def unsealed_memfd(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        return fake(env, seg, os.memfd_create("paramserver-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))

    def unsealable_memfd(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        return fake(env, seg, os.memfd_create("paramserver-segment", os.MFD_CLOEXEC))

    def half_sealed_memfd(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        # Cannot shrink, but may still grow, and further seals may still be added.
        fd = os.memfd_create("paramserver-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        request = fake(env, seg, fd)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return request

    def pipe(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        r, w = os.pipe()
        env.offer(w)
        env.never_open.append(f"/proc/{os.getpid()}/fd/{r}")
        return env.hello(seg, name=env.offer(r))

    def char_device(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        env.never_open.append(f"/proc/{os.getpid()}/fd/{fd}")
        return env.hello(seg, name=env.offer(fd))

    def wrong_size(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        # A real sealed segment, but of 16 elements per region offered as one of 15.
        big = env.segment(seg.elements + 1)
        env.never_open.append(f"/proc/{os.getpid()}/fd/{_pid_fd(big)[1]}")
        return env.hello(seg, name=big.name, nonce=big.nonce)

    def no_such_pid(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        return env.hello(seg, name=f"999999999/{_pid_fd(seg)[1]}")  # above any pid_max

    def no_such_fd(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        with pytest.raises(OSError):
            os.fstat(999999999)
        return env.hello(seg, name=f"{os.getpid()}/999999999")

    def wrong_nonce(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        return env.hello(seg, nonce=secrets.token_bytes(16))

    def short_nonce(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        return env.hello(seg, nonce=seg.nonce[:8])

    def wrong_elements(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        return env.hello(seg, elements=seg.elements + 1)

    def never_joined(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        return env.hello(seg, worker_id="stranger")

    def other_model(env: Raw, seg: shm.Segment) -> ps_pb2.AttachRequest:
        return env.hello(seg, model_digest="0" * 64)

    not_a_name = "is not a segment name"
    unsealed = "is not a sealed segment"
    not_a_segment = "is not a segment sized for 15 elements"
    inv, abt, smu = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ABORTED, "SharedMemoryUnavailable"
    cases: list[tuple[str, Make, grpc.StatusCode, str, str]] = [
        ("name-abc", named(lambda seg: "abc"), FP, smu, not_a_name),
        ("name-empty", named(lambda seg: ""), FP, smu, not_a_name),
        ("name-dotdot", named(lambda seg: "../x"), FP, smu, not_a_name),
        ("name-dev-shm", named(lambda seg: "/dev/shm/x"), FP, smu, not_a_name),
        ("name-three-parts", named(lambda seg: "1/2/3"), FP, smu, not_a_name),
        ("name-pid-0", named(lambda seg: "0/3"), FP, smu, not_a_name),
        ("name-negative-pid", named(lambda seg: f"-{seg.name}"), FP, smu, not_a_name),
        ("name-self", named(lambda seg: f"self/{_pid_fd(seg)[1]}"), FP, smu, not_a_name),
        ("name-proc-path", named(lambda seg: f"/proc/{seg.name.replace('/', '/fd/')}"), FP, smu, not_a_name),
        ("name-newline", named(lambda seg: f"{seg.name}\n"), FP, smu, not_a_name),
        ("no-such-pid", no_such_pid, FP, smu, "cannot open"),
        ("no-such-fd", no_such_fd, FP, smu, "cannot open"),
        ("regular-file", regular_file, FP, smu, unsealed),
        ("unsealed-memfd", unsealed_memfd, FP, smu, unsealed),
        ("unsealable-memfd", unsealable_memfd, FP, smu, unsealed),
        ("half-sealed-memfd", half_sealed_memfd, FP, smu, unsealed),
        ("pipe", pipe, FP, smu, not_a_segment),
        ("char-device", char_device, FP, smu, not_a_segment),
        ("wrong-size", wrong_size, FP, smu, not_a_segment),
        ("wrong-nonce", wrong_nonce, FP, smu, "another nonce"),
        ("short-nonce", short_nonce, FP, smu, "16 bytes"),
        ("wrong-elements", wrong_elements, inv, "InvalidArgument", "16 elements"),
        ("never-joined", never_joined, abt, "UnknownWorker", "stranger"),
        ("other-model", other_model, FP, "ModelMismatch", "000000000000"),
    ]
    return [pytest.param(*c[1:], id=c[0]) for c in cases]


@pytest.mark.parametrize(("make", "code", "kind", "detail"), _attach_cases())
def test_bad_attach_is_refused_and_attaches_nothing(
    raw: Raw,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[Raw, shm.Segment], ps_pb2.AttachRequest],
    code: grpc.StatusCode,
    kind: str,
    detail: str,
) -> None:
    seg = raw.segment()
    request = make(raw, seg)
    before, mapped = raw.shard.state_bytes(), _mapped()
    opened: list[str] = []  # what this process (the shard is a thread of it) opens by path meanwhile
    real_open = os.open

    def spy(path: object, *args: object, **kwargs: object) -> int:
        opened.append(os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else repr(path))
        return real_open(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", spy)
        got = raw.refused(lambda: raw.stub.Attach(request, timeout=CALL_TIMEOUT))

    assert got[:2] == (code, kind), got
    assert detail in got[2], got
    assert raw.shard.state_bytes() == before
    assert not set(raw.never_open) & set(opened), f"the shard opened {raw.never_open} before refusing it"
    _eventually(lambda: _mapped() == mapped, "the shard to drop its mapping of what it refused")
    # Nothing was attached for the worker: an Exchange still finds no segment.
    assert raw.refused(lambda: raw.exchange(pull=True))[:2] == (FP, "NotAttached")
    # The same segment, offered properly, is taken (the refusal was for the one thing changed).
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", spy)
        assert raw.attach(seg).doorbell.startswith("\0paramserver-")
    assert f"/proc/{seg.name.replace('/', '/fd/')}" in opened, "the spy on os.open saw nothing"
    reply = raw.exchange(pull=True)
    assert reply.pulled.version == 0 and reply.pulled.model_digest == raw.digest
    assert np.array_equal(seg.weights, raw.params())
    assert _mapped()[_inode(seg)] == 2, "the worker's mapping and the shard's"


# -- 6. Exchange needs an attached segment; leaving or eviction drops it ---------------------------------------------


def test_exchange_through_an_attached_segment_by_grpc(raw: Raw) -> None:
    seg = raw.segment()
    raw.attach(seg)
    w0 = raw.params()
    grad = np.linspace(-1, 1, raw.elements, dtype=np.float32)
    seg.grad[:] = grad
    seg.weights[:] = np.nan  # the shard must overwrite every element

    reply = raw.exchange(push=True, step=1, base_version=0, pull=True, min_version=1)

    assert (reply.version, reply.applied, reply.pulled.version) == (1, True, 1)
    assert reply.pulled.incarnation == raw.shard.incarnation
    expected = torch.from_numpy(w0).add_(torch.from_numpy(grad), alpha=-RAW_CONFIG.lr).numpy()
    assert np.array_equal(seg.weights, expected)
    assert np.array_equal(raw.params(), expected)
    # The same step again is a retry: taken once, not applied again.
    again = raw.exchange(push=True, step=1, base_version=0)
    assert (again.version, again.applied) == (1, False)
    assert raw.shard.version == 1


def test_exchange_without_a_segment_is_not_attached_and_changes_nothing(raw: Raw) -> None:
    before = raw.shard.state_bytes()
    for fields in ({"pull": True}, {"push": True, "step": 1}, {"push": True, "pull": True, "step": 1}):
        code, kind, detail = raw.refused(lambda f=fields: raw.exchange(**f))
        assert (code, kind) == (FP, "NotAttached"), fields
        assert WORKER in detail
    # OTHER's segment is OTHER's: WORKER still has none.
    raw.attach(raw.segment(), OTHER)
    assert raw.refused(lambda: raw.exchange(push=True, step=1))[:2] == (FP, "NotAttached")
    assert raw.shard.state_bytes() == before


@pytest.mark.parametrize("how", ["leave", "evict"])
def test_a_worker_that_goes_loses_its_segment(raw: Raw, how: str) -> None:
    seg = raw.segment()
    raw.attach(seg)
    assert raw.exchange(pull=True).pulled.version == 0
    if how == "leave":
        raw.stub.Leave(ps_pb2.LeaveRequest(worker_id=WORKER), timeout=CALL_TIMEOUT)
    else:
        raw.shard.tick(now=time.monotonic() + 10 * RAW_CONFIG.lease_timeout)
        assert raw.shard.describe().stats.evictions == 2
    before = raw.shard.state_bytes()

    assert raw.refused(lambda: raw.exchange(pull=True))[:2] == (grpc.StatusCode.ABORTED, "UnknownWorker")
    assert raw.refused(lambda: raw.exchange(push=True, step=1))[:2] == (grpc.StatusCode.ABORTED, "UnknownWorker")
    # Back in the job, the worker must attach again: its old segment was dropped with it.
    raw.stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT)
    assert raw.refused(lambda: raw.exchange(push=True, step=1))[:2] == (FP, "NotAttached")
    assert raw.shard.state_bytes() == before
    raw.attach(seg)
    assert raw.exchange(pull=True).pulled.version == 0


def test_exchange_for_another_model_is_model_mismatch(raw: Raw) -> None:
    raw.attach(raw.segment())
    before = raw.shard.state_bytes()
    request = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest="0" * 64, push=True, step=1, pull=True)
    assert raw.refused(lambda: raw.stub.Exchange(request, timeout=CALL_TIMEOUT))[:2] == (FP, "ModelMismatch")
    assert raw.shard.state_bytes() == before


# -- 7. the doorbell's proofs ------------------------------------------------------------------------------------------


def test_doorbell_hello_must_prove_the_attached_segment(raw: Raw) -> None:
    seg = raw.segment()
    address = raw.attach(seg).doorbell
    cases = [
        (raw.hello(seg, nonce=secrets.token_bytes(16)), FP.value[0], "NotAttached"),
        (raw.hello(seg, name=raw.segment().name), FP.value[0], "NotAttached"),  # a real segment, not attached
        (raw.hello(seg, worker_id=OTHER), FP.value[0], "NotAttached"),  # OTHER has no segment
        (raw.hello(seg, worker_id="stranger"), grpc.StatusCode.ABORTED.value[0], "UnknownWorker"),
    ]
    for hello, status, kind in cases:
        bell = Bell(address)
        try:
            got = error(bell.call(hello))
            assert got[:2] == (status, kind), (hello, got)
            assert bell.closed_by_peer(), "a refused hello must end the connection"
        finally:
            bell.close()
    # The right hello is taken, and the connection then answers Exchanges.
    bell = Bell(address)
    try:
        assert bell.call(raw.hello(seg)) == bytes([OK_BYTE])
        body = bell.call(raw.request(pull=True))
        assert body[0] == OK_BYTE, error(body)
        assert ps_pb2.ExchangeResponse.FromString(body[1:]).pulled.version == 0
        assert np.array_equal(seg.weights, raw.params())
    finally:
        bell.close()


def test_doorbell_connection_speaks_for_its_worker_only(raw: Raw) -> None:
    mine, theirs = raw.segment(), raw.segment()
    address = raw.attach(mine).doorbell
    raw.attach(theirs, OTHER)  # OTHER is live and attached: only the connection's identity is wrong
    theirs.grad[:] = 1.0
    theirs.weights[:] = 0.0
    before = raw.shard.state_bytes()
    bell = Bell(address)
    try:
        assert bell.call(raw.hello(mine)) == bytes([OK_BYTE])
        for fields in ({"push": True, "step": 1}, {"pull": True}):
            status, _, message = error(bell.call(raw.request(OTHER, **fields)))
            assert status == PERMISSION_DENIED_BYTE, message
            assert WORKER in message
        assert raw.shard.state_bytes() == before
        assert not theirs.weights.any(), "OTHER's weights region was written for WORKER's connection"
        # The connection still works for its own worker.
        mine.grad[:] = 2.0
        body = bell.call(raw.request(push=True, step=1, base_version=0, pull=True, min_version=1))
        assert body[0] == OK_BYTE, error(body)
        reply = ps_pb2.ExchangeResponse.FromString(body[1:])
        assert (reply.version, reply.applied, reply.pulled.version) == (1, True, 1)
        assert np.array_equal(mine.weights, raw.params())
    finally:
        bell.close()


def _garbage_cases() -> list[object]:
    too_long = REQUEST_HEAD.pack(MAX_FRAME + 1, 1.0, 0)
    garbage = REQUEST_HEAD.pack(len(GARBAGE), 1.0, 0) + GARBAGE
    cut_off = REQUEST_HEAD.pack(100, 1.0, 0) + b"\0" * 10
    hello_with_payload = REQUEST_HEAD.pack(0, 1.0, 4) + b"\0" * 4
    cases = [
        ("garbage-hello", False, [garbage]),
        ("short-hello", False, [_U32.pack(3), None]),  # None: half-close our side
        ("cut-off-hello", False, [cut_off, None]),
        ("hello-with-payload", False, [hello_with_payload]),
        ("oversized-hello", False, [too_long]),
        ("garbage-exchange", True, [garbage]),
        ("short-exchange", True, [_U32.pack(0), None]),
        ("oversized-exchange", True, [too_long]),
        ("cut-off-exchange", True, [cut_off, None]),
    ]
    return [pytest.param(after_hello, frames, id=name) for name, after_hello, frames in cases]


@pytest.mark.parametrize(("after_hello", "frames"), _garbage_cases())
def test_malformed_doorbell_frames_end_the_connection_and_the_shard_serves_on(
    raw: Raw, after_hello: bool, frames: list[bytes | None]
) -> None:
    seg = raw.segment()
    address = raw.attach(seg).doorbell
    bell = Bell(address)
    try:
        if after_hello:
            assert bell.call(raw.hello(seg)) == bytes([OK_BYTE])
        before = raw.shard.state_bytes()
        for frame in frames:
            if frame is None:
                bell.sock.shutdown(socket.SHUT_WR)
            else:
                bell.sock.sendall(frame)
        assert bell.reply() is None, "the shard answered a malformed frame instead of closing"
        assert raw.shard.state_bytes() == before
    finally:
        bell.close()
    # The doorbell still accepts connections (of a new attachment: each proves one), and a normal client trains
    # through it.
    raw.attach(seg)
    bell = Bell(address)
    try:
        assert bell.call(raw.hello(seg)) == bytes([OK_BYTE])
    finally:
        bell.close()
    model = small_model()
    with PSClient(raw.cluster.address, worker_id=WORKER, job_name=JOB, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        assert client.push_pull(like(model, 1)) == 1
        assert _uses_shm(client)


def _doorbell_pull_waits(cluster: LocalCluster, model: dict[str, torch.Tensor], timeouts: list[float]) -> list:
    """Attach WORKER's client, then pull a version that never comes over a raw doorbell connection, once with
    each timeout: [(status byte, error type, seconds waited)]."""
    out = []
    with PSClient(cluster.address, worker_id=WORKER, job_name=JOB, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        seg = _segments(client)[0]
        assert seg is not None
        hello = ps_pb2.AttachRequest(
            worker_id=WORKER,
            shared_memory=ps_pb2.SharedMemory(name=seg.name),
            nonce=seg.nonce,
            elements=seg.elements,
            model_digest=client.digest(model),
        )
        request = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=hello.model_digest, pull=True, min_version=99)
        with grpc.insecure_channel(cluster.address) as channel:  # the segment again: an attachment per connection
            ps_pb2_grpc.ParameterServerStub(channel).Attach(hello, timeout=CALL_TIMEOUT)
        bell = Bell(cluster.servers[0].servicer.doorbell)
        try:
            assert bell.call(hello) == bytes([OK_BYTE])
            for timeout in timeouts:
                started = time.monotonic()
                status, kind, _ = error(bell.call(request, timeout=timeout))
                out.append((status, kind, time.monotonic() - started))
        finally:
            bell.close()
    return out


def test_doorbell_pull_waits_no_longer_than_the_shards_pull_timeout(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = RAW_CONFIG.replace(pull_timeout=0.3)
    cluster = ps_cluster_factory(config, shards=1)
    model = small_model()
    # By gRPC: DEADLINE_EXCEEDED after pull_timeout, though the call's own deadline is later.
    with PSClient(cluster.address, worker_id="registrar", job_name=JOB, shared_memory=False) as client:
        client.register(model)
        digest = client.digest(model)
    with grpc.insecure_channel(cluster.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Join(ps_pb2.JoinRequest(worker_id=OTHER, job_name=JOB), timeout=CALL_TIMEOUT)
        seg = shm.Segment.create(cluster.shards[0].model.numel)
        try:
            hello = ps_pb2.AttachRequest(
                worker_id=OTHER,
                shared_memory=ps_pb2.SharedMemory(name=seg.name),
                nonce=seg.nonce,
                elements=seg.elements,
                model_digest=digest,
            )
            stub.Attach(hello, timeout=CALL_TIMEOUT)
            request = ps_pb2.ExchangeRequest(worker_id=OTHER, model_digest=digest, pull=True, min_version=99)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                stub.Exchange(request, timeout=3.0)
            assert refusal(info.value) == (grpc.StatusCode.DEADLINE_EXCEEDED, "PullTimeout")
            assert time.monotonic() - started < 2.0
        finally:
            seg.close()
    # By the doorbell: a timeout past pull_timeout, and an infinite one, both end at pull_timeout.
    (s1, k1, waited), (s2, k2, waited_inf) = _doorbell_pull_waits(cluster, model, [2.0, float("inf")])
    assert (s1, k1) == (s2, k2) == (DEADLINE_EXCEEDED_BYTE, "PullTimeout")
    assert 0.25 < waited < 1.5, f"the doorbell pull waited {waited:.2f} s; the shard's pull_timeout is 0.3 s"
    assert 0.25 < waited_inf < 1.5, f"an inf timeout waited {waited_inf:.2f} s; the shard's pull_timeout is 0.3 s"
    # A shorter timeout than pull_timeout is the client's to choose.
    ((status, kind, waited),) = _doorbell_pull_waits(cluster, model, [0.05])
    assert (status, kind) == (DEADLINE_EXCEEDED_BYTE, "PullTimeout") and waited < 0.25


def test_doorbell_pull_with_a_nan_timeout_waits_the_shards_pull_timeout(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(RAW_CONFIG.replace(pull_timeout=0.3), shards=1)
    ((status, kind, waited),) = _doorbell_pull_waits(cluster, small_model(), [float("nan")])
    assert (status, kind) == (DEADLINE_EXCEEDED_BYTE, "PullTimeout")
    assert 0.25 < waited < 1.5, f"a NaN timeout waited {waited:.2f} s; the shard's pull_timeout is 0.3 s"


# -- 8. recovery -------------------------------------------------------------------------------------------------------


def test_client_reattaches_after_a_shard_process_restart(tmp_path: Path) -> None:
    lr = 0.1
    config = ServerConfig(
        mode="sync", workers=1, optimizer="sgd", lr=lr, checkpoint_dir=str(tmp_path), checkpoint_every="0"
    )
    model = small_model()
    start = clone(model)
    grads = [like(model, s) for s in (1, 2)]
    before = _fds()
    with LocalCluster(config, shards=1, processes=True) as cluster:
        with PSClient(cluster.address, timeout=30.0) as client:
            client.register(model)
            g = clone(grads[0])
            assert client.push_pull(g) == 1
            first, bell = _segments(client)[0], _doorbells(client)[0]
            assert first is not None and bell is not None
            first_fd, first_inode = _pid_fd(first)[1], _inode(first)
            del first  # holding it would keep its mapping alive after the client drops it
            assert first_inode in _mapped(cluster.procs[0].pid), "the shard process does not map the segment"
            incarnation = client.links[0].incarnation

            cluster.kill(0, signal.SIGTERM)  # a clean stop: the final checkpoint holds version 1
            assert cluster.procs[0].wait(timeout=20) == 0
            cluster.restart(0)

            g = clone(grads[1])
            assert client.push_pull(g) == 2
            second = _segments(client)[0]
            assert second is not None and _inode(second) != first_inode, "the client did not attach a new segment"
            assert _doorbells(client)[0] is not bell
            assert client.links[0].incarnation != incarnation
            expected = local_sgd(start, grads, lr)
            for name in expected:
                assert torch.equal(g[name], expected[name]), name
            assert client.pull(model) == 2
            for name in expected:
                assert torch.equal(model[name], expected[name]), name
            assert not _holds(first_fd, first_inode), "a re-attach left the old segment's memfd open"
            _eventually(lambda: _gone(first_inode), "the old segment's mapping to go")
            assert set(_fds()) == set(before) | {_inode(second)} and _accounted([_inode(second)])
            assert _inode(second) in _mapped(cluster.procs[0].pid)


def test_client_reattaches_when_its_doorbell_connection_is_lost(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    lr = 0.1
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=lr), shards=2)
    model = big_model()
    start = clone(model)
    grads = [like(model, s) for s in (1, 2, 3)]
    before = _fds()
    with PSClient(cluster.address, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        g = clone(grads[0])
        assert client.push_pull(g) == 1
        # Only numbers of the old segments: holding them would keep their mappings alive after the client drops them.
        old_bells, old_ids = _doorbells(client), [id(s) for s in _segments(client)]
        old_inodes = [_inode(s) for s in _segments(client)]
        old = {_pid_fd(s)[1]: _inode(s) for s in _segments(client)}

        _doorbells(client)[0].close()  # the connection to shard 0 is lost under the client
        g = clone(grads[1])
        assert client.push_pull(g) == 2
        assert _uses_shm(client)
        assert _inode(_segments(client)[0]) != old_inodes[0] and _doorbells(client)[0] is not old_bells[0]
        assert id(_segments(client)[1]) == old_ids[1] and _doorbells(client)[1] is old_bells[1], "shard 1 was fine"
        assert _inode(_segments(client)[1]) == old_inodes[1]
        shard = cluster.shards[0]
        assert shard.attachments.segment(client.worker_id, shard.model).nonce == _segments(client)[0].nonce
        expected = local_sgd(start, grads[:2], lr)
        for name in expected:
            assert torch.equal(g[name], expected[name]), name

        with socket.socket(fileno=os.dup(_doorbells(client)[1].fileno())) as cut:
            cut.shutdown(socket.SHUT_RDWR)  # a connection that breaks under the client
        g = clone(grads[2])
        assert client.push_pull(g) == 3
        assert _uses_shm(client) and _inode(_segments(client)[1]) != old_inodes[1]
        expected = local_sgd(start, grads, lr)
        for name in expected:
            assert torch.equal(g[name], expected[name]), name
        # Only the two current segments are left: open in the client, mapped by the client and its shard.
        now = {_pid_fd(s)[1]: _inode(s) for s in _segments(client)}
        assert not set(now.values()) & set(old.values())
        assert not any(_holds(fd, inode) for fd, inode in old.items()), "a dropped segment's memfd is still open"
        _eventually(lambda: all(_gone(inode) for inode in old.values()), "the dropped segments' mappings to go")
        assert set(_fds()) == set(before) | set(now.values()) and _accounted(now.values())
        assert all(_mapped()[inode] == 2 for inode in now.values())


def test_plain_sgd_stays_plain_sgd_after_a_shard_restores_its_checkpoint(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    lr = 0.1
    config = ServerConfig(
        mode="sync", workers=1, optimizer="sgd", lr=lr, checkpoint_dir=str(tmp_path), checkpoint_every="0"
    )
    cluster = ps_cluster_factory(config, shards=1)
    model = small_model()
    start = clone(model)
    grads = [like(model, s) for s in (1, 2, 3)]
    replacement: ShardServer | None = None
    try:
        with PSClient(cluster.address, timeout=CALL_TIMEOUT) as client:
            client.register(model)
            g = clone(grads[0])
            assert client.push_pull(g) == 1
            # The same restart as a shard process's, in this process: stop (final checkpoint), start on the port.
            old = cluster.servers[0]
            old.stop()
            replacement = ShardServer.create(config, 0, port=old.port)
            replacement.start(cluster.addresses)
            assert replacement.shard.version == 1
            for g0 in (grads[1], grads[2]):
                g = clone(g0)
                client.push_pull(g)
            assert replacement.shard.version == 3
            expected = local_sgd(start, grads, lr)
            group = replacement.shard.model.optimizer.param_groups[0]
            assert group["momentum"] == 0, f"restored plain SGD runs with momentum {group['momentum']}"
            for name in expected:
                assert torch.equal(g[name], expected[name]), name
    finally:
        if replacement is not None:
            replacement.stop()


def test_a_segment_cannot_be_truncated_under_the_shard_process() -> None:
    """A shard reading a page truncated away would die of SIGBUS: the seals make the truncation itself fail."""
    config = RAW_CONFIG
    with LocalCluster(config, shards=1, processes=True) as cluster:
        model = small_model()
        with PSClient(cluster.address, worker_id="registrar", job_name=JOB, shared_memory=False) as client:
            client.register(model)
            digest = client.digest(model)
        specs = [TensorSpec(name, tuple(t.shape)) for name, t in model.items()]
        placement = place(specs, 1)
        assert placement.digest == digest
        seg = shm.Segment.create(15)
        pid, fd = _pid_fd(seg)
        size = shm.Segment.size(15)
        try:
            with grpc.insecure_channel(cluster.address) as channel:
                stub = ps_pb2_grpc.ParameterServerStub(channel)
                stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT)
                stub.Attach(
                    ps_pb2.AttachRequest(
                        worker_id=WORKER,
                        shared_memory=ps_pb2.SharedMemory(name=seg.name),
                        nonce=seg.nonce,
                        elements=15,
                        model_digest=digest,
                    ),
                    timeout=CALL_TIMEOUT,
                )
                assert _inode(seg) in _mapped(cluster.procs[0].pid), "the shard process does not map the segment"
                w0 = stub.Exchange(
                    ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=digest, pull=True), timeout=CALL_TIMEOUT
                )
                assert w0.pulled.version == 0
                w0 = seg.weights.copy()
                # Neither through the name the shard opens nor through the creator's own fd: not shorter, not longer.
                reopened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
                try:
                    assert os.fstat(reopened).st_ino == _inode(seg)
                    for target in (reopened, fd):
                        for length in (0, 4096, size - 4, size + 4096):
                            with pytest.raises(PermissionError):
                                os.ftruncate(target, length)
                        with pytest.raises(PermissionError):  # nor can the seals be changed
                            fcntl.fcntl(target, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
                finally:
                    os.close(reopened)
                assert os.fstat(fd).st_size == size
                # A push through the segment afterwards: the shard process applies it and answers.
                grad = np.linspace(-1, 1, 15, dtype=np.float32)
                seg.grad[:] = grad
                seg.weights[:] = np.nan
                reply = stub.Exchange(
                    ps_pb2.ExchangeRequest(
                        worker_id=WORKER,
                        model_digest=digest,
                        push=True,
                        step=1,
                        base_version=0,
                        pull=True,
                        min_version=1,
                    ),
                    timeout=CALL_TIMEOUT,
                )
                assert (reply.version, reply.applied, reply.pulled.version) == (1, True, 1)
                expected = torch.from_numpy(w0).add_(torch.from_numpy(grad), alpha=-config.lr).numpy()
                assert np.array_equal(seg.weights, expected)
            time.sleep(0.3)  # a while after the exchanges: the shard process must stay up, not just answer
            assert cluster.poll() == [None], f"the shard process died: exit status {cluster.poll()[0]}"
            # A reader on the streams gets the same weights from the shard process.
            with PSClient(cluster.address, job_name=JOB, join=False, shared_memory=False) as reader:
                check = clone(model)
                assert reader.pull(check) == 1
            flat = np.concatenate(
                [check[p.name].flatten().numpy()[p.start : p.start + p.length] for p in placement.shards[0]]
            )
            assert np.array_equal(flat, expected)
        finally:
            seg.close()


# -- 9. sync rounds through shared memory ------------------------------------------------------------------------------


def test_sync_round_through_shared_memory_waits_for_every_worker(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=1.0), shards=1)
    a, b = PSClient(cluster.address), PSClient(cluster.address)
    try:
        for client in (a, b):
            client.register({"w": torch.zeros(3)})
            assert _uses_shm(client)
        ga, gb = {"w": torch.tensor([1.0, 2.0, 3.0])}, {"w": torch.tensor([3.0, 2.0, 5.0])}
        got: list[int] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                got.append(a.push_pull(ga))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        waiter = threading.Thread(target=run)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "A's push_pull must wait for B's gradient to close the round"
        assert cluster.shards[0].version == 0
        assert b.push_pull(gb) == 1
        waiter.join(10)
        assert not waiter.is_alive() and not errors, errors
        assert got == [1]
        mean_step = torch.tensor([-2.0, -2.0, -4.0])  # 0 - 1.0 * mean
        assert torch.equal(ga["w"], mean_step) and torch.equal(gb["w"], mean_step)
        assert _uses_shm(a) and _uses_shm(b)
    finally:
        a.close()
        b.close()
