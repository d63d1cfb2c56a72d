"""Every relative link in the README, docs/, BENCHMARKS.md and bench/history.md resolves: the file or folder
exists, and a link to a heading of a Markdown file names one it has (GitHub's anchors). Every
`diloco` command in their code blocks parses as the command line reads it."""
from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from diloco.cli import SUBCOMMANDS, parse_args

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "bench" / "history.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchor of each heading: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def links(page: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [target for target in LINK.findall(text) if not target.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_of_the_page_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def commands(page: pathlib.Path) -> list[str]:
    """The `diloco ...` command lines of the page's code blocks (continuations joined; comments,
    a trailing `&` and anything after a pipe or `&&` dropped); printed output is not one."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s|\s\|\s|\s&&\s", line)[0].strip().removesuffix("&").strip()
            words = line.split()
            if len(words) > 1 and words[0] == "diloco" and (words[1] in SUBCOMMANDS or words[1].startswith("-")):
                found.append(" ".join(words))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_diloco_command_in_the_page_parses_as_the_cli_reads_it(page, capsys):
    wrong = []
    for line in commands(page):
        try:
            parse_args(shlex.split(line)[1:])
        except SystemExit as exit:
            if exit.code:
                wrong.append(f"{line!r}: {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert not wrong, f"{page.relative_to(ROOT)}: " + "; ".join(wrong)


def test_the_command_finder_reads_continuations_and_skips_printed_tables(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```sh\ndiloco plan --chips 4 \\\n  --learners 4   # four\n diloco  8  131,072  96.5%\n"
                    "diloco sim --quiet &\n```\n")
    assert commands(page) == ["diloco plan --chips 4 --learners 4", "diloco sim --quiet"]
