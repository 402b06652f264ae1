"""A serving copy's Lookup: entries of tables of different widths in one request answered as each table's own
lookup would be, and a request it cannot answer refused with the status that says why, changing nothing."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from paramserver.config import ServerConfig
from paramserver.errors import FailedPrecondition, InvalidArgument
from paramserver.server.cluster import LocalCluster
from paramserver.serving.follower import wait_until
from paramserver.serving.seed import seed
from paramserver.serving.server import ServingCopies, contact, serve
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker import PSClient, SparseEmbedding
from worker.client.serving import ServingClient

pytestmark = pytest.mark.timeout(180)


class Widths(nn.Module):
    """Tables of two widths, bounded and not."""

    def __init__(self) -> None:
        super().__init__()
        self.a = SparseEmbedding(dim=4, num_embeddings=100, init_scale=0.1)
        self.b = SparseEmbedding(dim=8)
        self.c = SparseEmbedding(dim=4)
        self.fc = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.a(ids[:, 0] % 100), self.b(ids[:, 1]), self.c(ids[:, 2])], 1)).squeeze(-1)


def train(client: PSClient, model: Widths, g: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        (model(torch.randint(-(10**6), 10**6, (64, 3), generator=g)) ** 2).mean().backward()
        client.push_pull(model)


@pytest.fixture
def served(ps_cluster_factory: Callable[..., LocalCluster]) -> Iterator[tuple[ServingClient, PSClient, Widths]]:
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.1), shards=2)
    torch.manual_seed(0)
    model = Widths()
    with PSClient(cluster.address) as client:
        client.register(model)
        train(client, model, torch.Generator().manual_seed(1), 5)
        server, copies, port = serve(cluster.address)
        try:
            with ServingClient(f"127.0.0.1:{port}") as reader:
                assert wait_until(lambda: list(reader.status().versions) == list(client.versions), 30)
                yield reader, client, model
        finally:
            copies.stop()
            server.stop(0)


def test_entries_of_several_widths_read_as_each_tables_own_lookup(
    served: tuple[ServingClient, PSClient, Widths],
) -> None:
    reader, _, model = served
    ids = {"a": np.arange(0, 100, 7), "b": np.arange(-(10**6), 10**6, 99_991), "c": np.array([-5, 0, 5, 10**12])}
    with torch.no_grad():
        want = {name: getattr(model, name)(torch.from_numpy(i)).numpy() for name, i in ids.items()}
    request = ps_pb2.LookupRequest(
        tables=[
            ps_pb2.ServingIds(table="c", ids=ids["c"].astype("<i8").tobytes()),
            ps_pb2.ServingIds(table="a", ids=ids["a"].astype("<i8").tobytes()),
            ps_pb2.ServingIds(table="b", ids=b""),
            ps_pb2.ServingIds(table="b", ids=ids["b"].astype("<i8").tobytes()),
            ps_pb2.ServingIds(table="c", ids=ids["c"][::-1].astype("<i8").tobytes()),
        ]
    )
    with grpc.insecure_channel(reader.address) as channel:
        reply = ps_pb2_grpc.ServingStub(channel).Lookup(request)
    got = [np.frombuffer(r, "<f4") for r in reply.rows]
    np.testing.assert_array_equal(got[0].reshape(-1, 4), want["c"])
    np.testing.assert_array_equal(got[1].reshape(-1, 4), want["a"])
    assert got[2].size == 0
    np.testing.assert_array_equal(got[3].reshape(-1, 8), want["b"])
    np.testing.assert_array_equal(got[4].reshape(-1, 4), want["c"][::-1])
    assert reader.lookup_many({"a": ids["a"]})["a"].tolist() == want["a"].tolist()


@pytest.mark.parametrize(
    ("entries", "code", "says"),
    [
        ([("nope", np.arange(2))], grpc.StatusCode.INVALID_ARGUMENT, "no table named 'nope'"),
        ([("a", np.arange(2)), ("a", np.array([100]))], grpc.StatusCode.INVALID_ARGUMENT, "outside 0..99"),
        ([("a", np.array([-1]))], grpc.StatusCode.INVALID_ARGUMENT, "outside 0..99"),
        ([("b", b"\x00" * 7)], grpc.StatusCode.INVALID_ARGUMENT, "7 bytes of IDs, not a multiple of 8"),
        ([("b", np.arange(140_000))], grpc.StatusCode.RESOURCE_EXHAUSTED, "over the reply limit"),
    ],
)
def test_a_lookup_it_cannot_answer_is_refused_and_changes_nothing(
    served: tuple[ServingClient, PSClient, Widths], entries: list[tuple[str, object]], code: grpc.StatusCode, says: str
) -> None:
    reader, _, _ = served
    before = reader.status().versions, reader.lookup_many({"a": np.arange(100), "c": np.arange(-9, 9)})
    request = ps_pb2.LookupRequest(
        tables=[
            ps_pb2.ServingIds(table=t, ids=i if isinstance(i, bytes) else np.asarray(i, "<i8").tobytes())
            for t, i in entries
        ]
    )
    with grpc.insecure_channel(reader.address) as channel, pytest.raises(grpc.RpcError) as err:
        ps_pb2_grpc.ServingStub(channel).Lookup(request)
    assert err.value.code() == code
    assert says in err.value.details()
    after = reader.status().versions, reader.lookup_many({"a": np.arange(100), "c": np.arange(-9, 9)})
    assert after[0] == before[0]
    for name in ("a", "c"):
        np.testing.assert_array_equal(after[1][name], before[1][name])


def test_a_client_reads_from_one_process_per_shard(
    served: tuple[ServingClient, PSClient, Widths], ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    reader, client, model = served
    address = reader.address
    started = [serve(client.addresses[0], shards=[s]) for s in (0, 1)]
    try:
        ports = [f"127.0.0.1:{port}" for _, _, port in started]
        with ServingClient(ports) as spread, ServingClient(",".join(reversed(ports))) as backwards:
            assert wait_until(lambda: list(spread.status().versions) == list(client.versions), 30)
            ids = {"a": np.arange(100), "b": np.arange(-500, 500, 7), "c": np.array([3, -3, 10**15])}
            with torch.no_grad():
                want = {n: getattr(model, n)(torch.from_numpy(i)).numpy() for n, i in ids.items()}
            for r in (spread, backwards, reader):
                got = r.lookup_many(ids)
                for n in ids:
                    np.testing.assert_array_equal(got[n], want[n])
            assert spread.versions == tuple(client.versions)
            pulled = Widths()
            spread.pull(pulled)
            assert torch.equal(pulled.fc.weight, model.fc.weight)
        with ServingClient(ports[0], timeout=30) as half:
            assert list(half.status().held) == [0]
            with pytest.raises(FailedPrecondition, match=r"holds a copy of shard\(s\) \[1\]: start ps-serve"):
                half.lookup_many(ids)
        other = ps_cluster_factory(ServerConfig(mode="async", workers=1), shards=2)
        with PSClient(other.address) as elsewhere:
            elsewhere.register(nn.Linear(3, 1))
            server, copies, port = serve(other.address)
            try:
                with pytest.raises(ValueError, match="name the copies of one job"):
                    ServingClient([address, f"127.0.0.1:{port}"], timeout=30)
            finally:
                copies.stop()
                server.stop(0)
    finally:
        for server, copies, _ in started:
            copies.stop()
            server.stop(0)


def test_a_copy_started_from_a_saved_file_serves_it_at_once_then_follows(
    served: tuple[ServingClient, PSClient, Widths], tmp_path: Path
) -> None:
    _, client, model = served
    path = tmp_path / "model.safetensors"
    client.save(model, path)
    ids = {"a": np.arange(100), "b": np.arange(-(10**6), 10**6, 4_999), "c": np.arange(-300, 300)}
    with torch.no_grad():
        saved = {n: getattr(model, n)(torch.from_numpy(i)).numpy() for n, i in ids.items()}
    saved_versions = list(client.versions)
    train(client, model, torch.Generator().manual_seed(2), 3)
    request = ps_pb2.LookupRequest(tables=[ps_pb2.ServingIds(table=n, ids=i.tobytes()) for n, i in ids.items()])
    # Seeded, not following yet: ready, serving the file's values at the file's versions.
    copies = ServingCopies(contact(client.addresses[0], 30))
    seed(copies.copies, copies.topology, copies.tables, path)
    assert copies.ready
    reply = copies.lookup(request)
    for want, raw in zip(saved.values(), reply.rows, strict=True):
        np.testing.assert_array_equal(np.frombuffer(raw, "<f4").reshape(want.shape), want)
    assert list(reply.versions) == saved_versions
    # Started from the file: it then takes the shards' state and follows training.
    server, following, port = serve(client.addresses[0], seed_from=str(path))
    try:
        with ServingClient(f"127.0.0.1:{port}") as reader:
            train(client, model, torch.Generator().manual_seed(3), 2)
            assert wait_until(lambda: list(reader.status().versions) == list(client.versions), 30)
            with torch.no_grad():
                for n, i in ids.items():
                    np.testing.assert_array_equal(reader.lookup_many({n: i})[n], getattr(model, n)(torch.from_numpy(i)))
    finally:
        following.stop()
        server.stop(0)


def test_a_file_of_another_model_is_refused(served: tuple[ServingClient, PSClient, Widths], tmp_path: Path) -> None:
    _, client, _ = served
    copies = ServingCopies(contact(client.addresses[0], 30))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="not a model file"):
        seed(copies.copies, copies.topology, copies.tables, garbage)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other), metadata={"format": "paramserver.model/1", "tables": "[]"})
    with pytest.raises(ValueError, match="holds tables"):
        seed(copies.copies, copies.topology, copies.tables, other)
    assert not copies.ready


def _frame(sock: socket.socket, body: bytes, length: int | None = None) -> tuple[int, bytes]:
    """Send one lookup-socket frame; the answer's kind and body."""
    sock.sendall(struct.pack("<I", len(body) if length is None else length) + body)
    head = sock.recv(4, socket.MSG_WAITALL)
    (n,) = struct.unpack("<I", head)
    answer = sock.recv(n, socket.MSG_WAITALL)
    return answer[0], answer[1:]


