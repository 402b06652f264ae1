"""Unit tests for placement: which shard holds which element ranges of which tensor, and the model digest."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.placement import Piece, Placement, TensorSpec, digest, place

# --- helpers ------------------------------------------------------------------------------------------------


def _specs(sizes: dict[str, int]) -> list[TensorSpec]:
    """One 1-D tensor per (name, numel), in the dict's (model) order."""
    return [TensorSpec(name, (n,)) for name, n in sizes.items()]


def _names(placement: Placement, shard: int) -> list[str]:
    return [p.name for p in placement.shards[shard]]


def _pieces_of(placement: Placement, name: str) -> list[tuple[int, Piece]]:
    """Every (shard, piece) of tensor `name`, sorted by start."""
    found = [(k, p) for k, ps in enumerate(placement.shards) for p in ps if p.name == name]
    return sorted(found, key=lambda kp: kp[1].start)


def _assert_covers_exactly_once(placement: Placement, specs: Sequence[TensorSpec]) -> None:
    """Each tensor's pieces, sorted by start, tile [0, numel) with no gap and no overlap; no stray names."""
    known = {s.name for s in specs}
    for ps in placement.shards:
        for p in ps:
            assert p.name in known, f"piece of unknown tensor {p.name!r}"
            assert p.start >= 0 and p.length >= 0
    for spec in specs:
        pieces = [p for _, p in _pieces_of(placement, spec.name)]
        assert pieces, f"{spec.name!r} is on no shard"
        pos = 0
        for p in pieces:
            assert p.start == pos, f"{spec.name!r}: gap or overlap at element {pos} (piece starts at {p.start})"
            pos += p.length
        assert pos == spec.numel, f"{spec.name!r}: pieces cover {pos} of {spec.numel} elements"
        if spec.numel > 0:
            assert all(p.length > 0 for p in pieces), f"{spec.name!r} has an empty piece"


# --- strategies ---------------------------------------------------------------------------------------------

_small_shapes = st.lists(st.integers(0, 50), min_size=0, max_size=3).map(tuple)
_big_shapes = st.one_of(
    st.tuples(st.integers(101, 5000)),
    st.tuples(st.integers(11, 80), st.integers(11, 80)),
)
_shapes = st.one_of(_small_shapes, _small_shapes, _small_shapes, _big_shapes)


@st.composite
def _spec_lists(draw: st.DrawFn) -> list[TensorSpec]:
    shapes = draw(st.lists(_shapes, min_size=1, max_size=20))
    names = draw(st.lists(st.text(min_size=1, max_size=12), min_size=len(shapes), max_size=len(shapes), unique=True))
    return [TensorSpec(name, shape) for name, shape in zip(names, shapes, strict=True)]


_num_shards = st.integers(1, 5)
_slice_elements = st.sampled_from([1, 7, 100, 100, 100, 1000])


# --- TensorSpec ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "numel"), [((), 1), ((0,), 0), ((7,), 7), ((3, 4), 12), ((2, 0, 5), 0)])
def test_numel_is_the_product_of_the_shape(shape: tuple[int, ...], numel: int) -> None:
    assert TensorSpec("t", shape).numel == numel


def test_scalar_tensor_is_placed_as_one_element() -> None:
    placement = place([TensorSpec("w", (4, 4)), TensorSpec("scale", ())], num_shards=2)
    assert _pieces_of(placement, "scale") == [(1, Piece("scale", 0, 1))]
    assert placement.shard_elements(0) + placement.shard_elements(1) == 17


# --- coverage: every element on exactly one shard -----------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(specs=_spec_lists(), num_shards=_num_shards, slice_elements=_slice_elements)
def test_every_element_is_on_exactly_one_shard(specs: list[TensorSpec], num_shards: int, slice_elements: int) -> None:
    placement = place(specs, num_shards, slice_elements)

    assert placement.num_shards == num_shards
    assert placement.specs == tuple(specs)
    assert placement.digest == digest(specs, num_shards, slice_elements)
    _assert_covers_exactly_once(placement, specs)
    assert sum(placement.shard_elements(k) for k in range(num_shards)) == sum(s.numel for s in specs)


