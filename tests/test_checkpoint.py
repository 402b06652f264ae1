"""Checkpoints: the file format (round trip, atomic write, rotation, corruption) and shards that restore from it.

The format is safetensors, `u64 header length | header JSON | tensor bytes`, whose header's `__metadata__` begins
with the file's sha256 (of the file with those hex digits read as "0"s), so every test can reason about the bytes
directly. The shard-level tests run real shards as threads (`ps_cluster_factory`) or build
`Shard` objects directly, and compare `Shard.state_bytes()` (weights, optimizer state, version) before and after.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.waiting import wait_for

from paramserver.config import ServerConfig
from paramserver.placement import TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.shard.durability import checkpoint
from paramserver.shard.durability.checkpoint import KEEP, LEGACY_MAGIC, CorruptCheckpoint, Snapshot
from paramserver.shard.optimizers import make_optimizer
from paramserver.shard.state import Shard
from worker.client import PSClient

pytestmark = pytest.mark.timeout(30)

SPECS = (TensorSpec("fc.weight", (3, 4)), TensorSpec("fc.bias", (3,)))
NUMEL = 15
CLIENT_TIMEOUT = 10.0  # seconds for any client call against a local thread cluster
SIXTEENTH = 2.0**-4  # gradients are small multiples of it, so float32 sums are exact


# -- helpers ----------------------------------------------------------------------------------------------------


def _trained(optimizer: str, steps: int = 3) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """A flat parameter and the server's own optimizer for it, stepped a few times (so it has state)."""
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(NUMEL, generator=gen)
    opt = make_optimizer(ServerConfig(optimizer=optimizer, lr=0.05, weight_decay=0.01), params)
    for _ in range(steps):
        params.grad = torch.randn(NUMEL, generator=gen)
        opt.step()
    params.grad = None
    return params, opt


def _snapshot(
    version: int = 3, *, shard_index: int = 0, num_shards: int = 1, optimizer: str = "adam", fill: float | None = None
) -> Snapshot:
    params, opt = _trained(optimizer)
    if fill is not None:
        params.fill_(fill)
    return Snapshot(
        shard_index=shard_index,
        num_shards=num_shards,
        specs=SPECS,
        digest=place(SPECS, num_shards).digest,
        version=version,
        optimizer=optimizer,
        params=params.detach().clone(),
        optimizer_state=opt.state_dict(),
        ever_full=True,
        applied={"worker-a": [1, 2, 3], "worker-b": [7]},
    )


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Deep equality: tensors bit for bit (dtype and shape too), dicts by key, sequences by element.

    A tuple and a list with equal elements count as equal here (JSON has no tuples); the exact-type check is
    `test_round_trip_keeps_tuples_in_param_groups`.
    """
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{got.shape}"
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {set(got)} != {set(want)}"
        for key in want:
            _assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def _header_length(data: bytes) -> int:
    return struct.unpack_from("<Q", data, 0)[0]


SEAL_AT = len(b'{"__metadata__":{"sha256":"')  # where the checksum's hex digits begin in the header


def _seal(data: bytes) -> str:
    """The checksum a file should carry: the sha256 of the file with its checksum digits read as "0"s."""
    at = 8 + SEAL_AT
    return hashlib.sha256(data[:at] + b"0" * 64 + data[at + 64 :]).hexdigest()


def _reseal(header: dict[str, Any] | bytes, payload: bytes) -> bytes:
    """A file with a correct checksum around any header and payload (what a buggy writer could produce); a header
    given as bytes must begin with the checksum's place, as the writer's does."""
    if isinstance(header, bytes):
        raw = header
    else:
        meta = {"sha256": "0" * 64, **header.get("__metadata__", {})}
        header = {"__metadata__": meta, **{k: v for k, v in header.items() if k != "__metadata__"}}
        raw = json.dumps(header, separators=(",", ":")).encode()
    data = struct.pack("<Q", len(raw)) + raw + payload
    at = 8 + SEAL_AT
    return data[:at] + _seal(data).encode() + data[at + 64 :]


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A valid file's header (parsed) and tensor bytes."""
    hlen = _header_length(data)
    return json.loads(data[8 : 8 + hlen]), data[8 + hlen :]


def _description(header: dict[str, Any]) -> dict[str, Any]:
    """The paramserver description a header's metadata holds."""
    return json.loads(header["__metadata__"]["paramserver"])