def test_lookups_over_the_lookup_socket_answer_as_grpc_and_refuse_as_it_does(
    served: tuple[ServingClient, PSClient, Widths],
) -> None:
    reader, _, _ = served
    port = reader.status().lookup_port
    assert port
    request = ps_pb2.LookupRequest(
        tables=[
            ps_pb2.ServingIds(table="a", ids=np.arange(50, dtype="<i8").tobytes()),
            ps_pb2.ServingIds(table="b", ids=np.array([-7, 10**14], "<i8").tobytes()),
        ]
    )
    with grpc.insecure_channel(reader.address) as channel:
        want = ps_pb2_grpc.ServingStub(channel).Lookup(request)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        # Pipelined: two requests sent before either answer is read, answered in order.
        body = request.SerializeToString()
        sock.sendall((struct.pack("<I", len(body)) + body) * 2)
        for _ in range(2):
            (n,) = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))
            answer = sock.recv(n, socket.MSG_WAITALL)
            assert answer[0] == 0 and ps_pb2.LookupReply.FromString(answer[1:]) == want
        # Refusals keep the connection: an undecodable request, an unknown table.
        kind, error = _frame(sock, b"\xff\xff\xff")
        assert kind == 1 and error[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        unknown = ps_pb2.LookupRequest(tables=[ps_pb2.ServingIds(table="nope", ids=b"")]).SerializeToString()
        kind, error = _frame(sock, unknown)
        assert kind == 1 and b"no table named 'nope'" in error
        assert _frame(sock, body) == (0, want.SerializeToString())
        # A frame past the limit is refused and ends the connection (its bytes cannot be skipped).
        kind, error = _frame(sock, b"", length=64 << 20)
        assert kind == 1 and error[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert sock.recv(1) == b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as cut:
        cut.sendall(struct.pack("<I", 100) + b"12345")  # a frame cut off: only its connection ends
    # The client takes the socket; a refusal raises as over gRPC.
    assert reader.lookup_many({"a": np.arange(50)})["a"].tobytes() == want.rows[0]
    with pytest.raises(InvalidArgument, match="outside 0..99"):
        reader.lookup_many({"a": np.array([100])})


def test_a_client_that_cannot_reach_the_lookup_socket_reads_over_grpc(
    served: tuple[ServingClient, PSClient, Widths],
) -> None:
    _, client, model = served
    ids = np.arange(-20, 20)
    with torch.no_grad():
        want = model.c(torch.from_numpy(ids)).numpy()
    for lookup_port in (None, 0):
        server, copies, port = serve(client.addresses[0], lookup_port=lookup_port)
        try:
            with ServingClient(f"127.0.0.1:{port}") as reader:
                assert bool(reader.status().lookup_port) == (lookup_port is not None)
                np.testing.assert_array_equal(reader.lookup_many({"c": ids})["c"], want)
                if copies.lookup_socket is not None:  # the socket gone under a connected client
                    copies.lookup_socket.close()
                    np.testing.assert_array_equal(reader.lookup_many({"c": ids})["c"], want)
        finally:
            copies.stop()
            server.stop(0)


def test_ps_serve_serves_a_saved_file_alone(served: tuple[ServingClient, PSClient, Widths], tmp_path: Path) -> None:
    _, client, model = served
    path = tmp_path / "model.safetensors"
    client.save(model, path)
    ids = {"a": np.arange(100), "b": np.arange(-(10**6), 10**6, 4_999), "c": np.arange(-300, 300)}
    with torch.no_grad():
        want = {n: getattr(model, n)(torch.from_numpy(i)).numpy() for n, i in ids.items()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramserver.serving.cli", "--from", str(path), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("PS-SERVE-READY"):
                break
        assert "following nothing" in lines[0], lines
        with ServingClient(f"127.0.0.1:{lines[-1].split()[1]}") as reader:
            got = reader.lookup_many(ids)
            for n in ids:
                np.testing.assert_array_equal(got[n], want[n])
            copy = Widths()
            reader.pull(copy)
            assert torch.equal(copy.fc.weight, model.fc.weight) and torch.equal(copy.fc.bias, model.fc.bias)
            assert list(reader.status().versions) == list(client.versions)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    refused = subprocess.run(
        [sys.executable, "-m", "paramserver.serving.cli", "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "--from FILE alone" in refused.stderr
