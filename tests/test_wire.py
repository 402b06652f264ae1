"""Unit tests for the wire format: dtypes, encode / decode, chunking, and the chunk receiver's validation."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.errors import InvalidArgument, MalformedStream, NonFiniteGradient
from paramserver.wire.chunks import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    ChunkReceiver,
    decode_into,
    encode,
    encode_view,
    is_finite,
    itemsize,
    iter_chunks,
    wire_dtype,
)

DTYPES = [FLOAT32, BFLOAT16, FLOAT16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
SENTINEL = np.float32(-7.75)  # what targets hold before a receiver writes them; exact in every wire dtype

Chunk = tuple[int, int, bytes]

# --- helpers ------------------------------------------------------------------------------------------------


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _exact_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """Float32 values that every wire dtype holds exactly (k / 8 with |k| < 256: 8 significant bits)."""
    return (rng.integers(-255, 256, size=n) / 8).astype(np.float32)


def _log_uniform(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    mags = np.exp(rng.uniform(np.log(lo), np.log(hi), size=n))
    return (mags * rng.choice([-1.0, 1.0], size=n)).astype(np.float32)


def _roundtrip(values: np.ndarray, dtype: int) -> np.ndarray:
    out = np.full(len(values), SENTINEL, dtype=np.float32)
    decode_into(out, encode(values, dtype), dtype)
    return out


def _reference_decode(data: bytes, dtype: int) -> np.ndarray:
    """Decode wire bytes without the module under test: numpy for the IEEE types, bit shifting for bf16."""
    if dtype == FLOAT32:
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if dtype == FLOAT16:
        return np.frombuffer(data, dtype="<f2").astype(np.float32)
    return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def _targets(sizes: list[int]) -> list[np.ndarray]:
    return [np.full(n, SENTINEL, dtype=np.float32) for n in sizes]


def _labels(sizes: list[int]) -> list[str]:
    return [f"layer{k}.weight[0:{n}]" for k, n in enumerate(sizes)]


def _f32(*values: float) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


# --- dtypes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("float32", FLOAT32),
        ("fp32", FLOAT32),
        ("FP32", FLOAT32),
        ("bfloat16", BFLOAT16),
        ("bf16", BFLOAT16),
        ("BF16", BFLOAT16),
        ("float16", FLOAT16),
        ("fp16", FLOAT16),
        ("Float16", FLOAT16),
    ],
)
def test_wire_dtype_reads_names_case_insensitively(name: str, code: int) -> None:
    assert wire_dtype(name) == code


@pytest.mark.parametrize("code", DTYPES, ids=DTYPE_IDS)
def test_wire_dtype_keeps_known_codes(code: int) -> None:
    assert wire_dtype(code) == code


def test_unspecified_dtype_reads_as_float32() -> None:
    assert wire_dtype(0) == FLOAT32
    assert itemsize(0) == 4


@pytest.mark.parametrize("name", ["float64", "int8", "", "bf32"])
def test_unknown_dtype_name_is_a_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="unknown wire dtype"):
        wire_dtype(name)


@pytest.mark.parametrize("code", [4, 99, -1])
def test_unknown_dtype_code_is_a_malformed_stream(code: int) -> None:
    with pytest.raises(MalformedStream, match="unknown wire dtype"):
        wire_dtype(code)


@pytest.mark.parametrize(("dtype", "size"), [(FLOAT32, 4), (BFLOAT16, 2), (FLOAT16, 2)], ids=DTYPE_IDS)
def test_itemsize(dtype: int, size: int) -> None:
    assert itemsize(dtype) == size


# --- encode / decode ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (FLOAT32, bytes.fromhex("0000803f000020c0")),  # 1.0, -2.5 as little-endian IEEE float32
        (BFLOAT16, bytes.fromhex("803f20c0")),  # the upper halves of those float32 words
        (FLOAT16, bytes.fromhex("003c00c1")),  # IEEE half precision 0x3c00, 0xc100
    ],
    ids=DTYPE_IDS,
)
def test_encode_writes_little_endian_bytes(dtype: int, expected: bytes) -> None:
    assert encode(np.array([1.0, -2.5], dtype=np.float32), dtype) == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_encoded_length_is_itemsize_per_element(dtype: int) -> None:
    assert len(encode(np.zeros(13, dtype=np.float32), dtype)) == 13 * itemsize(dtype)
    assert encode(np.zeros(0, dtype=np.float32), dtype) == b""


def test_float32_round_trip_is_bit_exact() -> None:
    bits = _rng(1).integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)  # every kind of float32: subnormals, NaN payloads, infinities
    out = _roundtrip(values, FLOAT32)
    assert np.array_equal(out.view(np.uint32), bits)


def test_bf16_round_trip_is_within_half_an_ulp() -> None:
    values = _log_uniform(_rng(2), 4096, 1e-30, 1e30)
    out = _roundtrip(values, BFLOAT16)
    rel = np.abs(out.astype(np.float64) - values) / np.abs(values.astype(np.float64))
    assert rel.max() <= 2.0**-8
    assert np.array_equal(np.sign(out), np.sign(values))


def test_fp16_round_trip_is_within_its_precision_in_the_normal_range() -> None:
    values = _log_uniform(_rng(3), 4096, 2.0**-14, 65000.0)
    out = _roundtrip(values, FLOAT16)
    rel = np.abs(out.astype(np.float64) - values) / np.abs(values.astype(np.float64))
    assert rel.max() <= 1e-3
    assert rel.max() <= 2.0**-11  # half an ulp: rounding, not truncation


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_values_held_exactly_by_the_dtype_round_trip_exactly(dtype: int) -> None:
    values = _exact_values(_rng(4), 1000)
    assert np.array_equal(_roundtrip(values, dtype), values)


def test_bf16_encode_matches_torch_round_to_nearest_even() -> None:
    rng = _rng(5)
    bits = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)
    # Force half of them onto exact ties (low 16 bits 0x8000), where truncation and other roundings differ.
    bits[::2] = (bits[::2] & 0xFFFF0000) | 0x8000
    values = bits.view(np.float32)
    values = values[np.isfinite(values)]
    expected = torch.tensor(values).to(torch.bfloat16).float().numpy()
    out = _roundtrip(values, BFLOAT16)
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize(
    ("f32_bits", "bf16_bits"),
    [
        (0x3F808000, 0x3F80),  # 1 + 2**-8: a tie, the even neighbour is below
        (0x3F818000, 0x3F82),  # a tie whose even neighbour is above
        (0x3F808001, 0x3F81),  # just above a tie: up
        (0x3F807FFF, 0x3F80),  # just below a tie: down
        (0xBF818000, 0xBF82),  # negative tie
        (0x7F7FFFFF, 0x7F80),  # the largest float32 rounds up to +Inf
        (0x00000001, 0x0000),  # the smallest subnormal rounds to zero
    ],
)
def test_bf16_encode_rounds_to_nearest_even(f32_bits: int, bf16_bits: int) -> None:
    value = np.array([f32_bits], dtype=np.uint32).view(np.float32)
    assert encode(value, BFLOAT16) == struct.pack("<H", bf16_bits)


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT16], ids=DTYPE_IDS[1:])
def test_half_types_keep_nan_and_infinities(dtype: int) -> None:
    out = _roundtrip(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype=np.float32), dtype)
    assert np.isnan(out[0])
    assert out[1] == np.inf and out[2] == -np.inf
    assert out[3] == 0.0 and not np.signbit(out[3])
    assert out[4] == 0.0 and np.signbit(out[4])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_fp16_overflow_becomes_infinity() -> None:
    out = _roundtrip(np.array([1e5, -1e5, 65504.0], dtype=np.float32), FLOAT16)
    assert list(out) == [np.inf, -np.inf, 65504.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_encode_of_a_strided_view_equals_encode_of_a_copy(dtype: int) -> None:
    values = _log_uniform(_rng(6), 100, 1e-3, 1e3)
    assert encode(values[::3], dtype) == encode(values[::3].copy(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_into_a_slice_leaves_its_neighbours_alone(dtype: int) -> None:
    values = _exact_values(_rng(7), 5)
    buf = np.full(11, SENTINEL, dtype=np.float32)
    decode_into(buf[3:8], memoryview(encode(values, dtype)), dtype)
    assert np.array_equal(buf[3:8], values)
    assert np.all(buf[:3] == SENTINEL) and np.all(buf[8:] == SENTINEL)


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT16], ids=DTYPE_IDS[1:])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_into_gives_the_same_bits_on_torch_and_numpy(dtype: int, threads: int) -> None:
    """A writable buffer on one torch thread decodes in torch, anything else in numpy: the same bits either way,
    infinities, subnormals and signed zeros included; a NaN stays a NaN (torch quiets fp16's signalling ones)."""
    bits = np.arange(1 << 16, dtype=np.uint16)  # every half-type value
    wire = bytearray(bits.tobytes())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        from_writable = np.empty(len(bits), dtype=np.float32)
        decode_into(from_writable, memoryview(wire), dtype)
    finally:
        torch.set_num_threads(before)
    from_bytes = np.empty(len(bits), dtype=np.float32)
    decode_into(from_bytes, bytes(wire), dtype)  # read-only: always numpy
    expected = _reference_decode(bytes(wire), dtype)
    nan = np.isnan(expected)
    for out in (from_writable, from_bytes):
        assert np.array_equal(np.isnan(out), nan)
        assert np.array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))