def _legacy_file(snap: Snapshot) -> bytes:
    """`snap` (with no tables) in the first format: b"PSCKPT01" | u64 header length | header | tensors | sha256."""
    tensors = [snap.params, *[t for st in snap.optimizer_state["state"].values() for t in st.values()]]
    layout, offset, refs = [], 0, iter(range(len(tensors) - 1))
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        layout.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset})
        layout[-1]["nbytes"] = nbytes
        offset += nbytes
    state = {
        "__dict__": [
            [k, {"__dict__": [[n, {"__tensor__": next(refs)}] for n in st]}]
            for k, st in snap.optimizer_state["state"].items()
        ]
    }
    groups = [
        {"__dict__": [[k, {"__tuple__": list(v)} if isinstance(v, tuple) else v] for k, v in g.items()]}
        for g in snap.optimizer_state["param_groups"]
    ]
    header = {
        "format": 1,
        "shard_index": snap.shard_index,
        "num_shards": snap.num_shards,
        "specs": [[s.name, list(s.shape)] for s in snap.specs],
        "digest": snap.digest,
        "version": snap.version,
        "optimizer": snap.optimizer,
        "optimizer_state": {"__dict__": [["state", state], ["param_groups", groups]]},
        "ever_full": snap.ever_full,
        "applied": snap.applied,
        "tensors": layout,
    }
    raw = json.dumps(header).encode()
    body = LEGACY_MAGIC + struct.pack("<Q", len(raw)) + raw + b"".join(t.numpy().tobytes() for t in tensors)
    return body + hashlib.sha256(body).digest()


# -- round trip -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adam", "momentum", "adagrad"])
def test_save_load_round_trip_keeps_params_and_optimizer_state(tmp_path: Path, optimizer: str) -> None:
    snap = _snapshot(optimizer=optimizer)
    assert snap.optimizer_state["state"], "the optimizer should hold state after a few steps"

    path = checkpoint.save(tmp_path, snap)
    loaded = checkpoint.load(path)

    assert path == checkpoint.path_for(tmp_path, 0, 3)
    assert torch.equal(loaded.params, snap.params) and loaded.params.dtype == torch.float32
    _assert_same(loaded.optimizer_state["state"], snap.optimizer_state["state"], "state")
    _assert_same(loaded.optimizer_state["param_groups"], snap.optimizer_state["param_groups"], "param_groups")
    assert set(loaded.optimizer_state) == set(snap.optimizer_state)
    for name in (
        "shard_index",
        "num_shards",
        "specs",
        "digest",
        "version",
        "optimizer",
        "ever_full",
        "applied",
        "finished_workers",
    ):
        assert getattr(loaded, name) == getattr(snap, name), name

    # The loaded state drives a fresh optimizer exactly as the original one goes on.
    params, original = _trained(optimizer)
    copy = params.detach().clone()
    resumed = make_optimizer(ServerConfig(optimizer=optimizer, lr=0.05, weight_decay=0.01), copy)
    resumed.load_state_dict(loaded.optimizer_state)
    grad = torch.linspace(-1.0, 1.0, NUMEL)
    for p, opt in ((params, original), (copy, resumed)):
        p.grad = grad.clone()
        opt.step()
    assert torch.equal(copy, params)


def test_round_trip_keeps_tuples_in_param_groups(tmp_path: Path) -> None:
    snap = _snapshot(optimizer="adam")
    assert isinstance(snap.optimizer_state["param_groups"][0]["betas"], tuple)

    loaded = checkpoint.load(checkpoint.save(tmp_path, snap))

    assert loaded.optimizer_state["param_groups"] == snap.optimizer_state["param_groups"]


def test_round_trip_of_plain_sgd_without_optimizer_state(tmp_path: Path) -> None:
    snap = _snapshot(optimizer="sgd")
    assert snap.optimizer_state["state"] == {}

    loaded = checkpoint.load(checkpoint.save(tmp_path, snap))

    assert loaded.optimizer_state["state"] == {}
    assert torch.equal(loaded.params, snap.params)


def test_a_file_of_the_first_format_is_still_read(tmp_path: Path) -> None:
    snap = _snapshot(optimizer="adam")
    path = checkpoint.path_for(tmp_path, 0, 3)
    path.write_bytes(_legacy_file(snap))

    loaded = checkpoint.load_latest(tmp_path, 0)

    assert loaded is not None and (loaded.version, loaded.applied, loaded.ever_full) == (3, snap.applied, True)
    assert torch.equal(loaded.params, snap.params)
    assert loaded.optimizer_state["param_groups"] == snap.optimizer_state["param_groups"]
    _assert_same(loaded.optimizer_state["state"], snap.optimizer_state["state"], "state")
    path.write_bytes(_flip(path.read_bytes(), 100))
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        checkpoint.load(path)


# -- atomic write, rotation, listing ------------------------------------------------------------------------------


