"""The docs name only commands and flags that exist: every `ps-*` command in README.md and docs/*.md is one of
pyproject.toml's [project.scripts], and every `--flag` is in its command's --help (the real parsers, built in this
process)."""

from __future__ import annotations

import argparse
import importlib
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
COMMAND = re.compile(r"\bps-[a-z]+(?:-[a-z]+)*")
# Tools besides the ps-* commands whose flags the docs name, each with the parser that --help prints.
TOOLS = {"python bench/run.py": "bench.run"}
# Flags of programs that are not ours, and flags --help does not show, with where they belong.
FOREIGN = {
    "--logdir": "tensorboard --logdir DIR (docs/dense-training.md, TensorBoard)",
    "--peers-from-stdin": "ps-server's hidden flag for the shards that ps-server --shards N starts (architecture.md)",
}


@dataclass(frozen=True)
class Mention:
    """A flag named in a page, with the command it was given to when the text says so."""

    page: str
    line: int
    flag: str
    command: str | None


@cache
def scripts() -> dict[str, str]:
    """The console scripts pyproject.toml installs: name -> module:function."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def _parser(module: str) -> argparse.ArgumentParser:
    # Every entry point's module builds its parser with build_parser(); its main() parses with it.
    parser = importlib.import_module(module).build_parser()
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


@cache
def flags_of(command: str) -> frozenset[str]:
    """Every long option that `command --help` lists."""
    module = scripts()[command].partition(":")[0] if command in scripts() else TOOLS[command]
    found: set[str] = set()
    for line in _parser(module).format_help().splitlines():
        # An option's line starts with its invocation ("  --shards N, -s N   help..."), help text after 2+ spaces.
        match = re.match(r"^\s{2,}(-.*?)(?:\s{2,}|$)", line)
        if match:
            found.update(FLAG.findall(match.group(1)))
    return frozenset(found)


def _given_to(text: str) -> str | None:
    """The command a code line or span starts with ("$ ps-worker --server ..." -> "ps-worker")."""
    text = text.strip().removeprefix("$ ").strip()
    for command in (*scripts(), *TOOLS):
        if text == command or text.startswith(command + " "):
            return command
    return None


def _flags(page: str, line: int, text: str, command: str | None) -> Iterator[Mention]:
    code = text.split(" #", 1)[0] if command else text  # a shell comment after a command is prose
    for flag in FLAG.findall(code):
        yield Mention(page, line, flag, command)


def mentions(path: Path, root: Path = ROOT) -> Iterator[Mention]:
    """Every flag a page names: in code blocks, inline code and prose, with its command where the text says."""
    page = path.relative_to(root).as_posix()
    table_command: str | None = None
    in_code = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            yield from _flags(page, number, line, _given_to(line))
            continue
        # A table whose first header is "ps-worker flag" names that command's flags in its first column.
        header = re.match(r"^\|\s*`?(ps-[a-z-]+)`? flag\s*\|", line)
        if header:
            table_command = header.group(1)
        elif not line.startswith("|"):
            table_command = None
        elif table_command and not line.startswith("| ---"):
            first, _, rest = line[1:].partition(" | ")
            yield from _flags(page, number, first, table_command)
            line = rest
        spans = re.findall(r"`([^`]+)`", line)
        for span in spans:
            yield from _flags(page, number, span, _given_to(span))
        yield from _flags(page, number, re.sub(r"`[^`]+`", " ", line), None)


def _all_mentions() -> list[Mention]:
    return [mention for path in PAGES for mention in mentions(path)]


def test_every_command_named_in_the_docs_is_installed() -> None:
    missing = []
    for path in PAGES:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in COMMAND.findall(line):
                # "two ps-workers" is the command in the plural.
                if name not in scripts() and name.removesuffix("s") not in scripts():
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "commands the docs name that pyproject.toml does not install:\n" + "\n".join(missing)


def test_every_flag_given_to_a_command_is_in_its_help() -> None:
    stale = [
        f"{m.page}:{m.line}: {m.command} {m.flag}"
        for m in _all_mentions()
        if m.command and m.flag not in flags_of(m.command) and m.flag not in FOREIGN
    ]
    assert not stale, "flags the docs give to a command whose --help lacks them:\n" + "\n".join(stale)


def test_every_other_flag_is_some_commands() -> None:
    known = set(FOREIGN).union(*(flags_of(c) for c in (*scripts(), *TOOLS)))
    stale = [f"{m.page}:{m.line}: {m.flag}" for m in _all_mentions() if not m.command and m.flag not in known]
    assert not stale, "flags the docs name that no command's --help lists:\n" + "\n".join(stale)


@pytest.mark.parametrize("command", sorted(scripts()))
def test_every_command_is_in_the_readme_table(command: str) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"| `{command}` |" in readme, f"README.md's table of commands lacks {command}"


def test_the_checker_sees_a_stale_flag(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "| ps-worker flag | meaning |\n| --- | --- |\n| `--no-such-flag N` | x |\n\n"
        "```bash\nps-server --shards 2 --model cnn   # --model is ps-worker's\n```\n"
        "and `ps-prepare --label y`, then `--workers` in prose.\n",
        encoding="utf-8",
    )
    found = {(m.command, m.flag) for m in mentions(page, root=tmp_path)}
    assert found == {
        ("ps-worker", "--no-such-flag"),
        ("ps-server", "--shards"),
        ("ps-server", "--model"),
        ("ps-prepare", "--label"),
        (None, "--workers"),
    }
    assert "--model" not in flags_of("ps-server") and "--label" in flags_of("ps-prepare")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_reaches_its_file_and_heading() -> None:
    broken = []
    for path in (*PAGES, ROOT / "CONTRIBUTING.md"):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+://", target):
                    continue
                file, _, anchor = target.partition("#")
                linked = (path.parent / file).resolve() if file else path
                if not linked.exists():
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {target} (no such file)")
                elif anchor and linked.suffix == ".md":
                    headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), re.MULTILINE)
                    if anchor not in {_anchor(h) for h in headings}:
                        broken.append(f"{path.relative_to(ROOT)}:{number}: {target} (no such heading)")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