def test_encode_reads_unspecified_dtype_as_float32() -> None:
    values = np.array([1.0, -2.5, 0.1], dtype=np.float32)
    assert encode(values, 0) == encode(values, FLOAT32)


def test_unspecified_dtype_stream_round_trips() -> None:
    source = _exact_values(_rng(8), 10)
    target = _targets([10])[0]
    receiver = ChunkReceiver([target], ["w[0:10]"], 0)
    for chunk in iter_chunks([source], 0, chunk_bytes=16):
        receiver.add(*chunk)
    receiver.finish()
    assert np.array_equal(target, source)


# --- is_finite ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([], True),
        ([0.0], True),
        ([1.0, -3.5, 3.4e38, -3.4e38, 1e-45], True),
        ([1.0, np.nan, 2.0], False),
        ([np.nan], False),
        ([1.0, 2.0, np.inf], False),
        ([-np.inf, 1.0], False),
        ([np.inf, -np.inf], False),
    ],
)
def test_is_finite(values: list[float], finite: bool) -> None:
    assert is_finite(np.array(values, dtype=np.float32)) is finite


def test_is_finite_finds_one_bad_element_anywhere() -> None:
    values = np.ones(1000, dtype=np.float32)
    for i in (0, 499, 999):
        for bad in (np.nan, np.inf, -np.inf):
            probe = values.copy()
            probe[i] = bad
            assert not is_finite(probe)
    assert is_finite(values)