@settings(max_examples=200, deadline=None)
@given(specs=_spec_lists(), num_shards=_num_shards, slice_elements=_slice_elements)
def test_big_tensors_are_sliced_and_small_ones_kept_whole(
    specs: list[TensorSpec], num_shards: int, slice_elements: int
) -> None:
    placement = place(specs, num_shards, slice_elements)

    for spec in specs:
        pieces = _pieces_of(placement, spec.name)
        if spec.numel > slice_elements and num_shards > 1:
            # One contiguous run per shard, in shard order: ceil(n / shards) each, the last one takes the rest.
            step = math.ceil(spec.numel / num_shards)
            assert [k for k, _ in pieces] == list(range(len(pieces)))
            assert [p.start for _, p in pieces] == [k * step for k in range(len(pieces))]
            assert all(p.length == step for _, p in pieces[:-1])
            assert 0 < pieces[-1][1].length <= step
            if spec.numel >= num_shards * (num_shards - 1):
                assert len(pieces) == num_shards, "a big tensor must be spread over every shard"
        else:
            assert len(pieces) == 1
            assert pieces[0][1] == Piece(spec.name, 0, spec.numel)


@settings(max_examples=200, deadline=None)
@given(specs=_spec_lists(), num_shards=_num_shards, slice_elements=_slice_elements)
def test_pieces_within_a_shard_are_in_model_order(
    specs: list[TensorSpec], num_shards: int, slice_elements: int
) -> None:
    placement = place(specs, num_shards, slice_elements)
    order = {s.name: i for i, s in enumerate(specs)}

    for shard in placement.shards:
        keys = [(order[p.name], p.start) for p in shard]
        assert keys == sorted(keys)
        assert len({p.name for p in shard}) == len(shard), "a shard holds at most one piece of each tensor"


# --- determinism and the digest -----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(specs=_spec_lists(), num_shards=_num_shards, slice_elements=_slice_elements)
def test_placement_is_deterministic(specs: list[TensorSpec], num_shards: int, slice_elements: int) -> None:
    first = place(specs, num_shards, slice_elements)
    # Fresh but equal spec objects, passed as a tuple: only the values may matter.
    again = place(tuple(TensorSpec(s.name, tuple(s.shape)) for s in specs), num_shards, slice_elements)
    assert again == first
    assert digest(list(specs), num_shards, slice_elements) == first.digest


def test_digest_is_a_sha256_hex_string_equal_for_equal_inputs() -> None:
    specs = [TensorSpec("fc.weight", (10, 64)), TensorSpec("fc.bias", (10,))]
    d = digest(specs, 3, 100)
    assert len(d) == 64 and int(d, 16) >= 0
    assert digest([TensorSpec("fc.weight", (10, 64)), TensorSpec("fc.bias", (10,))], 3, 100) == d


def test_digest_defaults_to_the_placement_slice_size() -> None:
    specs = [TensorSpec("w", (3,))]
    assert place(specs, 2).digest == digest(specs, 2)


_BASE = [TensorSpec("fc.weight", (10, 64)), TensorSpec("fc.bias", (10,)), TensorSpec("scale", ())]


@pytest.mark.parametrize(
    ("specs", "num_shards", "slice_elements"),
    [
        pytest.param([TensorSpec("fc.weights", (10, 64)), *_BASE[1:]], 3, 100, id="renamed"),
        pytest.param([TensorSpec("fc.weight", (64, 10)), *_BASE[1:]], 3, 100, id="same-numel-other-shape"),
        pytest.param([TensorSpec("fc.weight", (640,)), *_BASE[1:]], 3, 100, id="flattened"),
        pytest.param([*_BASE[:2], TensorSpec("scale", (1,))], 3, 100, id="scalar-vs-1-element"),
        pytest.param([_BASE[1], _BASE[0], _BASE[2]], 3, 100, id="reordered"),
        pytest.param(_BASE[:2], 3, 100, id="tensor-dropped"),
        pytest.param(_BASE, 2, 100, id="num-shards"),
        pytest.param(_BASE, 3, 101, id="slice-elements"),
    ],
)
def test_digest_changes_with_any_input(specs: list[TensorSpec], num_shards: int, slice_elements: int) -> None:
    assert digest(specs, num_shards, slice_elements) != digest(_BASE, 3, 100)


# --- the exact algorithm on hand-computed cases -------------------------------------------------------------


def test_whole_tensors_go_largest_first_to_the_least_loaded_shard() -> None:
    # a(10) -> s0 (tie, lower index); b(9) -> s1; c(8) -> s1 (9 < 10); d(1) -> s0 (10 < 17).
    placement = place(_specs({"a": 10, "b": 9, "c": 8, "d": 1}), num_shards=2, slice_elements=100)
    assert placement.shards == (
        (Piece("a", 0, 10), Piece("d", 0, 1)),
        (Piece("b", 0, 9), Piece("c", 0, 8)),
    )
    assert [placement.shard_elements(k) for k in range(2)] == [11, 17]


