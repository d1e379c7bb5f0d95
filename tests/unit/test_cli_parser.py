"""The ``lousho`` parser without services: ``--version``, usage errors, ``--json`` honoured or refused, bad ids.

Nothing here reaches Postgres or Redis: every command below fails or finishes before it would connect.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from producer import cli
from tests.support.cli_fixtures import Lousho

ROOT = Path(__file__).resolve().parents[2]
VERSION = metadata.version("lousho-worker")


def _commands(parser: argparse.ArgumentParser, path: str = "lousho") -> dict[str, argparse.ArgumentParser]:
    """Every leaf command of the parser, by its full name (``lousho schedules create``...)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.update(_commands(child, f"{path} {name}"))
    return found or {path: parser}


def _json_option(parser: argparse.ArgumentParser) -> argparse.Action | None:
    return next((a for a in parser._actions if "--json" in a.option_strings), None)


def test_version_prints_the_installed_version(lousho: Lousho) -> None:
    printed = lousho("--version")

    assert printed.code == 0
    assert printed.out.strip() == f"lousho {VERSION}"


def test_the_installed_command_and_python_m_print_the_version() -> None:
    script = Path(sys.executable).parent / "lousho"
    commands = [[sys.executable, "-m", "producer.cli", "--version"]]
    if script.exists():
        commands.append([str(script), "--version"])

    for command in commands:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)

        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"lousho {VERSION}"


def test_python_m_reports_a_usage_error_with_status_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "producer.cli", "no-such-command"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert done.returncode == 2
    assert "invalid choice" in done.stderr


def test_every_command_accepts_or_refuses_json_and_none_ignores_it() -> None:
    commands = _commands(cli.build_parser())
    refused = {
        name
        for name, parser in commands.items()
        if (option := _json_option(parser)) is not None and not isinstance(option, argparse._StoreTrueAction)
    }
    accepted = {
        name for name, parser in commands.items() if isinstance(_json_option(parser), argparse._StoreTrueAction)
    }

    assert refused == {"lousho dev", "lousho demo", "lousho webhooks serve", "lousho flower"}
    assert accepted | refused == set(commands), "a command without --json"
    assert {
        "lousho migrate",
        "lousho send",
        "lousho pending",
        "lousho resume",
        "lousho history",
        "lousho fork",
        "lousho compare",
        "lousho approvals",
        "lousho schedules create",
        "lousho schedules list",
        "lousho schedules pause",
        "lousho schedules resume",
        "lousho schedules delete",
        "lousho schedules fires",
    } <= accepted


@pytest.mark.parametrize(
    "argv",
    [
        ["dev", "--json"],
        ["dev", "--stop", "--json"],
        ["demo", "--json"],
        ["webhooks", "serve", "--json"],
    ],
)
def test_json_on_a_long_running_command_is_a_usage_error(lousho: Lousho, argv: list[str]) -> None:
    printed = lousho(*argv)

    assert printed.code == 2
    assert printed.out == ""
    assert "--json is not supported here" in printed.err
    assert printed.err.startswith("usage: lousho ")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["no-such-command"],
        ["send", "weather", "hello"],  # --session is required
        ["send", "weather", "--session", "s-1"],  # the message is missing
        ["resume"],
        ["history", "w-1", "--limit", "many"],
        ["fork", "w-1"],  # --from-step is required
        ["fork", "w-1", "--from-step", "one"],
        ["compare", "w-1"],
        ["approvals", "maybe", "appr-1"],
        ["schedules"],
        ["schedules", "create", "daily", "weather", "hi"],  # --cron or --every is required
        ["schedules", "create", "daily", "weather", "hi", "--cron", "@daily", "--every", "60"],
        ["schedules", "create", "daily", "weather", "hi", "--every", "60", "--overlap", "sometimes"],
        ["schedules", "fires"],
        ["webhooks"],
        ["webhooks", "serve", "--port", "eighty"],
        ["webhooks", "serve", "--log-level", "loud"],
        ["dev", "--concurrency", "two"],
    ],
)
def test_bad_arguments_exit_2_with_usage(lousho: Lousho, argv: list[str]) -> None:
    printed = lousho(*argv)

    assert printed.code == 2
    assert printed.out == ""
    assert "usage: lousho" in printed.err


@pytest.mark.parametrize(
    "argv",
    [
        ["send", "weather", "hello", "--session", "bad id"],
        ["send", "weather", "hello", "--session", "x" * 201],
        ["resume", "bad/id"],
        ["history", "bad id"],
        ["fork", ".hidden", "--from-step", "1"],
        ["fork", "w-1", "--from-step", "1", "--new-id", "no spaces"],
        ["compare", "w-1", "bad id"],
    ],
)
def test_an_invalid_session_id_is_refused_with_its_code(lousho: Lousho, argv: list[str]) -> None:
    printed = lousho(*argv)
    as_json = lousho(*argv, "--json")

    assert printed.code == 1
    assert printed.out == ""
    assert printed.error_code() == "LOUSHO_SESSION_ID_INVALID"
    assert as_json.code == 1
    assert as_json.err == ""
    error = as_json.json()["error"]
    assert error["code"] == "LOUSHO_SESSION_ID_INVALID"
    assert error["retryable"] is False and "invalid session id" in error["message"]


def test_an_invalid_agent_name_is_refused_with_its_code(lousho: Lousho) -> None:
    printed = lousho("send", "no agent", "hello", "--session", "s-1", "--json")

    assert printed.code == 1
    assert printed.json()["error"]["code"] == "LOUSHO_CONFIG_INVALID"