def test_save_leaves_no_temporary_files_and_keeps_the_newest_two_per_shard(tmp_path: Path) -> None:
    other = [checkpoint.save(tmp_path, _snapshot(v, shard_index=1, num_shards=2)) for v in (1, 2)]
    other_bytes = [p.read_bytes() for p in other]

    for version in (1, 2, 3, 4):
        checkpoint.save(tmp_path, _snapshot(version, num_shards=2, fill=float(version)))
        assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    assert KEEP == 2
    mine = checkpoint.list_checkpoints(tmp_path, 0)
    assert mine == [checkpoint.path_for(tmp_path, 0, 4), checkpoint.path_for(tmp_path, 0, 3)]
    assert [checkpoint.load(p).version for p in mine] == [4, 3]
    assert float(checkpoint.load(mine[0]).params[0]) == 4.0
    # The other shard's files are untouched by this shard's rotation.
    assert checkpoint.list_checkpoints(tmp_path, 1) == other[::-1]
    assert [p.read_bytes() for p in other] == other_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (*mine, *other))


def test_list_checkpoints_is_newest_first_by_version_not_by_name_order_of_writes(tmp_path: Path) -> None:
    for version in (10, 2, 300):
        checkpoint.save(tmp_path, _snapshot(version), keep=10)
    (tmp_path / "shard-000-v12.ckpt").write_bytes(b"not our name pattern")
    (tmp_path / "notes.txt").write_text("ignored")

    assert [checkpoint.load(p).version for p in checkpoint.list_checkpoints(tmp_path, 0)] == [300, 10, 2]
    assert checkpoint.list_checkpoints(tmp_path, 5) == []
    assert checkpoint.list_checkpoints(tmp_path / "missing", 0) == []


def test_checkpoint_writer_writes_in_the_background_and_survives_a_failed_write(tmp_path: Path) -> None:
    writer = checkpoint.CheckpointWriter(tmp_path / "ckpt")
    try:
        for version in (1, 2, 3):
            writer.submit(_snapshot(version))
        writer.flush()
        assert writer.errors == 0
        assert writer.last_path == checkpoint.path_for(tmp_path / "ckpt", 0, 3)
        assert [checkpoint.load(p).version for p in checkpoint.list_checkpoints(tmp_path / "ckpt", 0)] == [3, 2]
    finally:
        writer.close()

    blocked = tmp_path / "a-file"
    blocked.write_text("a directory cannot be made here")
    failing = checkpoint.CheckpointWriter(blocked)
    try:
        failing.submit(_snapshot(1))
        failing.submit(_snapshot(2))
        failing.flush()
        assert failing.errors == 2  # both reported, and the writer kept going after the first
    finally:
        failing.close()


# -- no pickle -----------------------------------------------------------------------------------------------------


