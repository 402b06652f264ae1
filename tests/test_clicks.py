"""ps-prepare --format criteo (worker/data/clicks.py): Criteo day files, plain and gzip, into shards with a schema:
the dense features' log(1 + x) and normalisation, the hashes as int64 IDs, missing values, the distinct counts, and
bad input refused with nothing left behind."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from worker.data.clicks import CATEGORICAL, DENSE
from worker.data.manifest import MISSING_ID, load_manifest
from worker.data.prepare import PrepareConfig, main, prepare


def _lines(n: int, seed: int, wide: int = 0) -> list[list[str]]:
    """n Criteo lines as fields: some integers missing or negative, C1 Zipf-repeated hashes, C2 missing at times;
    `wide`: C3 takes that many distinct values."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ints = [str(int(v)) for v in rng.integers(-3, 50, 13)]
        ints[4] = "" if i % 3 == 0 else ints[4]
        cats = [f"{int(v):08x}" for v in rng.integers(0, 2**32, 26)]
        cats[0] = f"{int(rng.zipf(1.5)) % 40:08x}"
        cats[1] = "" if i % 4 == 0 else cats[1]
        cats[2] = f"{int(rng.integers(0, wide)):08x}" if wide else cats[2]
        out.append([str(int(rng.integers(0, 2))), *ints, *cats])
    return out


def _write(path: Path, lines: list[list[str]]) -> Path:
    text = "".join("\t".join(fields) + "\n" for fields in lines)
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _read(out: Path, split: str) -> dict[str, np.ndarray]:
    manifest = load_manifest(str(out))
    tables = [pq.read_table(out / s.path) for s in manifest.splits[split].shards]
    return {
        name: np.concatenate([t.column(name).combine_chunks().to_numpy(zero_copy_only=False) for t in tables])
        for name in tables[0].column_names
    }


def test_day_files_plain_and_gzip_become_shards_with_a_schema(tmp_path: Path) -> None:
    first, second = _lines(700, 1), _lines(500, 2)
    files = [_write(tmp_path / "day_0.tsv", first), _write(tmp_path / "day_1.tsv.gz", second)]
    out = tmp_path / "out"
    manifest = prepare([str(f) for f in files], PrepareConfig(out=str(out), format="criteo", shards=3, progress=False))
    lines = first + second
    test = np.arange(len(lines)) % 5 == 4  # --test-fraction 0.2: every fifth line
    assert manifest.splits["train"].samples == int((~test).sum()) and manifest.splits["test"].samples == test.sum()
    assert len(manifest.splits["train"].shards) == 3 and manifest.in_shape == (13,) and manifest.num_classes == 2
    schema = manifest.schema
    assert schema is not None and schema.dense == DENSE and schema.dense_transform == "log1p"
    assert [c.name for c in schema.categorical] == list(CATEGORICAL)
    # Every training line once, in order of its id; the dense features log(1 + max(x, 0)), then normalised.
    got = _read(out, "train")
    order = np.argsort(got["id"])
    assert np.array_equal(got["id"][order], np.arange(len(order)))
    train = [line for line, held in zip(lines, test, strict=True) if not held]
    raw = np.array([[float(v) if v else 0.0 for v in line[1:14]] for line in train])
    logged = np.log1p(np.maximum(raw, 0))
    mean, std = logged.mean(0), logged.std(0)
    np.testing.assert_allclose(manifest.normalization["mean"], mean, rtol=1e-9)
    x = np.stack(got["x"])[order]
    np.testing.assert_allclose(x, ((logged - mean) / std).astype(np.float32), rtol=1e-5, atol=1e-5)
    assert np.array_equal(got["y"][order], [int(line[0]) for line in train])
    c1 = np.array([int(line[14], 16) for line in train])
    c2 = np.array([int(line[15], 16) if line[15] else MISSING_ID for line in train])
    assert np.array_equal(got["cat_C1"][order], c1) and np.array_equal(got["cat_C2"][order], c2)
    assert (c2 == MISSING_ID).any() and got["cat_C1"].dtype == np.int64
    # Distinct IDs in the training lines: exact while few.
    counts = {c.name: (c.distinct, c.distinct_exact) for c in schema.categorical}
    assert counts["C1"] == (len(np.unique(c1)), True)
    assert counts["C2"] == (len(np.unique(c2)), True)


