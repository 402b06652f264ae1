"""The structure rules of tools/check_structure.py (run by `make lint`): each one sees its breach in a small tree,
and the repository keeps them."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tools import check_structure

ROOT = Path(__file__).resolve().parents[1]


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in ("paramserver", "worker", "tests"):
        (root / folder).mkdir(exist_ok=True)
    return root


def _messages(root: Path) -> list[str]:
    return [str(b) for b in check_structure.check(root) if not b.stale]


def test_the_repository_keeps_the_rules() -> None:
    assert _messages(ROOT) == []


def test_a_circle_through_a_function_level_import_is_one(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "worker/__init__.py": "",
            "worker/demos/__init__.py": "",
            "worker/demos/a.py": "from worker.demos.b import helper\n",
            "worker/demos/b.py": "def helper():\n    from worker.demos import a\n    return a\n",
        },
    )
    (message,) = _messages(tmp_path)
    assert "import circle among 2 modules" in message
    assert (
        "worker.demos.a -> worker.demos.b (line 1)" in message
        and "worker.demos.b -> worker.demos.a (line 2)" in message
    )


def test_type_checking_imports_and_one_way_imports_are_no_circle(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "worker/__init__.py": "from worker import a\n",
            "worker/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from worker.b import B\n",
            "worker/b.py": "from . import a\n",
        },
    )
    assert _messages(tmp_path) == []


def test_a_test_module_importing_another_is_refused_but_support_is_not(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "tests/test_a.py": "from test_b import helper\nfrom support.cluster import start\n",
            "tests/test_b.py": "def helper(): ...\n",
            "tests/conftest.py": "import support\n",
            "tests/support/__init__.py": "",
            "tests/support/cluster.py": "def start(): ...\n",
        },
    )
    assert _messages(tmp_path) == [
        "tests/test_a.py:1: imports the test module test_b: move what it shares into tests/support/"
    ]


def test_a_long_function_and_a_long_module_are_named(tmp_path: Path) -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(80))  # with its decorator and def: 82 lines
    _tree(
        tmp_path,
        {"paramserver/long.py": "class C:\n    @staticmethod\n    def f():\n" + body, "worker/big.py": "\n" * 501},
    )
    assert sorted(_messages(tmp_path)) == [
        "paramserver/long.py:2: C.f is 82 lines (at most 80): split it by phase",
        "worker/big.py:1: module of 501 lines (at most 500): split it by concern",
    ]