# --- iter_chunks --------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=6),
    dtype=st.sampled_from(DTYPES),
    chunk_bytes=st.integers(4, 64),
    reuse=st.booleans(),
)
def test_iter_chunks_covers_every_element_once_in_order(
    sizes: list[int], dtype: int, chunk_bytes: int, reuse: bool
) -> None:
    rng = _rng(sum(sizes) + chunk_bytes)
    sources = [_exact_values(rng, n) for n in sizes]
    # With `reuse` each chunk is valid only until the next: copy each as it comes.
    chunks = [(p, o, bytes(d)) for p, o, d in iter_chunks(sources, dtype, chunk_bytes, reuse=reuse)]

    step = chunk_bytes // itemsize(dtype)
    seen = [np.zeros(0, dtype=np.float32) for _ in sizes]
    last = (-1, 0)
    for piece, offset, data in chunks:
        assert 0 < len(data) <= chunk_bytes
        assert len(data) % itemsize(dtype) == 0
        # Pieces in order, and within a piece each chunk starts where the previous one ended.
        assert piece >= last[0]
        assert offset == (last[1] if piece == last[0] else 0)
        assert offset == len(seen[piece])
        n = len(data) // itemsize(dtype)
        assert n == min(step, sizes[piece] - offset), "only a piece's last chunk may be short"
        seen[piece] = np.concatenate([seen[piece], _reference_decode(data, dtype)])
        last = (piece, offset + n)
    for src, got in zip(sources, seen, strict=True):
        assert np.array_equal(got, src)


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT16])
def test_encode_view_into_a_given_buffer_writes_there_what_encode_returns(dtype: int) -> None:
    values = _rng(7).standard_normal(1000).astype(np.float32)
    out = np.full(4096, 0xAB, dtype=np.uint8)
    view = encode_view(values[100:400], dtype, out)
    assert bytes(view) == encode(values[100:400], dtype)
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), out)
    assert (out[600:] == 0xAB).all(), "only the wire size of `out` is written"


