"""Fuzzing the surfaces issue 36 found wanting, driven by their own definitions so that a field added later is fuzzed
too: each proto message is generated from its descriptor (every field, of its type, edge values included), and the
host group's messages from worker/client/group_wire.KINDS.

- a table header (TableSpec, every field) goes through the shard's own path from the wire (tables_from_proto, then
  ShardTables): refused with InvalidArgument or TooLarge, or taken with next to nothing allocated; never another
  exception, never a large allocation;
- ExportRowsRequest (every field) against a live shard: its status is never INTERNAL or UNKNOWN, and the shard is
  byte-identical after it;
- a compressed push (Compression, every field, and a payload of any length) on the data socket: never INTERNAL,
  and a refused one changes nothing;
- the host group's decoder: any bytes, any JSON, and each kind's fields with values of any type are either taken,
  every field of its declared type, or refused with BadMessage; nothing else escapes.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import data_socket as ds
from support.raw_job import Raw

from paramserver.config import ServerConfig
from paramserver.errors import InvalidArgument, TooLarge
from paramserver.server.service import tables_from_proto
from paramserver.shard.sparse.tables import ShardTables
from paramserver.tables import TableSpec, spec_to_proto
from paramserver.v1 import ps_pb2
from worker.client import group_wire

pytestmark = pytest.mark.timeout(300)

_INTS = {
    FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
    FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
}


def _int(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, 1, 2, 3, -1, 64, 65, 1 << 20, 1 << 26, 1 << 31, 1 << 32, 1 << 62, hi, lo) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INTS:
        return _int(*_INTS[t])
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(st.floats(width=32 if t == FieldDescriptor.TYPE_FLOAT else 64), st.sampled_from([0.0, 1.0]))
    if t == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=24)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 300))
    assert t == FieldDescriptor.TYPE_MESSAGE
    return message_of(field.message_type, depth + 1)


def field_strategies(descriptor: Descriptor, depth: int = 0) -> dict[str, st.SearchStrategy[Any]]:
    """A strategy for every field the descriptor has (a list for a repeated one)."""
    fields = {}
    for field in descriptor.fields:
        if field.is_repeated:
            fields[field.name] = st.lists(_value(field, depth), max_size=3)
        else:
            fields[field.name] = _value(field, depth)
    return fields


def message_of(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of this type with any subset of its fields (every field the descriptor has) set to values of the
    field's type, edge values favoured; nested messages two levels deep."""
    cls = getattr(ps_pb2, descriptor.name)
    if depth > 2:
        return st.just(cls())
    fields = field_strategies(descriptor, depth)

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        msg = cls()
        for name in draw(st.lists(st.sampled_from(sorted(fields)), unique=True)) if fields else []:
            value = draw(fields[name])
            target = getattr(msg, name)
            if isinstance(value, list):
                for v in value:
                    if hasattr(v, "SerializeToString"):
                        target.add().CopyFrom(v)
                    else:
                        target.append(v)
            elif hasattr(value, "SerializeToString"):
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return build()


# -- table headers ------------------------------------------------------------------------------------------------

CONFIG = ServerConfig(optimizer="adagrad", lr=0.1, max_table_bytes=32 << 20)


def _over_a_valid_table(fuzzed: Any) -> Any:
    """The fuzzed fields over a valid table (most fuzzed specs are refused for a name or dim alone otherwise)."""
    spec = spec_to_proto(TableSpec("t", 64))
    spec.MergeFrom(fuzzed)
    return spec


_TABLE_SPECS = st.one_of(
    message_of(ps_pb2.TableSpec.DESCRIPTOR),
    message_of(ps_pb2.TableSpec.DESCRIPTOR).map(_over_a_valid_table),
    st.integers(1, (1 << 63) - 1).map(lambda n: spec_to_proto(TableSpec("t", 64, num_embeddings=n))),
)


