"""The wire contract's test vectors (protos/paramserver/v1/vectors.json) against the reference placement, and the
digest rule of SPEC.md section 2 implemented again here, from the text, with hashlib and hand-built JSON."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from paramserver.placement import SLICE_ELEMENTS, TensorSpec, digest, place

V1 = Path(__file__).resolve().parent.parent / "protos" / "paramserver" / "v1"
VECTORS = V1 / "vectors.json"


def _load_vectors() -> list[dict[str, Any]]:
    return json.loads(VECTORS.read_text(encoding="utf-8"))


CASES = _load_vectors()


def _specs(case: dict[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(s["name"], tuple(s["shape"]), s.get("buffer", False)) for s in case["specs"]]


def _make_vectors() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_vectors", V1 / "make_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- SPEC.md section 2, written again from the text ---------------------------------------------------------------

_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _json_string(text: str) -> str:
    """A JSON string, ASCII only, as SPEC.md section 2 rule 3 writes it."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in _SHORT:
            out.append(_SHORT[ch])
        elif 0x20 <= code <= 0x7E:
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            code -= 0x10000
            out.append(f"\\u{0xD800 | (code >> 10):04x}\\u{0xDC00 | (code & 0x3FF):04x}")
    out.append('"')
    return "".join(out)


def _spec_digest(specs: list[dict[str, Any]], num_shards: int, slice_elements: int) -> str:
    def entry(s: dict[str, Any]) -> str:
        kind = ',"buffer"' if s.get("buffer") else ""  # a buffer's entry names it; a parameter's has no third item
        return f"[{_json_string(s['name'])},[{','.join(str(int(d)) for d in s['shape'])}]{kind}]"

    tensors = ",".join(entry(s) for s in specs)
    text = f'{{"v":1,"shards":{int(num_shards)},"slice":{int(slice_elements)},"tensors":[{tensors}]}}'
    assert text.isascii()
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- the tests ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_vector_reproduces_with_the_reference_placement(case: dict[str, Any]) -> None:
    specs = _specs(case)
    placement = place(specs, case["num_shards"], case["slice_elements"])
    got = [[{"name": p.name, "start": p.start, "length": p.length} for p in ps] for ps in placement.shards]
    assert got == case["shards"], case["case"]
    assert [placement.shard_elements(k) for k in range(placement.num_shards)] == case["shard_elements"]
    assert placement.digest == case["digest"] == digest(specs, case["num_shards"], case["slice_elements"])


@pytest.mark.parametrize("case", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_spec_digest_rule_matches_the_reference(case: dict[str, Any]) -> None:
    expected = digest(_specs(case), case["num_shards"], case["slice_elements"])
    assert _spec_digest(case["specs"], case["num_shards"], case["slice_elements"]) == expected == case["digest"]


def test_vectors_cover_every_piece_once() -> None:
    """Each case's pieces partition every tensor exactly; zero-length pieces only for zero-element tensors."""
    for case in CASES:
        sizes = {s["name"]: _numel(s["shape"]) for s in case["specs"]}
        covered: dict[str, list[tuple[int, int]]] = {name: [] for name in sizes}
        for pieces, elements in zip(case["shards"], case["shard_elements"], strict=True):
            assert sum(p["length"] for p in pieces) == elements
            for p in pieces:
                assert p["length"] > 0 or sizes[p["name"]] == 0, case["case"]
                covered[p["name"]].append((p["start"], p["start"] + p["length"]))
        for name, ranges in covered.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == sizes[name], (case["case"], name)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), (case["case"], name)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_regenerating_the_vectors_changes_nothing() -> None:
    module = _make_vectors()
    assert module.render() == VECTORS.read_text(encoding="utf-8"), "run protos/paramserver/v1/make_vectors.py"
    assert module.main(["--check"]) == 0


