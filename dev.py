#!/usr/bin/env python3
"""Bootstrap and run: ``python3 dev.py demo`` (the main job) or ``python3 dev.py test [--no-checks] [pytest args]``.

Creates ``.venv`` and installs the project on first use (again when pyproject.toml changes), then
runs the command on the Postgres and Redis named by ``LOUSHO_DATABASE_URL`` / ``LOUSHO_REDIS_URL``,
or, for each URL unset, on an embedded server shipped in a wheel (data in ``.lousho/``), started
for the command and stopped after it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".lousho-installed"


def say(text: str) -> None:
    """Print ``text`` as a line of this script's own output."""
    print(f"[dev] {text}", flush=True)


def bootstrap() -> None:
    """Create the virtual environment and install the project with its dev tools."""
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted and PYTHON.exists():
        return
    if not PYTHON.exists():
        say("creating .venv")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    say("installing the project and its dev tools into .venv")
    subprocess.run([str(PYTHON), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([str(PYTHON), "-m", "pip", "install", "-q", "-e", f"{ROOT}[dev]"], check=True)
    STAMP.write_text(wanted)


#: Debian packages some tests drive, by the program they install: the Flower and page tests' browser, the
#: connection pooler of the PgBouncer test, and the private Redis servers and certificates of the Sentinel and TLS
#: tests. Playwright drives /usr/bin/chromium; it downloads no browser itself.
SYSTEM_PACKAGES = {
    "/usr/bin/chromium": "chromium",
    "/usr/sbin/pgbouncer": "pgbouncer",
    "/usr/bin/redis-server": "redis-server",
    "/usr/bin/openssl": "openssl",
}


def system_packages() -> None:
    """Install the Debian packages of ``SYSTEM_PACKAGES`` that are missing, when this machine can (root, apt-get).

    Elsewhere the tests that need them are skipped with the reason (and fail in CI, where ``.ci/run`` needs them).
    """
    missing = [package for program, package in SYSTEM_PACKAGES.items() if not Path(program).exists()]
    if not missing:
        return
    if not shutil.which("apt-get") or os.geteuid() != 0:
        say(f"missing Debian packages {', '.join(missing)}: the tests that need them will be skipped")
        return
    say(f"installing Debian packages for the tests: {', '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "-qq", "update"], check=False, env=env)
    if (
        subprocess.run(
            ["apt-get", "-qq", "install", "-y", *missing], check=False, env=env, stdout=subprocess.DEVNULL
        ).returncode
        != 0
    ):
        say("could not install them: the tests that need them will be skipped")


def services_env() -> tuple[dict[str, str], list[str]]:
    """The environment, and the command prefix that provides the services it does not name.

    With ``LOUSHO_DATABASE_URL`` and ``LOUSHO_REDIS_URL`` set, no prefix; otherwise
    ``python -m devkit.embedded exec --``, which starts (or reuses) the embedded server for each
    URL unset, exports it to the command and stops what it started when the command ends.
    """
    env = dict(os.environ)
    if env.get("LOUSHO_DATABASE_URL") and env.get("LOUSHO_REDIS_URL"):
        return env, []
    say("LOUSHO_DATABASE_URL / LOUSHO_REDIS_URL unset: using the embedded PostgreSQL and Redis (.lousho/)")
    return env, [str(PYTHON), "-m", "devkit.embedded", "exec", "--"]


def main(argv: list[str]) -> int:
    """Run ``demo``, ``lousho`` or ``test`` in the bootstrapped environment; the usage and 2 otherwise.

    ``test`` first runs ruff (lint and format check), mypy and import-linter, and pytest (with ``argv``'s other
    arguments) only when they pass. Returns the command's exit status.
    """
    if sys.version_info < (3, 11):  # noqa: UP036  # this file runs before any venv exists
        sys.exit("Lousho Worker needs Python 3.11 or newer")
    if not argv or argv[0] not in ("demo", "test", "lousho"):
        print(__doc__)
        return 2
    bootstrap()
    env, embedded = services_env()
    command, rest = argv[0], argv[1:]
    lousho = str(VENV / "bin" / "lousho")
    if command == "demo":  # lousho demo starts (and stops) the embedded servers itself
        return subprocess.run([lousho, "demo", *rest], cwd=ROOT, env=env).returncode
    if command == "lousho":
        return subprocess.run([*embedded, lousho, *rest], cwd=ROOT, env=env).returncode
    system_packages()
    if rest[:1] == ["--no-checks"]:  # the static checks already ran on this tree (a second pass of the tests)
        rest = rest[1:]
        checks = []
    else:
        sources = ["store", "worker", "producer", "devkit", "tests", "bench", "examples", "dev.py"]
        checks = [
            [str(PYTHON), "-m", "ruff", "check", *sources],
            [str(PYTHON), "-m", "ruff", "format", "--check", *sources],
            [str(PYTHON), "-m", "mypy", "store", "worker", "producer", "devkit", "tests"],
            [str(VENV / "bin" / "lint-imports")],
        ]
    for check in checks:
        if subprocess.run(check, cwd=ROOT, env=env).returncode != 0:
            return 1
    # -s: the crash, webhook, schedule and history tests print the figures they measure.
    if not rest:  # the whole suite: the real-worker tests run beside the rest (tests/support/groups.py)
        groups = [*embedded, str(PYTHON), "-m", "tests.support.groups", "-s"]
        return subprocess.run(groups, cwd=ROOT, env=env).returncode
    return subprocess.run([*embedded, str(PYTHON), "-m", "pytest", "-s", *rest], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