def test_iter_chunks_makes_one_element_chunks_when_chunk_bytes_is_below_an_element() -> None:
    chunks = list(iter_chunks([np.arange(3, dtype=np.float32)], FLOAT32, chunk_bytes=1))
    assert [(p, o, len(d)) for p, o, d in chunks] == [(0, 0, 4), (0, 1, 4), (0, 2, 4)]


def test_iter_chunks_skips_empty_sources() -> None:
    sources = [np.zeros(0, dtype=np.float32), np.ones(3, dtype=np.float32), np.zeros(0, dtype=np.float32)]
    assert [(p, o) for p, o, _ in iter_chunks(sources, FLOAT32, chunk_bytes=8)] == [(1, 0), (1, 2)]


# --- ChunkReceiver: well-formed streams ---------------------------------------------------------------------

_SIZES = [10, 1, 0, 37]


def _source_and_stream(dtype: int, chunk_bytes: int = 12) -> tuple[list[np.ndarray], list[Chunk]]:
    sources = [_exact_values(_rng(9), n) for n in _SIZES]
    return sources, list(iter_chunks(sources, dtype, chunk_bytes))


def _feed(stream: list[Chunk], dtype: int, sizes: list[int] = _SIZES) -> list[np.ndarray]:
    targets = _targets(sizes)
    receiver = ChunkReceiver(targets, _labels(sizes), dtype)
    for chunk in stream:
        receiver.add(*chunk)
    receiver.finish()
    return targets


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_receiver_fills_targets_from_an_in_order_stream(dtype: int) -> None:
    sources, stream = _source_and_stream(dtype)
    for got, src in zip(_feed(stream, dtype), sources, strict=True):
        assert np.array_equal(got, src)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seed", range(5))
def test_receiver_fills_targets_from_a_shuffled_stream(dtype: int, seed: int) -> None:
    sources, stream = _source_and_stream(dtype)
    random.Random(seed).shuffle(stream)
    for got, src in zip(_feed(stream, dtype), sources, strict=True):
        assert np.array_equal(got, src)


def test_receiver_accepts_memoryview_data_and_the_unspecified_dtype() -> None:
    target = _targets([4])[0]
    receiver = ChunkReceiver([target], ["w[0:4]"], 0)
    receiver.add(0, 2, memoryview(_f32(3.0, 4.0)))
    receiver.add(0, 0, memoryview(_f32(1.0, 2.0)))
    receiver.finish()
    assert list(target) == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_receiver_with_no_pieces_finishes_and_refuses_any_chunk(dtype: int) -> None:
    """A shard may hold no piece of a small model: its stream is empty, and complete as it is."""
    receiver = ChunkReceiver([], [], dtype)
    receiver.finish()  # nothing missing: no MalformedStream
    for piece, offset, data in [(0, 0, encode(np.ones(2, dtype=np.float32), dtype)), (0, 0, b""), (1, 5, b"\0")]:
        with pytest.raises(MalformedStream, match=rf"piece {piece}\b") as info:
            receiver.add(piece, offset, data)
        assert isinstance(info.value, InvalidArgument)
    receiver.finish()  # the refused chunks left it as it was