def test_a_feature_with_many_distinct_ids_is_counted_by_a_sketch(tmp_path: Path) -> None:
    lines = _lines(30_000, 3, wide=2**31)
    out = tmp_path / "out"
    manifest = prepare(
        [str(_write(tmp_path / "day.tsv", lines))],
        PrepareConfig(out=str(out), format="criteo", shards=2, test_fraction=0.5, progress=False),
    )
    assert manifest.schema is not None
    c3 = next(c for c in manifest.schema.categorical if c.name == "C3")
    exact = len({line[16] for line in lines[0::2]})  # the training lines: every other one
    assert not c3.distinct_exact and math.isclose(c3.distinct, exact, rel_tol=0.05), (c3.distinct, exact)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda fields: fields[:-1], "is not a Criteo day file"),
        (lambda fields: [*fields[:20], "xyz12345", *fields[21:]], "is not an 8-hex-digit hash"),
        (lambda fields: ["2", *fields[1:]], "not 0 or 1"),
    ],
)
def test_a_damaged_line_is_refused_naming_the_file_and_nothing_is_left(tmp_path: Path, damage, message) -> None:
    lines = _lines(50, 4)
    lines[30] = damage(lines[30])
    day = _write(tmp_path / "day.tsv", lines)
    out = tmp_path / "out"
    assert main([str(day), "--format", "criteo", "--out", str(out), "--shards", "2", "--no-progress"]) == 2
    assert not (out / "manifest.json").exists()
    with pytest.raises(ValueError, match=message) as caught:
        prepare([str(day)], PrepareConfig(out=str(out), format="criteo", shards=2, progress=False))
    assert "day.tsv" in str(caught.value)
    if "Criteo day file" not in message:  # pyarrow's own message names the row it choked on
        assert "day.tsv" in str(caught.value) and ": line 31: " in str(caught.value), caught.value


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda fields: [*fields[:20], "xyz12345", *fields[21:]], r"day-2.tsv, column C7: line 1700: xyz12345 is not"),
        (lambda fields: ["2", *fields[1:]], r"day-2.tsv: line 1700: the label 2 is not 0 or 1"),
        (lambda fields: ["", *fields[1:]], r"day-2.tsv: line 1700: a missing label is not 0 or 1"),
    ],
)
def test_a_damaged_line_far_into_the_second_file_is_named_by_its_line_in_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage, message
) -> None:
    # Blocks of 8 KiB (about 50 lines): the damaged line is in the file's 35th block, after a whole other file.
    monkeypatch.setattr("worker.data.clicks.BLOCK_BYTES", 8 << 10)
    first = _write(tmp_path / "day-1.tsv", _lines(500, 5))
    lines = _lines(2000, 6)
    lines[1699] = damage(lines[1699])
    second = _write(tmp_path / "day-2.tsv", lines)
    config = PrepareConfig(out=str(tmp_path / "out"), format="criteo", shards=2, progress=False)
    with pytest.raises(ValueError, match=message):
        prepare([str(first), str(second)], config)


@pytest.mark.parametrize("fraction,held", [(0.6, 600), (0.4, 400), (0.25, 250), (0.57, 570)])
def test_the_held_out_fraction_is_the_one_asked(tmp_path: Path, fraction: float, held: int) -> None:
    # Rounded to one line in k before: 0.6 and 0.4 of 1,000 lines both held out 500.
    day = _write(tmp_path / "day.tsv", _lines(1000, 7))
    config = PrepareConfig(out=str(tmp_path / "out"), format="criteo", test_fraction=fraction, progress=False)
    manifest = prepare([str(day)], config)
    assert (manifest.splits["test"].samples, manifest.splits["train"].samples) == (held, 1000 - held)


def test_several_sources_need_the_criteo_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only --format criteo takes several files"):
        prepare(["a.csv", "b.csv"], PrepareConfig(out=str(tmp_path / "out"), progress=False))


def _token(text: str) -> int:
    from worker.data.click_tables import string_ids

    return int(string_ids(pa.array([text]))[0])


def test_a_table_with_categorical_and_multi_hot_columns_becomes_click_shards(tmp_path: Path) -> None:
    rows = [
        ("clicked", "age", "user", "item", "tags"),
        ("1", "30", "alice", "7", "a|b"),
        ("0", "", "", "8", ""),
        ("1", "41", "bob", "", "b||c"),
        ("0", "25", "alice", "7", "c"),
    ] * 5
    table = tmp_path / "clicks.csv"
    table.write_text("\n".join(",".join(r) for r in [rows[0], *[r for r in rows if r[0] != "clicked"]]) + "\n")
    out = tmp_path / "out"
    config = PrepareConfig(
        out=str(out),
        label="clicked",
        categorical="user,item",
        multi_hot="tags:|",
        shards=2,
        test_fraction=0.5,
        progress=False,
    )
    manifest = prepare(str(table), config)
    assert manifest.schema is not None and manifest.schema.dense == ("age",) and manifest.in_shape == (1,)
    assert [(c.name, c.multi_hot) for c in manifest.schema.categorical] == [
        ("user", False),
        ("item", False),
        ("tags", True),
    ]
    got = _read(out, "train")
    order = np.argsort(got["id"])
    lines = [r for r in rows if r[0] != "clicked"][0::2]  # every other line trains
    assert np.array_equal(got["y"][order], [int(r[0]) for r in lines])
    users = [_token(r[2]) if r[2] else MISSING_ID for r in lines]
    assert np.array_equal(got["cat_user"][order], users)
    assert np.array_equal(got["cat_item"][order], [int(r[3]) if r[3] else MISSING_ID for r in lines])
    bags = [list(b) for b in got["cat_tags"][order]]
    assert bags == [[_token(t) for t in r[4].split("|") if t] for r in lines]  # empty tokens and values: no ID


def test_a_table_with_a_label_other_than_0_or_1_or_an_unknown_column_is_refused(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    table.write_text("clicked,user,x\n2,a,1\n0,b,2\n1,c,3\n0,d,4\n")
    config = PrepareConfig(out=str(tmp_path / "o"), label="clicked", categorical="user", shards=1, progress=False)
    with pytest.raises(ValueError, match=r"t.csv, column clicked: line 2: the label 2 is not 0 or 1"):
        prepare(str(table), config)  # the file's line: the header is line 1
    with pytest.raises(ValueError, match="no column 'usr'"):
        prepare(str(table), PrepareConfig(out=str(tmp_path / "o"), label="clicked", categorical="usr", progress=False))
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_ps_prepare_does_not_load_torch() -> None:
    """ps-prepare never trains: importing it (and the click-log writer) leaves torch unloaded, 1.9 s and about
    200 MB of RSS a process would otherwise pay (worker's names load on first use)."""
    import subprocess
    import sys

    code = "import sys, worker.data.prepare, worker.data.clicks; assert 'torch' not in sys.modules"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert probe.returncode == 0, probe.stderr.decode()
    code = "import sys; from worker import PSClient; assert 'torch' in sys.modules"
    loaded = subprocess.run([sys.executable, "-c", code])
    assert loaded.returncode == 0