def test_size_order_is_independent_of_model_order() -> None:
    # Same sizes as above in another model order: the same shards, each listed in model order.
    placement = place(_specs({"d": 1, "c": 8, "b": 9, "a": 10}), num_shards=2, slice_elements=100)
    assert [_names(placement, k) for k in range(2)] == [["d", "a"], ["c", "b"]]


def test_equal_sizes_tie_break_by_model_order_then_shard_index() -> None:
    placement = place(_specs({"x": 5, "y": 5, "z": 5, "w": 5, "v": 5}), num_shards=3, slice_elements=100)
    assert [_names(placement, k) for k in range(3)] == [["x", "w"], ["y", "v"], ["z"]]


def test_sliced_tensor_loads_shards_before_whole_tensors_are_packed() -> None:
    # Model order d, b, emb, a, c. emb (250 > 100) is cut 125 / 125 first; then
    # a(10) -> s0 (tie), b(9) -> s1, c(8) -> s1 (134 < 135), d(1) -> s0 (135 < 142).
    specs = [
        TensorSpec("d", ()),
        TensorSpec("b", (9,)),
        TensorSpec("emb", (25, 10)),
        TensorSpec("a", (2, 5)),
        TensorSpec("c", (2, 2, 2)),
    ]
    placement = place(specs, num_shards=2, slice_elements=100)
    assert placement.shards == (
        (Piece("d", 0, 1), Piece("emb", 0, 125), Piece("a", 0, 10)),
        (Piece("b", 0, 9), Piece("emb", 125, 125), Piece("c", 0, 8)),
    )
    assert [placement.shard_elements(k) for k in range(2)] == [136, 142]


@pytest.mark.parametrize(
    ("numel", "num_shards", "lengths"),
    [
        (1001, 4, [251, 251, 251, 248]),
        (1000, 4, [250, 250, 250, 250]),
        (101, 5, [21, 21, 21, 21, 17]),
        (102, 2, [51, 51]),
        (103, 3, [35, 35, 33]),
    ],
)
def test_big_tensor_is_cut_into_one_ceil_sized_run_per_shard(numel: int, num_shards: int, lengths: list[int]) -> None:
    placement = place([TensorSpec("emb", (numel,))], num_shards, slice_elements=100)
    starts = [sum(lengths[:k]) for k in range(num_shards)]
    assert placement.shards == tuple((Piece("emb", s, n),) for s, n in zip(starts, lengths, strict=True))


def test_tensor_at_the_slice_limit_stays_whole() -> None:
    placement = place([TensorSpec("w", (10, 10))], num_shards=3, slice_elements=100)
    assert placement.shards == ((Piece("w", 0, 100),), (), ())


def test_one_shard_never_slices() -> None:
    specs = [TensorSpec("emb", (5000,)), TensorSpec("b", (3,))]
    placement = place(specs, num_shards=1, slice_elements=100)
    assert placement.shards == ((Piece("emb", 0, 5000), Piece("b", 0, 3)),)


def test_no_tensors_gives_empty_shards() -> None:
    placement = place([], num_shards=3)
    assert placement.shards == ((), (), ())
    assert placement.num_shards == 3


# --- load balance -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("count", "num_shards"), [(17, 4), (100, 3), (5, 5), (3, 5), (64, 2)])
def test_equal_tensors_balance_within_one_tensor(count: int, num_shards: int) -> None:
    size = 30
    placement = place([TensorSpec(f"layer{i}", (size,)) for i in range(count)], num_shards, slice_elements=100)
    loads = [placement.shard_elements(k) for k in range(num_shards)]
    assert max(loads) - min(loads) <= size
    assert sum(loads) == count * size


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 200), min_size=1, max_size=40), num_shards=_num_shards)
def test_whole_tensors_balance_within_the_largest_tensor(sizes: list[int], num_shards: int) -> None:
    placement = place([TensorSpec(f"t{i}", (n,)) for i, n in enumerate(sizes)], num_shards, slice_elements=1000)
    loads = [placement.shard_elements(k) for k in range(num_shards)]
    assert max(loads) - min(loads) <= max(sizes)


# --- refusals -----------------------------------------------------------------------------------------------


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        place([TensorSpec("w", (3,)), TensorSpec("b", (3,)), TensorSpec("w", (4,))], num_shards=2)


@pytest.mark.parametrize("num_shards", [0, -1])
def test_fewer_than_one_shard_is_refused(num_shards: int) -> None:
    with pytest.raises(ValueError, match="num_shards"):
        place([TensorSpec("w", (3,))], num_shards)