def test_file_is_safetensors_with_a_json_description_and_no_pickle(tmp_path: Path) -> None:
    snap = _snapshot()
    path = checkpoint.save(tmp_path, snap)
    data = path.read_bytes()

    header, payload = _split(data)
    meta = header["__metadata__"]
    assert list(meta) == ["sha256", "format", "paramserver"] and meta["format"] == "2"
    assert data[8 : 8 + SEAL_AT] == b'{"__metadata__":{"sha256":"' and meta["sha256"] == _seal(data)
    description = _description(header)
    assert description["version"] == 3 and description["optimizer"] == "adam"
    assert (header["params"]["dtype"], header["params"]["shape"]) == ("F32", [NUMEL])
    start, end = header["params"]["data_offsets"]
    assert payload[start:end] == snap.params.numpy().astype("<f4").tobytes()
    assert (8 + _header_length(data)) % 8 == 0, "the tensor bytes start aligned"
    # The tensors cover the payload exactly, and any safetensors reader reads them.
    assert sorted(e["data_offsets"] for k, e in header.items() if k != "__metadata__")[-1][1] == len(payload)
    foreign = safetensors.torch.load_file(path)
    assert set(foreign) == {"params", *(f"optimizer.{i}" for i in range(len(foreign) - 1))}
    assert torch.equal(foreign["params"], snap.params)
    state = snap.optimizer_state["state"][0]
    assert any(torch.equal(foreign[k], state["exp_avg"]) for k in foreign)
    # No pickle in the code (the docstring may say so): no such import or name, and no torch.save / torch.load.
    tree = ast.parse(inspect.getsource(checkpoint))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    calls = {
        f"{n.value.id}.{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }
    assert not {m for m in imported | names if "pickle" in m.lower()}
    assert not calls & {"torch.save", "torch.load", "np.load", "numpy.load"}


# -- corruption ----------------------------------------------------------------------------------------------------


def _flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    return data[:index] + bytes([data[index] ^ mask]) + data[index + 1 :]


def _padding_to_tab(data: bytes) -> bytes:
    """The header's last padding space made a tab: the same JSON to a parser, but not the same file."""
    end = 8 + _header_length(data)
    assert data[end - 1 : end] == b" ", "the header of the test's snapshot is padded"
    return data[: end - 1] + b"\t" + data[end:]


DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "truncated-end": lambda d: d[:-10],
    "truncated-to-header": lambda d: d[: 8 + 5],
    "truncated-inside-length": lambda d: d[:5],
    "flipped-payload-byte": lambda d: _flip(d, 8 + _header_length(d) + 5),
    "flipped-last-byte": lambda d: _flip(d, len(d) - 1),
    "flipped-header-byte": lambda d: _flip(d, 8 + 3),
    "flipped-description-byte": lambda d: _flip(d, 8 + SEAL_AT + 100),
    "padding-made-a-tab": _padding_to_tab,
    "flipped-length-byte": lambda d: _flip(d, 0),
    "flipped-checksum-byte": lambda d: _flip(d, 8 + SEAL_AT + 10),
    "wrong-magic": lambda d: LEGACY_MAGIC + d[len(LEGACY_MAGIC) :],
    "safetensors-of-someone-else": lambda d: safetensors.torch.save({"params": torch.zeros(NUMEL)}),
    "empty": lambda d: b"",
    "appended-byte": lambda d: d + b"\0",
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_file_raises_corrupt_checkpoint(tmp_path: Path, damage: str) -> None:
    path = checkpoint.save(tmp_path, _snapshot())
    path.write_bytes(DAMAGE[damage](path.read_bytes()))

    with pytest.raises(CorruptCheckpoint) as info:
        checkpoint.load(path)
    assert str(path) in str(info.value)


def _sealed_variants() -> list[Any]:
    """Files whose checksum is right but whose header does not add up (a buggy or foreign writer)."""

    def edit(change: Callable[[dict[str, Any]], None]) -> Callable[[bytes], bytes]:
        def make(data: bytes) -> bytes:
            header, payload = _split(data)
            change(header)
            return _reseal(header, payload)

        return make

    def describe(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """An edit of the paramserver description inside the metadata."""

        def edit_description(h: dict[str, Any]) -> None:
            description = _description(h)
            change(description)
            h["__metadata__"]["paramserver"] = json.dumps(description)

        return edit_description

    def overrun(h: dict[str, Any]) -> None:
        h["params"]["data_offsets"][1] += 4

    def bad_shape(h: dict[str, Any]) -> None:
        h["params"]["shape"] = [NUMEL + 1]

    def unnamed_tensor(h: dict[str, Any]) -> None:  # an optimizer tensor the description no longer refers to
        description = _description(h)
        description["optimizer_state"] = {"__dict__": [["state", {"__dict__": []}], ["param_groups", []]]}
        h["__metadata__"]["paramserver"] = json.dumps(description)

    def params_of(dtype: str) -> Callable[[dict[str, Any]], None]:
        return lambda h: h["params"].update(dtype=dtype)

    def metadata(key: str, value: str) -> Callable[[dict[str, Any]], None]:
        return lambda h: h["__metadata__"].update({key: value})

    return [
        pytest.param(lambda d: _reseal(b'{"__metadata__":{"sha256":"' + b"0" * 64 + b"{not", b""), id="not-json"),
        pytest.param(edit(metadata("paramserver", "{not json")), id="description-not-json"),
        pytest.param(edit(metadata("paramserver", "[1, 2]")), id="description-not-an-object"),
        pytest.param(edit(lambda h: h["__metadata__"].pop("paramserver")), id="no-description"),
        pytest.param(edit(metadata("format", "3")), id="unknown-format"),
        pytest.param(edit(describe(lambda d: d.pop("version"))), id="missing-key"),
        pytest.param(edit(overrun), id="tensor-runs-past-the-end"),
        pytest.param(edit(bad_shape), id="shape-does-not-match-bytes"),
        pytest.param(edit(params_of("U32")), id="unknown-dtype"),
        pytest.param(edit(params_of("X32")), id="not-a-dtype"),
        pytest.param(edit(params_of("I32")), id="params-not-float32"),
        pytest.param(lambda d: _reseal({"__metadata__": _split(d)[0]["__metadata__"]}, b""), id="no-tensors"),
        pytest.param(edit(unnamed_tensor), id="tensor-the-description-does-not-name"),
        pytest.param(edit(describe(lambda d: d.update(specs=[["w", 5]]))), id="spec-shape-not-a-list"),
        pytest.param(edit(describe(lambda d: d.update(applied=[]))), id="applied-not-an-object"),
    ]


@pytest.mark.parametrize("make", _sealed_variants())
def test_sealed_but_malformed_file_raises_corrupt_checkpoint(tmp_path: Path, make: Callable[[bytes], bytes]) -> None:
    path = checkpoint.save(tmp_path, _snapshot())
    path.write_bytes(make(path.read_bytes()))

    with pytest.raises(CorruptCheckpoint):
        checkpoint.load(path)


def test_load_latest_skips_a_damaged_newest_file(tmp_path: Path) -> None:
    for version in (1, 2, 3):
        checkpoint.save(tmp_path, _snapshot(version, fill=float(version)), keep=3)
    newest = checkpoint.path_for(tmp_path, 0, 3)
    newest.write_bytes(_flip(newest.read_bytes(), 100))

    snap = checkpoint.load_latest(tmp_path, 0)

    assert snap is not None and snap.version == 2
    assert torch.equal(snap.params, torch.full((NUMEL,), 2.0))


def test_load_latest_skips_a_file_of_another_shard_under_this_shards_name(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, _snapshot(1, num_shards=2))
    stray = checkpoint.save(tmp_path, _snapshot(2, shard_index=1, num_shards=2))
    stray.rename(checkpoint.path_for(tmp_path, 0, 2))

    snap = checkpoint.load_latest(tmp_path, 0)

    assert snap is not None and (snap.shard_index, snap.version) == (0, 1)


def test_load_latest_returns_none_when_every_file_is_damaged_or_none_exists(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path, 0) is None
    assert checkpoint.load_latest(tmp_path / "never-created", 0) is None
    for version in (1, 2):
        path = checkpoint.save(tmp_path, _snapshot(version))
        path.write_bytes(path.read_bytes()[:-1])

    assert checkpoint.load_latest(tmp_path, 0) is None


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of one small valid checkpoint."""
    return checkpoint.save(tmp_path_factory.mktemp("valid"), _snapshot()).read_bytes()


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each example writes its damaged file (overwritten every time)."""
    return checkpoint.path_for(tmp_path_factory.mktemp("fuzz"), 0, 3)


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_single_byte_flip_or_truncation_is_detected(
    valid_file: bytes, fuzz_path: Path, data: st.DataObject
) -> None:
    if data.draw(st.booleans(), label="truncate"):
        damaged = valid_file[: data.draw(st.integers(0, len(valid_file) - 1), label="length")]
    else:
        index = data.draw(st.integers(0, len(valid_file) - 1), label="index")
        damaged = _flip(valid_file, index, data.draw(st.integers(1, 255), label="xor"))
    fuzz_path.write_bytes(damaged)

    with pytest.raises(CorruptCheckpoint):  # any other exception, or a Snapshot, fails the test
        checkpoint.load(fuzz_path)


# -- shards: save -> restore -> equal ------------------------------------------------------------------------------


MODEL_SHAPES = {"emb": (40, 8), "fc.weight": (8, 8), "fc.bias": (8,)}


def _model(value: float = 0.5) -> dict[str, torch.Tensor]:
    return {name: torch.full(shape, value) for name, shape in MODEL_SHAPES.items()}


def _grad(step: int) -> dict[str, torch.Tensor]:
    """A gradient of small multiples of 1/16, different per step and per element (exact in float32)."""
    out = {}
    for k, (name, shape) in enumerate(MODEL_SHAPES.items()):
        n = torch.Size(shape).numel()
        out[name] = ((torch.arange(n) % 5 + step + k) * SIXTEENTH).reshape(shape)
    return out


@pytest.mark.timeout(60)
def test_shards_restore_exactly_the_state_they_stopped_with(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    config = ServerConfig(
        mode="sync", workers=1, optimizer="adam", lr=0.01, checkpoint_dir=str(tmp_path), checkpoint_every="0"
    )
    first = ps_cluster_factory(config, shards=2)
    model = _model()
    with PSClient(first.address, worker_id="trainer", timeout=CLIENT_TIMEOUT) as client:
        client.register(model)
        for step in range(1, 5):
            client.push(_grad(step))
            client.pull(model)
    saved = [s.state_bytes() for s in first.shards]
    versions = [s.describe().version for s in first.shards]
    assert versions == [4, 4]
    # checkpoint_every="0": only the Init's (version 0, the base the write-ahead log replays over) and at stop
    assert all(s.describe().stats.checkpoints == 1 for s in first.shards)

    first.stop()

    assert [s.describe().stats.checkpoints for s in first.shards] == [2, 2]
    for index in (0, 1):
        assert [p.name for p in checkpoint.list_checkpoints(tmp_path, index)] == [
            checkpoint.path_for(tmp_path, index, v).name for v in (4, 0)
        ]
    second = ps_cluster_factory(config, shards=2)
    assert [s.state_bytes() for s in second.shards] == saved
    assert [s.describe().version for s in second.shards] == versions
    # The applied-push log came back too: a retried push of the last step is recognised, not applied again.
    with PSClient(second.address, worker_id="trainer", timeout=CLIENT_TIMEOUT) as client:
        client.push(_grad(4), step=4)
    assert [s.state_bytes() for s in second.shards] == saved
    assert [s.describe().stats.duplicate_pushes for s in second.shards] == [1, 1]


def _expected_shard_params(values: dict[str, torch.Tensor], num_shards: int, index: int) -> torch.Tensor:
    """The flat buffer shard `index` holds for these tensor values (its pieces back to back)."""
    specs = [TensorSpec(name, tuple(t.shape)) for name, t in values.items()]
    pieces = place(specs, num_shards).shards[index]
    return torch.cat([values[p.name].reshape(-1)[p.start : p.start + p.length] for p in pieces])


def _weights_after(steps: int) -> dict[str, torch.Tensor]:
    """SGD with lr=1 and one worker: initial weights minus the sum of the first `steps` gradients."""
    out = _model()
    for step in range(1, steps + 1):
        for name, g in _grad(step).items():
            out[name] -= g
    return out


def _wait_for_checkpoint(directory: Path, index: int, version: int, timeout: float = 10.0) -> Snapshot:
    """Wait for the background writer to put a shard's checkpoint of one version in place, and load it."""
    path = checkpoint.path_for(directory, index, version)
    wait_for(path.exists, timeout, f"checkpoint {path.name}", 0.02)
    return checkpoint.load(path)  # the file appears by rename, complete


@pytest.mark.timeout(60)
def test_checkpoint_every_n_versions_gives_a_consistent_set(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    config = ServerConfig(
        mode="sync", workers=1, optimizer="sgd", lr=1.0, checkpoint_dir=str(tmp_path), checkpoint_every="3"
    )
    cluster = ps_cluster_factory(config, shards=2)
    model = _model()
    with PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as client:
        client.register(model)
        for step in range(1, 8):
            client.push(_grad(step))
            assert client.pull(model) == step
            if step == 3:
                at3 = [_wait_for_checkpoint(tmp_path, index, 3) for index in (0, 1)]
    for index, snap in enumerate(at3):
        assert torch.equal(snap.params, _expected_shard_params(_weights_after(3), 2, index))

    cluster.stop()  # writes the final checkpoint (version 7) and waits for the writer

    for index in (0, 1):
        files = checkpoint.list_checkpoints(tmp_path, index)
        # 3 and 6 by schedule, 7 at stop; KEEP=2 leaves the newest two.
        assert files == [checkpoint.path_for(tmp_path, index, v) for v in (7, 6)]
        for path, version in zip(files, (7, 6), strict=True):
            snap = checkpoint.load(path)
            assert snap.version == version and snap.shard_index == index and snap.num_shards == 2
            assert torch.equal(snap.params, _expected_shard_params(_weights_after(version), 2, index))
    assert [s.describe().stats.checkpoints for s in cluster.shards] == [4, 4]  # and the Init's, version 0


# -- shards: time-based checkpoints ----------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_checkpoint_every_n_seconds_writes_after_the_interval_with_no_version_trigger(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    timed_dir, final_dir = tmp_path / "every-second", tmp_path / "only-at-stop"
    config = ServerConfig(
        mode="sync", workers=1, optimizer="sgd", lr=1.0, checkpoint_dir=str(timed_dir), checkpoint_every="1s"
    )
    assert config.checkpoint_schedule() == (0, 1.0), "a time-based schedule has no version trigger"
    timed = ps_cluster_factory(config, shards=2)
    only_at_stop = ps_cluster_factory(config.replace(checkpoint_dir=str(final_dir), checkpoint_every="0"), shards=2)
    for cluster in (timed, only_at_stop):
        model = _model()
        with PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as client:
            client.register(model)
            client.push(_grad(1))
            assert client.pull(model) == 1

    # One push, then nothing: the shards' maintenance ticks write version 1 once a second has passed.
    for index in (0, 1):
        snap = _wait_for_checkpoint(timed_dir, index, 1, timeout=60.0)
        assert (snap.version, snap.shard_index, snap.num_shards) == (1, index, 2)
        assert torch.equal(snap.params, _expected_shard_params(_weights_after(1), 2, index))
    assert all(s.describe().stats.checkpoints >= 1 for s in timed.shards)

    # checkpoint_every="0": no tick ever writes one (a tick now comes a second or more after the push)...
    for shard in only_at_stop.shards:
        shard.tick()
    assert [s.describe().stats.checkpoints for s in only_at_stop.shards] == [1, 1]  # the Init's (version 0)
    for index in (0, 1):
        assert checkpoint.list_checkpoints(final_dir, index) == [checkpoint.path_for(final_dir, index, 0)]
    # ...only the stop does.
    only_at_stop.stop()
    assert [s.describe().stats.checkpoints for s in only_at_stop.shards] == [2, 2]
    for index in (0, 1):
        assert checkpoint.list_checkpoints(final_dir, index) == [
            checkpoint.path_for(final_dir, index, v) for v in (1, 0)
        ]


def _pushed_shard(config: ServerConfig, pushes: int) -> Shard:
    """Shard 0 of a 2-shard job (not started: no maintenance thread ticks it) after `pushes` applied pushes."""
    shard = Shard(config, 0, ADDRESSES)
    placement = place(SPECS, 2)
    model = shard.prepare_init(SPECS, 2, placement.digest)
    shard.commit_init(model)
    shard.join("w", "")
    for step in range(1, pushes + 1):
        grad = torch.full((model.numel,), step * SIXTEENTH).numpy()
        assert shard.push("w", step, step - 1, grad, placement.digest) == (step, True)
    return shard


@pytest.mark.parametrize("every", ["0", "3600s", "100"])
def test_a_tick_takes_no_checkpoint_unless_a_time_based_one_is_due(tmp_path: Path, every: str) -> None:
    config = ServerConfig(mode="async", optimizer="sgd", lr=0.1, checkpoint_dir=str(tmp_path), checkpoint_every=every)
    shard = _pushed_shard(config, pushes=3)
    try:
        for _ in range(3):
            shard.tick()
        assert shard.describe().stats.checkpoints == 0
    finally:
        shard.close()  # the final checkpoint, written before close returns
    assert shard.describe().stats.checkpoints == 1
    assert [checkpoint.load(p).version for p in checkpoint.list_checkpoints(tmp_path, 0)] == [3]


@pytest.mark.timeout(90)
def test_a_tick_takes_a_checkpoint_once_the_interval_has_passed(tmp_path: Path) -> None:
    config = ServerConfig(mode="async", optimizer="sgd", lr=0.1, checkpoint_dir=str(tmp_path), checkpoint_every="0.05s")
    shard = _pushed_shard(config, pushes=3)
    try:
        assert shard.describe().stats.checkpoints == 0, "pushes never checkpoint on a time-based schedule"

        def ticked() -> int:
            shard.tick()
            return shard.describe().stats.checkpoints

        wait_for(ticked, 60.0, "a tick to take a checkpoint on a 0.05 s schedule", 0.01)
        snap = _wait_for_checkpoint(tmp_path, 0, 3, timeout=60.0)
        assert snap.version == 3
        assert torch.equal(snap.params, shard.snapshot().params)
    finally:
        shard.close()


# -- shards: restore refuses a checkpoint of another job -----------------------------------------------------------


ADDRESSES = ("127.0.0.1:1", "127.0.0.1:2")


def _write_shard_checkpoint(directory: Path, optimizer: str = "adam") -> bytes:
    """Shard 0 of a 2-shard job with one applied update, saved to `directory`; return its state_bytes."""
    shard = Shard(ServerConfig(mode="async", optimizer=optimizer, lr=0.1), 0, ADDRESSES)
    try:
        placement = place(SPECS, 2)
        model = shard.prepare_init(SPECS, 2, placement.digest)
        model.params.copy_(torch.arange(model.numel, dtype=torch.float32))
        shard.commit_init(model)
        shard.join("w", "")
        grad = torch.full((model.numel,), SIXTEENTH).numpy()
        assert shard.push("w", 1, 0, grad, placement.digest) == (1, True)
        checkpoint.save(directory, shard.snapshot())
        return shard.state_bytes()
    finally:
        shard.close()


def _restore(directory: Path, addresses: tuple[str, ...], optimizer: str = "adam") -> Shard:
    """A new shard 0 that restores from `directory` (the caller closes it)."""
    return Shard(ServerConfig(mode="async", optimizer=optimizer, lr=0.1, checkpoint_dir=str(directory)), 0, addresses)


def test_shard_restore_adopts_a_matching_checkpoint(tmp_path: Path) -> None:
    saved = _write_shard_checkpoint(tmp_path)
    shard = _restore(tmp_path, ADDRESSES)
    try:
        assert shard.restore() is True
        assert shard.state_bytes() == saved
        assert shard.describe().version == 1 and shard.describe().digest == place(SPECS, 2).digest
    finally:
        shard.close()


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "momentum"])
def test_a_checkpoint_of_an_unfused_optimizer_resumes_on_the_fused_kernel(tmp_path: Path, optimizer: str) -> None:
    """A checkpoint written before the shards ran torch's fused kernels (its param_groups say fused=None) resumes
    fused, and its next step is the one the unfused optimizer would have taken, to a float32 rounding."""
    config = ServerConfig(mode="async", optimizer=optimizer, lr=0.1, checkpoint_dir=str(tmp_path))
    placement = place(SPECS, 2)
    gen = torch.Generator().manual_seed(1)
    old = Shard(config, 0, ADDRESSES)
    try:
        model = old.prepare_init(SPECS, 2, placement.digest)
        model.params.copy_(torch.randn(model.numel, generator=gen))
        for group in model.optimizer.param_groups:  # what an earlier release built: torch's per-operation code
            group["fused"] = None
        old.commit_init(model)
        old.join("w", "")
        for step in (1, 2):
            grad = torch.randn(model.numel, generator=gen).numpy()
            assert old.push("w", step, step - 1, grad, placement.digest) == (step, True)
        snap = old.snapshot()
        assert all(g["fused"] is None for g in snap.optimizer_state["param_groups"])
        checkpoint.save(tmp_path, snap)
    finally:
        old.close()
    # The step the unfused optimizer takes next from the saved state.
    grad = torch.randn(model.numel, generator=gen)
    want = snap.params.clone()
    reference = make_optimizer(config, want)
    reference.load_state_dict(snap.optimizer_state)
    assert all(g["fused"] is None for g in reference.param_groups)
    want.grad = grad.clone()
    reference.step()
    shard = Shard(config, 0, ADDRESSES)
    try:
        assert shard.restore() is True
        resumed = shard.require_model()
        assert all(g["fused"] is True for g in resumed.optimizer.param_groups)
        before = resumed.params.clone()
        shard.join("w", "")
        assert shard.push("w", 3, 2, grad.numpy(), placement.digest) == (3, True)
        assert not torch.equal(resumed.params, before), "the step moved nothing"
        torch.testing.assert_close(resumed.params, want, rtol=1e-6, atol=1e-7)
    finally:
        shard.close()


def test_finished_workers_are_saved_at_once_and_counted_after_a_restart(tmp_path: Path) -> None:
    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.1, checkpoint_dir=str(tmp_path))
    placement = place(SPECS, 2)
    first = Shard(config, 0, ADDRESSES)
    try:
        first.commit_init(first.prepare_init(SPECS, 2, placement.digest))
        for w in ("a", "b"):
            first.join(w, "")
        first.leave("a", finished=True)
        first.leave("a", finished=True)  # a second leave of a gone worker counts nothing
        assert first.finished_workers == 1 and not first.done.is_set()
    finally:
        first.checkpoints.close()  # flush the checkpoint the finish took; no final one
    again = Shard(config, 0, ADDRESSES)
    try:
        assert again.restore() is True
        assert again.finished_workers == 1, "the finish before the restart was lost"
        again.join("b", "")
        again.leave("b", finished=True)
        assert again.done.is_set(), "both workers finished, none is live: the job is done"
    finally:
        again.close()


def test_shard_restore_with_nothing_to_restore_starts_empty(tmp_path: Path) -> None:
    shard = _restore(tmp_path, ADDRESSES)
    try:
        assert shard.restore() is False
        assert shard.model is None and shard.version == 0
    finally:
        shard.close()


@pytest.mark.parametrize(
    ("addresses", "optimizer", "patterns"),
    [
        pytest.param(ADDRESSES, "sgd", ("holds adam state", "--optimizer sgd"), id="other-optimizer"),
        pytest.param(ADDRESSES[:1], "adam", ("job of 2 shards", "this one has 1"), id="other-shard-count"),
        pytest.param((*ADDRESSES, "127.0.0.1:3"), "adam", ("job of 2 shards", "has 3"), id="more-shards"),
    ],
)
def test_shard_restore_refuses_a_checkpoint_of_another_job(
    tmp_path: Path, addresses: tuple[str, ...], optimizer: str, patterns: tuple[str, ...]
) -> None:
    _write_shard_checkpoint(tmp_path)
    shard = _restore(tmp_path, addresses, optimizer)
    try:
        with pytest.raises(ValueError) as info:
            shard.restore()
        for pattern in (*patterns, "another --checkpoint-dir", str(tmp_path)):
            assert pattern in str(info.value)
        assert shard.model is None and shard.version == 0
    finally:
        shard.close()