@settings(max_examples=300, deadline=None)
@given(tables=st.lists(_TABLE_SPECS, min_size=1, max_size=3, unique_by=lambda t: t.name), shards=st.integers(1, 8))
def test_a_fuzzed_table_header_is_refused_or_costs_next_to_nothing(tables: list[Any], shards: int) -> None:
    try:
        specs = tables_from_proto(tables)
        made = ShardTables(specs, 0, shards, CONFIG)
    except (InvalidArgument, TooLarge):
        return
    # Taken: nothing in proportion to the IDs declared (direct indexes stay within a quarter of the cap).
    assert sum(g.nbytes for g in made.groups) <= CONFIG.max_table_bytes // 4 + (1 << 20)


# -- ExportRows and compressed pushes against a live shard -------------------------------------------------------

_NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=message_of(ps_pb2.ExportRowsRequest.DESCRIPTOR), own_digest=st.booleans())
def test_a_fuzzed_export_request_is_answered_with_its_status_and_changes_nothing(
    raw: Raw, request: Any, own_digest: bool
) -> None:
    if own_digest:
        request.model_digest = raw.digest
    before = raw.shard.state_bytes()
    try:
        for _ in raw.stub.ExportRows(request, timeout=30):
            pass
    except grpc.RpcError as exc:
        assert exc.code() not in _NEVER, exc.details()
    assert raw.shard.state_bytes() == before


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=message_of(ps_pb2.Compression.DESCRIPTOR), payload=st.binary(max_size=200), push=st.booleans())
def test_a_fuzzed_compressed_push_never_fails_inside_the_shard(
    raw: Raw, message: Any, payload: bytes, push: bool
) -> None:
    before = raw.shard.state_bytes()
    version = raw.shard.version
    request = raw.request(push=push, step=version + 1, base_version=version, compression=message)
    with ds.session(raw) as bell:
        bell.send(request, payload=payload)
        body = bell.reply()
    if body is None or body[0] != 0:
        if body is not None:
            assert body[0] not in (grpc.StatusCode.INTERNAL.value[0], grpc.StatusCode.UNKNOWN.value[0]), body
        assert raw.shard.state_bytes() == before


# -- the host group's messages ------------------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


def _decoded_or_refused(raw: bytes, kinds: list[str]) -> tuple[str, dict[str, Any]] | None:
    try:
        kind, doc = group_wire.decode(raw, kinds, "a fuzzer")
    except group_wire.BadMessage:
        return None
    fields = group_wire.KINDS[kind]
    assert kind in kinds and set(doc) <= set(fields)
    assert all(group_wire._typed(fields[k][0], v) for k, v in doc.items())
    return kind, doc


@settings(max_examples=300, deadline=None)
@given(raw=st.one_of(st.binary(max_size=200), _JSON.map(lambda d: json.dumps(d).encode())))
def test_any_bytes_to_the_host_group_are_taken_typed_or_refused(raw: bytes) -> None:
    _decoded_or_refused(raw, sorted(group_wire.KINDS))


_ANY = st.one_of(_JSON, st.integers(-(1 << 70), 1 << 70), st.text(max_size=40), st.sampled_from(["ab" * 16]))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_each_kind_of_group_message_with_fuzzed_fields_is_taken_only_when_well_typed(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(sorted(group_wire.KINDS)))
    fields = group_wire.KINDS[kind]
    doc = {k: data.draw(_ANY) for k in data.draw(st.lists(st.sampled_from(sorted(fields)), unique=True))}
    if data.draw(st.booleans()):
        doc[data.draw(st.text(max_size=6))] = data.draw(_ANY)
    raw = json.dumps(doc).encode()
    well_typed = {k for k, (_, needed) in fields.items() if needed} <= set(doc) <= set(fields) and all(
        group_wire._typed(fields[k][0], v) for k, v in doc.items()
    )
    got = _decoded_or_refused(raw, [kind])
    assert (got is not None) == well_typed, (doc, got)


def test_the_fuzzers_cover_every_field_of_the_new_surfaces() -> None:
    """The generators read the descriptors and KINDS: a field added there is generated here with no change."""
    for descriptor in (ps_pb2.TableSpec.DESCRIPTOR, ps_pb2.ExportRowsRequest.DESCRIPTOR, ps_pb2.Compression.DESCRIPTOR):
        assert set(field_strategies(descriptor)) == {f.name for f in descriptor.fields}
    assert {"hello", "ask", "told", "where", "error"} <= set(group_wire.KINDS)
