"""docs/cli.md stays in step with the `runlm` parser.

Each subcommand has a section headed ``runlm NAME`` whose first code block (its usage) lists exactly the
subcommand's long options; no section, usage or ``runlm NAME`` example names a subcommand that does not
exist, and no ``--flag`` in a section is one its subcommand lacks (flags of the backend processes, from the
backends' allow-lists, and the few other programs' flags listed below excepted).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from runlm.cli import build_parser
from runlm.runner.backends.diffusers import DiffusersBackend
from runlm.runner.backends.llamacpp import LlamaCppBackend
from runlm.runner.backends.native import NativeBackend
from runlm.runner.backends.vllm import VLLMBackend

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"

# the runtime flags `runlm configure --runtime-flags` passes to backend processes (their allow-lists)
BACKEND_FLAGS = {f for b in (NativeBackend, LlamaCppBackend, VLLMBackend, DiffusersBackend) for f in b.allowed_flags}
# flags of other programs the page names, each with where it belongs
OTHER_FLAGS = {
    "--model-draft": "llama.cpp's server: how the daemon passes a draft model to it",
    "--version": "runlm's own top-level flag",
    "--help": "argparse's, on every command",
}

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
COMMAND_HEADING = re.compile(r"^runlm ([a-z][a-z0-9-]*)$")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`]+)`")  # may wrap onto the next line of its paragraph
RUNLM_COMMAND = re.compile(r"(?<![\w/.-])runlm ([a-z][a-z0-9-]*)")


def _choices() -> dict[str, argparse.ArgumentParser]:
    """Every name `runlm` accepts as a subcommand (aliases included) -> its parser, from the parser `runlm` builds."""
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Primary name -> parser (an alias shares its primary's parser object and comes after it)."""
    primary: dict[str, argparse.ArgumentParser] = {}
    for name, sub in _choices().items():
        if all(sub is not p for p in primary.values()):
            primary[name] = sub
    return primary


def aliases() -> dict[str, list[str]]:
    choices = _choices()
    primary: dict[str, list[str]] = {}
    for name, sub in choices.items():
        first = next(n for n, s in choices.items() if s is sub)
        primary.setdefault(first, [])
        if name != first:
            primary[first].append(name)
    return primary


def long_options(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def sections(text: str) -> dict[str, str]:
    """``runlm NAME`` heading -> the text under it, up to the next heading of its level or above."""
    lines = text.splitlines()
    heads = [(i, len(m[1]), m[2]) for i, line in enumerate(lines) if (m := HEADING.match(line))]
    # headings inside code blocks are not headings: drop any that sits between fences
    in_code = set()
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            in_code.add(i)
    heads = [h for h in heads if h[0] not in in_code]
    out: dict[str, str] = {}
    for k, (i, level, title) in enumerate(heads):
        m = COMMAND_HEADING.match(title.strip("`"))
        if not m:
            continue
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        assert m[1] not in out, f"two sections for runlm {m[1]}"
        out[m[1]] = "\n".join(lines[i + 1:end])
    return out


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text()


def test_every_subcommand_has_a_section_and_every_section_a_subcommand(page: str) -> None:
    documented, existing = set(sections(page)), set(subcommands())
    assert not existing - documented, f"subcommands with no '## runlm NAME' section in docs/cli.md: {existing - documented}"
    assert not documented - existing, f"docs/cli.md documents subcommands that do not exist: {documented - existing}"


def test_aliases_are_named_in_their_section(page: str) -> None:
    secs = sections(page)
    for name, names in aliases().items():
        for alias in names:
            assert f"runlm {alias}" in secs[name], f"the runlm {name} section does not name its alias {alias}"


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_usage_block_lists_exactly_the_long_options(page: str, name: str) -> None:
    text = sections(page).get(name)
    if text is None:
        pytest.fail(f"docs/cli.md has no section for runlm {name}")
    usage = FENCE.search(text)
    assert usage, f"the runlm {name} section has no usage block"
    assert re.match(rf"\s*runlm {re.escape(name)}\b", usage[1]), f"the runlm {name} usage block does not start with it"
    shown, actual = set(FLAG.findall(usage[1])), long_options(subcommands()[name])
    assert not actual - shown, f"runlm {name}: options missing from its usage in docs/cli.md: {sorted(actual - shown)}"
    assert not shown - actual, f"runlm {name}: docs/cli.md shows options it does not have: {sorted(shown - actual)}"


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_section_names_no_flag_its_command_lacks(page: str, name: str) -> None:
    text = sections(page).get(name, "")
    allowed = long_options(subcommands()[name]) | BACKEND_FLAGS | set(OTHER_FLAGS)
    unknown = set(FLAG.findall(text)) - allowed
    assert not unknown, f"the runlm {name} section in docs/cli.md names flags runlm {name} does not have: {sorted(unknown)}"


def test_page_names_only_existing_commands_and_flags(page: str) -> None:
    existing = subcommands()
    paragraphs = re.split(r"\n\s*\n", FENCE.sub("", page))
    code = "\n".join(FENCE.findall(page) + [c for para in paragraphs for c in INLINE_CODE.findall(para)])
    named = set(RUNLM_COMMAND.findall(code)) | {a for names in aliases().values() for a in names}
    all_names = set(existing) | {a for names in aliases().values() for a in names}
    assert not named - all_names, f"docs/cli.md runs subcommands that do not exist: {sorted(named - all_names)}"
    every_flag = {o for p in existing.values() for o in long_options(p)} | BACKEND_FLAGS | set(OTHER_FLAGS)
    unknown = set(FLAG.findall(page)) - every_flag
    assert not unknown, f"docs/cli.md names flags no runlm command has: {sorted(unknown)}"
