"""The README's examples stay true: its Python blocks compile and use names, methods and keywords that exist,
and every ``lousho`` command line it shows names commands and options the ``lousho`` parser accepts."""

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

README = Path(__file__).resolve().parents[2] / "README.md"
_FENCE = re.compile(r"^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"`(lousho [^`]+)`")


def _blocks(lang: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    return [m["body"] for m in _FENCE.finditer(text) if m["lang"] == lang]


def _command_lines() -> list[str]:
    """Every ``lousho ...`` line of the shell blocks, and every inline ``lousho ...`` span of the prose."""
    lines = [line.strip() for body in _blocks("sh") for line in body.splitlines()]
    found = [line for line in lines if line.startswith("lousho ")]
    prose = _FENCE.sub("", README.read_text(encoding="utf-8"))
    return found + _INLINE.findall(prose)


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
    blocks = _blocks("python")
    assert len(blocks) >= 8
    for number, source in enumerate(blocks, start=1):
        try:
            compile(source, f"README python block {number}", "exec")
        except SyntaxError as exc:
            pytest.fail(f"README python block {number} does not compile: {exc}")


def test_readme_command_lines_use_real_commands_and_options() -> None:
    lines = _command_lines()
    assert len(lines) >= 15
    for line in lines:
        _check_command(cli.build_parser(), line)


def test_readme_shows_every_lousho_command() -> None:
    shown = {shlex.split(line, comments=True)[1] for line in _command_lines()}
    missing = set(_subcommands(cli.build_parser())) - shown
    assert not missing, f"the README shows no example of: {sorted(missing)}"


#: What the README's examples call their handles; a method called on one must exist and take the keywords given.
_ROOTS: dict[str, type] = {"client": Client, "shop": AgentHandle, "run": Run}
_PROPERTIES: dict[tuple[type, str], type] = {(Client, "schedules"): Schedules, (Client, "approvals"): Approvals,
                                             (AgentHandle, "approvals"): Approvals}


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
            assert hasattr(module, alias.name), f"README imports {alias.name} from {node.module}, which lacks it"
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
