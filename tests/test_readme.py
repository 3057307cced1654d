"""The README is for users: short, starting with what it is and the quickstart, and every
command it shows is one the CLI accepts (long-running ones are only parsed here; `make
test` is what CI runs, `make demo` is covered by tests/test_demo.py on tiny models)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from disco_cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 250


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL)


def readme_commands() -> list[str]:
    """Every ``disco ...`` command line of the README's code blocks (continuations joined)."""
    commands = []
    for block in _code_blocks(README.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("disco "):
                commands.append(line)
    return commands


def test_the_readme_is_short_and_starts_with_what_and_quickstart():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    sections = re.findall(r"(?m)^## (.+)$", text)
    assert sections[0] == "Quickstart"
    assert "make demo" in text and "make test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def test_the_readme_shows_commands():
    assert len(readme_commands()) >= 8


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_parses(command):
    argv = shlex.split(command, comments=True)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse's way of refusing
        pytest.fail(f"`{command}` does not parse (exit {exit_.code})")
    assert callable(getattr(args, "func", None)), command


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text()):
        assert (ROOT / target).exists(), target