# --- ChunkReceiver: malformed streams -----------------------------------------------------------------------


def _receiver(sizes: list[int], dtype: int = FLOAT32, check_finite: bool = False) -> ChunkReceiver:
    return ChunkReceiver(_targets(sizes), _labels(sizes), dtype, check_finite=check_finite)


@pytest.mark.parametrize("piece", [2, 3, 2**32 - 1, -1])
def test_chunk_for_a_piece_out_of_range_is_refused(piece: int) -> None:
    receiver = _receiver([4, 4])
    with pytest.raises(MalformedStream, match=rf"piece {piece}\b.*0\.\.1"):
        receiver.add(piece, 0, _f32(1.0))


@pytest.mark.parametrize(("dtype", "nbytes"), [(FLOAT32, 1), (FLOAT32, 6), (FLOAT32, 7), (BFLOAT16, 3), (FLOAT16, 5)])
def test_chunk_of_a_partial_element_is_refused(dtype: int, nbytes: int) -> None:
    receiver = _receiver([4, 8], dtype)
    with pytest.raises(MalformedStream, match=r"layer1\.weight\[0:8\].*whole number"):
        receiver.add(1, 0, b"\x00" * nbytes)


@pytest.mark.parametrize(("offset", "n"), [(3, 2), (4, 1), (0, 5), (100, 1), (2**64 - 1, 1)])
def test_chunk_past_the_end_of_its_piece_is_refused(offset: int, n: int) -> None:
    receiver = _receiver([8, 4])
    with pytest.raises(MalformedStream, match=r"layer1\.weight\[0:4\].*outside \[0, 4\)"):
        receiver.add(1, offset, _f32(*range(n)))


def test_empty_chunk_is_refused() -> None:
    receiver = _receiver([4])
    with pytest.raises(MalformedStream, match=r"layer0\.weight\[0:4\]"):
        receiver.add(0, 0, b"")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((2, 3), (2, 3)),  # duplicate
        ((2, 3), (0, 3)),  # tail of the new one overlaps
        ((2, 3), (4, 2)),  # head of the new one overlaps
        ((2, 3), (3, 1)),  # inside
        ((2, 3), (0, 8)),  # covers it
        ((0, 8), (7, 1)),  # the last element again
    ],
)
def test_chunk_overlapping_an_earlier_one_is_refused(first: tuple[int, int], second: tuple[int, int]) -> None:
    receiver = _receiver([4, 8])
    receiver.add(1, first[0], _f32(*range(first[1])))
    with pytest.raises(MalformedStream, match=r"layer1\.weight\[0:8\].*overlaps"):
        receiver.add(1, second[0], _f32(*range(second[1])))


def test_overlap_is_found_among_many_earlier_chunks() -> None:
    receiver = _receiver([20])
    for offset in (0, 4, 8, 12, 16):  # every other pair of elements
        receiver.add(0, offset, _f32(1.0, 2.0))
    receiver.add(0, 2, _f32(3.0, 4.0))  # fills a hole exactly: fine
    with pytest.raises(MalformedStream, match="overlaps"):
        receiver.add(0, 10, _f32(1.0, 2.0, 3.0))  # hole [10, 12) plus one element of [12, 14)


def test_same_offset_in_another_piece_is_no_overlap() -> None:
    targets = _feed([(0, 0, _f32(1.0, 2.0)), (1, 0, _f32(3.0))], FLOAT32, [2, 1])
    assert [list(t) for t in targets] == [[1.0, 2.0], [3.0]]