def test_vectors_hold_the_tricky_cases() -> None:
    """The cases SPEC.md promises: one shard, slicing with empty shards, the slice boundary, scalars,
    zero-element tensors, escaped names, the default slice size, buffers (sliced, scalar, among parameters)."""
    shapes = [s["shape"] for case in CASES for s in case["specs"]]
    names = "".join(s["name"] for case in CASES for s in case["specs"])
    assert any(case["num_shards"] == 1 for case in CASES)
    assert any(case["num_shards"] > len(case["specs"]) for case in CASES)
    assert any(e == 0 for case in CASES for e in case["shard_elements"])
    assert [] in shapes and any(0 in shape for shape in shapes)
    assert all(ch in names for ch in ('"', "\\", "\n", "\x01", "\x7f", "é", "\U0001f600", "\u2028"))
    assert any(case["slice_elements"] == SLICE_ELEMENTS for case in CASES)
    buffers = [(c, s) for c in CASES for s in c["specs"] if s.get("buffer")]
    assert any(s["shape"] == [] for _, s in buffers), "a scalar buffer"
    assert any(_numel(s["shape"]) > c["slice_elements"] for c, s in buffers), "a sliced buffer"
    boundary = [c for c in CASES if {_numel(s["shape"]) for s in c["specs"]} >= {c["slice_elements"] + 1}]
    assert any(len([p for ps in c["shards"] for p in ps if p["name"] == "plus1"]) > 1 for c in boundary)


def test_spec_example_is_the_first_vector() -> None:
    first = CASES[0]
    text = (V1 / "SPEC.md").read_text(encoding="utf-8")
    assert first["digest"] in text
    assert _spec_digest(first["specs"], first["num_shards"], first["slice_elements"]) == first["digest"]


# -- SPEC.md section 14 (sparse tables), written again from the text with Python integers -------------------------

TABLE_VECTORS = json.loads((V1 / "table_vectors.json").read_text(encoding="utf-8"))
_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def test_row_placement_vectors_follow_the_spec_text() -> None:
    ids = TABLE_VECTORS["ids"]
    assert [str(_mix64(i & _MASK)) for i in ids] == TABLE_VECTORS["mix64"]
    for n, shards in TABLE_VECTORS["shard_of"].items():
        assert [_mix64(i & _MASK) % int(n) for i in ids] == shards


def test_initial_row_vectors_follow_the_spec_text() -> None:
    """The codebook rule of SPEC.md section 14, element by element with Python floats (float64)."""
    import math
    import struct

    rows_per_book = 4096
    for case in TABLE_VECTORS["initial_rows"]:
        t = case["table"]
        dim, seed, kind = t["dim"], int(t["seed"]), t["init"]
        scale = t["init_scale"] or 1.0 / math.sqrt(dim)
        key = _mix64(seed)

        def u(c: int, key: int = key) -> float:
            return (_mix64((key + c) & _MASK) >> 11) * 2.0**-53

        def book(b: int, r: int, j: int, dim: int = dim, kind: str = kind) -> float:
            c = (b * rows_per_book + r) * dim + j
            if kind == "normal":
                return math.sqrt(-2.0 * math.log1p(-u(2 * c))) * math.cos(2.0 * math.pi * u(2 * c + 1))
            return u(c)

        for id_text, row in zip(case["ids"], case["rows"], strict=True):
            h = _mix64((int(id_text) & _MASK) ^ key)
            ra, rb = h % rows_per_book, (h >> 32) % rows_per_book
            want = []
            for j in range(dim):
                a, b = book(0, ra, j), book(1, rb, j)
                if kind == "normal":
                    x = (a + b) * (scale / math.sqrt(2.0))
                elif kind == "uniform":
                    s = a + b
                    x = (2.0 * (s - math.floor(s)) - 1.0) * scale
                else:
                    x = 0.0
                want.append(struct.pack(">f", x).hex())
            assert want == row, f"table {t['name']}, ID {id_text}"


def test_the_digest_of_a_model_with_tables_follows_the_spec_text() -> None:
    case = TABLE_VECTORS["digest"]
    doc = {
        "v": 1,
        "shards": case["num_shards"],
        "slice": case["slice_elements"],
        "tensors": case["specs"],
        "tables": case["tables"],
    }
    text = json.dumps(doc, separators=(",", ":"))
    assert hashlib.sha256(text.encode()).hexdigest() == case["digest"]
    module = _make_vectors()
    assert module.render_tables() == (V1 / "table_vectors.json").read_text(encoding="utf-8")
