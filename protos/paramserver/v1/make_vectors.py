"""Regenerate vectors.json (placement and digest test vectors for SPEC.md, computed by paramserver.placement) and
table_vectors.json (the sparse tables' row placement, initial rows and digest, SPEC.md section 14, computed by
paramserver.tables).

    .venv/bin/python protos/paramserver/v1/make_vectors.py          # rewrite both files beside this one
    .venv/bin/python protos/paramserver/v1/make_vectors.py --check  # exit 1 if either is not current

Each case gives a model (`specs`, each `{name, shape}`, with `"buffer": true` for a buffer), `num_shards` and
`slice_elements`, and what every implementation must compute from them: each shard's ordered pieces (`shards`),
each shard's element count (`shard_elements`) and the model digest (`digest`). tests/test_contract.py checks that
the file is current; clients/js/check_vectors.js checks the JavaScript client against it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paramserver.placement import SLICE_ELEMENTS, TensorSpec, digest, place

HERE = Path(__file__).resolve().parent
VECTORS = HERE / "vectors.json"
TABLE_VECTORS = HERE / "table_vectors.json"

# The digits CNN as worker.models.builtin.build_model("cnn", in_shape=(1, 8, 8), num_classes=10) names its parameters
# (written out here so that generating the vectors needs no torch).
DIGITS_CNN: list[tuple[str, tuple[int, ...]]] = [
    ("conv1.weight", (32, 1, 3, 3)),
    ("conv1.bias", (32,)),
    ("conv2.weight", (64, 32, 3, 3)),
    ("conv2.bias", (64,)),
    ("fc1.weight", (128, 1024)),
    ("fc1.bias", (128,)),
    ("fc2.weight", (10, 128)),
    ("fc2.bias", (10,)),
]

# The model clients/js/train.js trains (with --big: the last tensor too, sliced over the shards by the servers'
# default slice_elements).
JS_MODEL: list[tuple[str, tuple[int, ...]]] = [("w", (8, 1)), ("b", (1,))]
JS_BIG: tuple[str, tuple[int, ...]] = ('emb.é"\\😀', (1_100_000,))

# A spec is (name, shape) for a parameter, (name, shape, True) for a buffer; a case (case, specs, num_shards,
# slice_elements).
Spec = tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], bool]
Case = tuple[str, Sequence[Spec], int, int]

# A BatchNorm MLP as PSClient registers a module: its parameters, then its buffers (a trailing True marks one).
BN_MLP: list[Spec] = [
    ("fc1.weight", (32, 64)),
    ("fc1.bias", (32,)),
    ("bn.weight", (32,)),
    ("bn.bias", (32,)),
    ("fc2.weight", (10, 32)),
    ("fc2.bias", (10,)),
    ("bn.running_mean", (32,), True),
    ("bn.running_var", (32,), True),
    ("bn.num_batches_tracked", (), True),
]

CASES: list[Case] = [
    ("one shard: nothing is sliced, whatever its size", [("a", (3, 4)), ("b", (4,)), ("c", ())], 1, 10),
    (
        "ties: equal sizes go in model order, each to the least-loaded shard, lowest index first",
        [("t0", (2, 3)), ("t1", (6,)), ("t2", (3, 2)), ("t3", (1, 6)), ("t4", (6, 1))],
        3,
        10,
    ),
    ("more shards than tensors: some shards hold nothing", [("x", (5,)), ("y", (2, 2))], 5, 10),
    (
        "slice boundary: exactly slice_elements stays whole, one more is sliced",
        [("exact", (10,)), ("plus1", (11,)), ("small", (1,))],
        3,
        10,
    ),
    (
        "uneven slicing: ceil(11 / 8) = 2 per shard, the last sliced shards get nothing",
        [("s", (11,)), ("w", (1,))],
        8,
        10,
    ),
    ("uneven slicing: 100 over 16 shards, step 7, the last piece 2, shard 15 nothing", [("s", (10, 10))], 16, 10),
    (
        "sliced pieces count towards a shard's load before whole tensors are placed",
        [("big", (25,)), ("w1", (5,)), ("w2", (5,)), ("w3", (3,)), ("w4", (3,))],
        3,
        10,
    ),
    (
        "model order within a shard: a tensor placed later still comes first if it is earlier in the model",
        [("first", (1,)), ("huge", (30,)), ("mid", (8,)), ("last", (9,))],
        2,
        10,
    ),
    ("scalars have one element", [("s0", ()), ("s1", ()), ("v", (1,)), ("s2", ()), ("m", (2, 1))], 2, 10),
    (
        "zero-element tensors are placed whole as zero-length pieces (they take no chunk)",
        [("empty", (0,)), ("a", (2,)), ("void", (3, 0, 5)), ("b", (1,)), ("wide", (0, 4294967296))],
        2,
        10,
    ),
    (
        "names: non-ASCII, astral, quote, backslash and control characters in the canonical JSON",
        [
            ("é", (2,)),
            ("€uro", (3,)),
            ("😀", (1,)),
            ('say "hi"', (4,)),
            ("back\\slash/", (2,)),
            ("tab\tnew\nline\rcr", (1,)),
            ("\b\f\x01\x1f\x7f", (1,)),
            ("\u2028\ufeff\uffff\U0010ffff", (1,)),
            ("日本語.weight", (5,)),
        ],
        2,
        10,
    ),
    ("digits CNN on 2 shards, default slice: nothing sliced", DIGITS_CNN, 2, SLICE_ELEMENTS),
    ("digits CNN on 3 shards with slice_elements 10000: the two large weights sliced", DIGITS_CNN, 3, 10000),
    (
        "default slice boundary: 1048576 stays whole, 1048577 is sliced",
        [("exact", (1024, 1024)), ("plus1", (1048577,)), ("bias", (7,))],
        2,
        SLICE_ELEMENTS,
    ),
    ("the model of clients/js/train.js", JS_MODEL, 2, SLICE_ELEMENTS),
    ("the model of clients/js/train.js --big", [*JS_MODEL, JS_BIG], 2, SLICE_ELEMENTS),
    (
        "buffers are placed like parameters and named in the digest; sliced, scalar and interleaved ones too",
        [("w", (4,)), ("stats", (12,), True), ("b", (2,)), ("count", (), True)],
        3,
        10,
    ),
    (
        "a BatchNorm MLP: its parameters, then its buffers (so they come last on the shards that hold them)",
        BN_MLP,
        2,
        SLICE_ELEMENTS,
    ),
]


def compute(name: str, model: Sequence[Spec], num_shards: int, slice_elements: int) -> dict:
    """One vector: the inputs and what paramserver.placement computes from them."""
    specs = [TensorSpec(entry[0], tuple(entry[1]), len(entry) > 2 and entry[2]) for entry in model]
    placement = place(specs, num_shards, slice_elements)
    return {
        "case": name,
        # "buffer" only where true, so the parameter-only cases read as before
        "specs": [{"name": s.name, "shape": list(s.shape)} | ({"buffer": True} if s.buffer else {}) for s in specs],
        "num_shards": num_shards,
        "slice_elements": slice_elements,
        "shards": [
            [{"name": p.name, "start": p.start, "length": p.length} for p in pieces] for pieces in placement.shards
        ],
        "shard_elements": [placement.shard_elements(k) for k in range(num_shards)],
        "digest": placement.digest,
    }


def vectors() -> list[dict[str, Any]]:
    return [compute(*case) for case in CASES]


def _escape(ch: str) -> str:
    """A character as JSON \\uXXXX escapes (a surrogate pair above U+FFFF)."""
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _compact(value: Any) -> str:
    """One-line JSON: printable characters as they are, invisible ones (DEL, U+2028, U+FEFF...) escaped."""
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def render() -> str:
    """The exact text of vectors.json: UTF-8, JSON escapes only where JSON requires them, one line per tensor
    spec and per shard."""
    cases = []
    for v in vectors():
        specs = ",\n".join(f"   {_compact(s)}" for s in v["specs"])
        shards = ",\n".join(f"   {_compact(pieces)}" for pieces in v["shards"])
        cases.append(
            " {\n"
            f'  "case": {_compact(v["case"])},\n'
            f'  "specs": [\n{specs}\n  ],\n'
            f'  "num_shards": {v["num_shards"]},\n'
            f'  "slice_elements": {v["slice_elements"]},\n'
            f'  "shards": [\n{shards}\n  ],\n'
            f'  "shard_elements": {_compact(v["shard_elements"])},\n'
            f'  "digest": {_compact(v["digest"])}\n'
            " }"
        )
    text = "[\n" + ",\n".join(cases) + "\n]\n"
    assert json.loads(text) == vectors()
    return text


# IDs for the table vectors: small, negative, the int64 extremes, and hash-like values.
TABLE_IDS = [0, 1, 2, 3, 7, 42, 1000003, -1, -2, -(2**63), 2**63 - 1, 1234567890123456789, -987654321987654321]


def table_vectors() -> dict[str, Any]:
    """The sparse tables' vectors: mix64 and shard_of of TABLE_IDS, initial rows of a few tables, a digest."""
    import numpy as np

    from paramserver.tables import TableSpec, initial_rows, mix64, shard_of

    ids = np.array(TABLE_IDS, dtype=np.int64)
    tables = [
        TableSpec("normal", dim=4, seed=5),
        TableSpec("uniform", dim=3, init="uniform", init_scale=0.5, seed=2**64 - 1),
        TableSpec("zeros", dim=2, num_embeddings=10, init="zeros"),
    ]
    return {
        "ids": TABLE_IDS,
        # mix64 of each ID's 64 bits, as decimal strings (JSON numbers lose precision past 2^53)
        "mix64": [str(int(v)) for v in mix64(ids.view(np.uint64))],
        "shard_of": {str(n): [int(k) for k in shard_of(ids, n)] for n in (1, 2, 3, 7)},
        "initial_rows": [
            {
                "table": dict(
                    zip(
                        ["name", "dim", "init", "init_scale", "seed"],
                        [t.name, t.dim, t.init, t.init_scale, str(t.seed)],
                        strict=True,
                    )
                ),
                "ids": [str(i) for i in TABLE_IDS[:5]],
                # float32 rows, each element as its 8 hex digits of IEEE 754 binary32 bits (exact)
                "rows": [[f"{int(x):08x}" for x in row.view(np.uint32)] for row in initial_rows(t, ids[:5])],
            }
            for t in tables
        ],
        "digest": {
            "specs": [["fc.weight", [1, 8]], ["fc.bias", [1]]],
            "num_shards": 2,
            "slice_elements": SLICE_ELEMENTS,
            "tables": [t.digest_entry() for t in tables],
            "digest": digest([TensorSpec("fc.weight", (1, 8)), TensorSpec("fc.bias", (1,))], 2, SLICE_ELEMENTS, tables),
        },
    }


def render_tables() -> str:
    """The exact text of table_vectors.json."""
    return json.dumps(table_vectors(), indent=1, ensure_ascii=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a vectors file differs from what it would be")
    args = parser.parse_args(argv)
    outputs = {VECTORS: render(), TABLE_VECTORS: render_tables()}
    if args.check:
        stale = [p for p, text in outputs.items() if (p.read_text(encoding="utf-8") if p.exists() else "") != text]
        for p in stale:
            print(f"{p} is not current: run {Path(__file__).name}", file=sys.stderr)
        return 1 if stale else 0
    for p, text in outputs.items():
        p.write_text(text, encoding="utf-8")
    print(f"wrote {len(CASES)} cases to {VECTORS} and the table vectors to {TABLE_VECTORS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