def test_truncated_stream_is_refused_at_finish() -> None:
    _, stream = _source_and_stream(FLOAT32)
    receiver = _receiver(_SIZES)
    for chunk in stream[:-1]:
        receiver.add(*chunk)
    with pytest.raises(MalformedStream, match=r"layer3\.weight\[0:37\].*truncated or gap"):
        receiver.finish()


def test_gap_in_the_middle_is_refused_at_finish() -> None:
    receiver = _receiver([10])
    receiver.add(0, 0, _f32(*range(4)))
    receiver.add(0, 5, _f32(*range(5)))
    with pytest.raises(MalformedStream, match=r"9 of 10 elements of layer0\.weight\[0:10\]"):
        receiver.finish()


def test_piece_with_no_chunk_at_all_is_refused_at_finish() -> None:
    receiver = _receiver([2, 3])
    receiver.add(0, 0, _f32(1.0, 2.0))
    with pytest.raises(MalformedStream, match=r"0 of 3 elements of layer1\.weight\[0:3\]"):
        receiver.finish()


def test_chunk_at_a_negative_offset_is_refused() -> None:
    receiver = _receiver([10])
    with pytest.raises(MalformedStream, match=r"layer0\.weight\[0:10\]"):
        receiver.add(0, -3, _f32(7.0, 8.0))
        # Were it accepted, these 8 elements would make the count reach 10 with element 9 never received.
        receiver.add(0, 0, _f32(*range(8)))
        receiver.finish()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
def test_non_finite_value_is_refused_when_checked(dtype: int, bad: float) -> None:
    receiver = _receiver([4, 6], dtype, check_finite=True)
    receiver.add(1, 0, encode(np.array([1.0, 2.0], dtype=np.float32), dtype))
    with pytest.raises(NonFiniteGradient, match=r"layer1\.weight\[0:6\].*\[2, 5\)") as info:
        receiver.add(1, 2, encode(np.array([3.0, bad, 5.0], dtype=np.float32), dtype))
    assert isinstance(info.value, InvalidArgument)
    assert not isinstance(info.value, MalformedStream)


def test_refused_non_finite_chunk_is_not_counted_as_received() -> None:
    receiver = _receiver([2], check_finite=True)
    with pytest.raises(NonFiniteGradient):
        receiver.add(0, 0, _f32(np.nan, 1.0))
    with pytest.raises(MalformedStream, match="0 of 2"):
        receiver.finish()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_non_finite_values_pass_when_not_checked(dtype: int) -> None:
    values = np.array([np.nan, np.inf, -np.inf, 1.5], dtype=np.float32)
    (target,) = _feed([(0, 0, encode(values, dtype))], dtype, [4])
    assert np.isnan(target[0])
    assert list(target[1:]) == [np.inf, -np.inf, 1.5]


def test_finite_values_pass_when_checked() -> None:
    target = _targets([3])[0]
    receiver = ChunkReceiver([target], ["b[0:3]"], FLOAT32, check_finite=True)
    receiver.add(0, 0, _f32(3.4e38, -3.4e38, 0.0))
    receiver.finish()
    assert list(target) == [np.float32(3.4e38), np.float32(-3.4e38), 0.0]


def test_receiver_refuses_an_unknown_dtype() -> None:
    with pytest.raises(MalformedStream, match="unknown wire dtype"):
        ChunkReceiver([np.zeros(1, dtype=np.float32)], ["w"], 9)


# --- ChunkReceiver: property test over damaged streams ------------------------------------------------------

_DAMAGES = ["truncate", "flip_piece", "flip_offset", "odd_length", "empty", "duplicate"]


