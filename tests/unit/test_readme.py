"""The README and the pages under docs/ stay true: their Python blocks compile and use names, methods and keywords
that exist, every ``lousho`` command line they show names commands and options the ``lousho`` parser accepts, and
every relative link reaches an existing file and heading. The README stays a front door: the two set-up commands
first, under 250 lines."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from producer import AgentHandle, Approvals, Client, Run, Schedules, cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: Every page checked: the README and each Markdown page under docs/.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250
_FENCE = re.compile(r"^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"`(lousho [^`]+)`")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(?P<title>.+?) *$", re.MULTILINE)


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _placed_blocks(lang: str) -> list[tuple[str, str]]:
    """Each ``lang`` block of every page, with where it is (``docs/guide/agents.md, python block 2``)."""
    found = []
    for page in PAGES:
        bodies = [m["body"] for m in _FENCE.finditer(_text(page)) if m["lang"] == lang]
        found += [(f"{_name(page)}, {lang} block {n}", body) for n, body in enumerate(bodies, start=1)]
    return found


def _blocks(lang: str) -> list[str]:
    return [body for _, body in _placed_blocks(lang)]


def _prose(page: Path) -> str:
    """The page without its fenced blocks."""
    return _FENCE.sub("", _text(page))


def _command_lines() -> list[str]:
    """Every ``lousho ...`` line of the shell blocks, and every inline ``lousho ...`` span of the prose."""
    lines = [line.strip() for body in _blocks("sh") for line in body.splitlines()]
    found = [line for line in lines if line.startswith("lousho ")]
    return found + [span for page in PAGES for span in _INLINE.findall(_prose(page))]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]


def _check_command(parser: argparse.ArgumentParser, line: str) -> None:
    words = [w.strip("[]") for w in shlex.split(line, comments=True)][1:]
    path, position, takes_value = "lousho", 0, False
    for word in words:
        if takes_value:
            takes_value = False
            continue
        if word.startswith("--"):
            option = _options(parser).get(word.split("=", 1)[0])
            assert option is not None, f"`{line}`: {path} has no option {word}"
            takes_value = option.nargs != 0 and "=" not in word
            continue
        commands = _subcommands(parser)
        if commands:
            assert word in commands, f"`{line}`: {path} has no command {word!r} (it has {sorted(commands)})"
            parser, path, position = commands[word], f"{path} {word}", 0
            continue
        positionals = _positionals(parser)
        if position < len(positionals) and positionals[position].choices is not None:
            choices = sorted(positionals[position].choices or ())
            assert word in choices, f"`{line}`: {path} takes one of {choices}, not {word!r}"
        position += 1


def test_readme_python_examples_compile() -> None:
    blocks = _placed_blocks("python")
    assert len(blocks) >= 8
    for where, source in blocks:
        try:
            compile(source, where, "exec")
        except SyntaxError as exc:
            pytest.fail(f"{where} does not compile: {exc}")


def test_readme_command_lines_use_real_commands_and_options() -> None:
    lines = _command_lines()
    assert len(lines) >= 15
    for line in lines:
        _check_command(cli.build_parser(), line)


def test_readme_shows_every_lousho_command() -> None:
    shown = {shlex.split(line, comments=True)[1] for line in _command_lines()}
    missing = set(_subcommands(cli.build_parser())) - shown
    assert not missing, f"neither the README nor docs/ shows an example of: {sorted(missing)}"


#: What the examples call their handles; a method called on one must exist and take the keywords given.
_ROOTS: dict[str, type] = {"client": Client, "shop": AgentHandle, "run": Run}
_PROPERTIES: dict[tuple[type, str], type] = {
    (Client, "schedules"): Schedules,
    (Client, "approvals"): Approvals,
    (AgentHandle, "approvals"): Approvals,
}


def _owner(node: ast.expr) -> type | None:
    """The class a ``client``/``shop``/``run`` chain such as ``client.schedules`` evaluates to, if known."""
    if isinstance(node, ast.Name):
        return _ROOTS.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _owner(node.value)
        return _PROPERTIES.get((owner, node.attr)) if owner is not None else None
    return None


def _check_keywords(target: Any, call: ast.Call, where: str) -> None:
    parameters = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for keyword in call.keywords:
        assert keyword.arg is None or keyword.arg in parameters, f"{where} takes no keyword {keyword.arg!r}"


def test_readme_python_examples_use_real_names_and_keywords() -> None:
    namespace: dict[str, Any] = {}
    trees = [ast.parse(source) for source in _blocks("python")]
    for node in (n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)):
        module = importlib.import_module(node.module or "")
        for alias in node.names:
            assert hasattr(module, alias.name), f"an example imports {alias.name} from {node.module}, which lacks it"
            namespace[alias.asname or alias.name] = getattr(module, alias.name)
    checked = 0
    for call in (n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if isinstance(call.func, ast.Name) and call.func.id in namespace:
            _check_keywords(namespace[call.func.id], call, call.func.id)
            checked += 1
        elif isinstance(call.func, ast.Attribute) and (owner := _owner(call.func.value)) is not None:
            method = getattr(owner, call.func.attr, None)
            assert callable(method), f"{owner.__name__} has no method {call.func.attr!r}"
            _check_keywords(method, call, f"{owner.__name__}.{call.func.attr}")
            checked += 1
    assert checked >= 20


def test_readme_starts_with_the_two_set_up_commands() -> None:
    text = _text(README)
    first = _FENCE.search(text)
    assert first is not None and first["lang"] == "sh", "the README's first block is not the set-up commands"
    assert first.start() < text.index("\n## "), "the set-up commands come after the README's first section"
    assert not text[: first.start()].strip().replace("# Lousho Worker", ""), "only the title precedes the commands"
    commands = [shlex.split(line, comments=True) for line in first["body"].splitlines()]
    assert commands == [["python3", "dev.py", "demo"], ["python3", "dev.py", "test"]]


def test_readme_is_a_front_door_and_docs_hold_the_rest() -> None:
    lines = len(_text(README).splitlines())
    assert lines < README_MAX_LINES, f"the README has {lines} lines: move reference text into docs/"
    for folder in ("guide", "operations", "reference"):
        assert list((ROOT / "docs" / folder).glob("*.md")), f"docs/{folder}/ has no page"


def _slug(title: str) -> str:
    """The anchor a heading gets on the forge that renders these pages: lower case, punctuation dropped, spaces
    as hyphens (inline code and link markup dropped first)."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    for match in _HEADING.finditer(_prose(page)):
        slug = base = _slug(match["title"])
        count = 0
        while slug in anchors:
            count += 1
            slug = f"{base}-{count}"
        anchors.add(slug)
    return anchors