@st.composite
def _streams(draw: st.DrawFn) -> tuple[list[int], int, list[np.ndarray], list[Chunk], list[str]]:
    """A valid stream for random pieces, then up to two damages and maybe a shuffle; returns what was done."""
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
    dtype = draw(st.sampled_from(DTYPES))
    chunk_bytes = draw(st.integers(1, 48))
    rng = _rng(draw(st.integers(0, 2**32 - 1)))
    sources = [_exact_values(rng, n) for n in sizes]
    stream = list(iter_chunks(sources, dtype, chunk_bytes))

    done = []
    for damage in draw(st.lists(st.sampled_from(_DAMAGES), max_size=2)):
        if not stream:
            break
        i = draw(st.integers(0, len(stream) - 1))
        piece, offset, data = stream[i]
        if damage == "truncate":
            stream = stream[: draw(st.integers(0, len(stream) - 1))]
        elif damage == "flip_piece":  # one byte of the uint32 on the wire
            mask = draw(st.integers(1, 255)) << (8 * draw(st.integers(0, 3)))
            stream[i] = (piece ^ mask, offset, data)
        elif damage == "flip_offset":  # one byte of the uint64 on the wire
            mask = draw(st.integers(1, 255)) << (8 * draw(st.integers(0, 7)))
            stream[i] = (piece, offset ^ mask, data)
        elif damage == "odd_length":
            # An odd length is no whole number of 2- or 4-byte elements (a chunk already cut to 1 byte stays so).
            stream[i] = (piece, offset, data[: draw(st.integers(0, max(0, (len(data) - 2) // 2))) * 2 + 1])
        elif damage == "empty":
            stream[i] = (piece, offset, b"")
        else:  # duplicate
            stream.insert(draw(st.integers(0, len(stream))), stream[i])
        done.append(damage)
    if draw(st.booleans()):
        stream = draw(st.permutations(stream))
    return sizes, dtype, sources, stream, done


def _reference_receive(stream: list[Chunk], sizes: list[int], dtype: int) -> tuple[int | None, list[np.ndarray]]:
    """What a correct receiver does: the step that must be refused (chunk index, or len(stream) for finish;
    None if the stream is well-formed) and the targets it fills."""
    size = itemsize(dtype)
    covered = [np.zeros(n, dtype=bool) for n in sizes]
    out = _targets(sizes)
    for step, (piece, offset, data) in enumerate(stream):
        if not 0 <= piece < len(sizes) or len(data) % size or not data:
            return step, out
        end = offset + len(data) // size
        if end > sizes[piece] or covered[piece][offset:end].any():
            return step, out
        covered[piece][offset:end] = True
        out[piece][offset:end] = _reference_decode(data, dtype)
    return (None if all(c.all() for c in covered) else len(stream)), out


@settings(max_examples=200, deadline=None)
@given(case=_streams(), check_finite=st.booleans())
def test_receiver_finishes_exactly_or_refuses_damaged_streams(
    case: tuple[list[int], int, list[np.ndarray], list[Chunk], list[str]], check_finite: bool
) -> None:
    sizes, dtype, sources, stream, done = case
    targets = _targets(sizes)
    receiver = ChunkReceiver(targets, _labels(sizes), dtype, check_finite=check_finite)
    refused_at, step = None, 0  # step: the chunk being added, or len(stream) once at finish
    try:
        for chunk in stream:
            receiver.add(*chunk)
            step += 1
        receiver.finish()
    except InvalidArgument as exc:  # anything else propagates and fails the test
        assert isinstance(exc, MalformedStream), f"finite values yet {type(exc).__name__}: {exc}"
        refused_at = step

    must_refuse_at, expected = _reference_receive(stream, sizes, dtype)
    if not done:  # a permutation of the full stream: must be accepted and reproduce the source
        assert must_refuse_at is None and refused_at is None
        for got, src in zip(targets, sources, strict=True):
            assert np.array_equal(got, src)
    if len(done) == 1:  # any single damage leaves a gap, an overlap, a bad length or a bad piece
        assert must_refuse_at is not None
    # A bad chunk is refused when it arrives; a gap when the stream ends ("finish" is step len(stream)).
    assert refused_at == must_refuse_at, f"damages {done}: refused at step {refused_at}, expected {must_refuse_at}"
    if must_refuse_at is None:
        for got, want in zip(targets, expected, strict=True):
            assert np.array_equal(got, want)