def _links(page: Path) -> list[str]:
    """The targets of the page's Markdown links, outside fenced blocks and code spans."""
    return [m["target"] for m in _LINK.finditer(_CODE_SPAN.sub("", _prose(page)))]


def _is_relative(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target) is None and not target.startswith("//")


def test_every_relative_link_reaches_a_file_and_heading() -> None:
    broken = []
    checked = 0
    for page in PAGES:
        for target in filter(_is_relative, _links(page)):
            path, _, anchor = target.partition("#")
            destination = (page.parent / path).resolve() if path else page
            checked += 1
            if not destination.exists():
                broken.append(f"{_name(page)}: {target} (no such file)")
            elif anchor and (destination.suffix != ".md" or anchor not in _anchors(destination)):
                broken.append(f"{_name(page)}: {target} (no heading #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)
    assert checked >= 40


def test_every_docs_page_is_linked_from_another_page() -> None:
    linked = {
        (page.parent / target.partition("#")[0]).resolve()
        for page in PAGES
        for target in filter(_is_relative, _links(page))
        if target.partition("#")[0]
    }
    orphans = [_name(page) for page in PAGES[1:] if page.resolve() not in linked]
    assert not orphans, f"pages no other page links to: {orphans}"


def test_the_front_door_and_the_tools_page_say_a_call_id_protects_one_call_only() -> None:
    # A call the model asks again after a crash is a new call with a new id: a key from the business data is needed
    # for an effect due once per business event, and the pages that recommend ``ctx.tool_call_id`` must say so.
    for page in (README, ROOT / "docs" / "guide" / "agents.md"):
        prose = " ".join(_prose(page).split())
        assert "`ctx.tool_call_id`" in prose, _name(page)
        assert "new call with a new id" in prose and "key from your own data" in prose, (
            f"{_name(page)} does not warn that a call id protects one call only"
        )
