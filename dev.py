#!/usr/bin/env python3
"""Bootstrap and run: ``python3 dev.py demo`` (the main job) or ``python3 dev.py test [pytest args]``.

Creates ``.venv`` and installs the project on first use (again when pyproject.toml changes),
finds Postgres and Redis (``LOUSHO_DATABASE_URL`` / ``LOUSHO_REDIS_URL``, else this machine's
local servers, started if they are installed but down), then runs the command.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".lousho-installed"
LOCAL_DATABASE = "postgresql://postgres@127.0.0.1:5432/lousho"
LOCAL_REDIS = "redis://127.0.0.1:6379/0"


def say(text: str) -> None:
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


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _start_local_services() -> None:
    """Start this machine's Postgres and Redis when they are installed but not running."""
    if not _port_open("127.0.0.1", 5432) and shutil.which("pg_ctlcluster"):
        versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
        if versions:
            say(f"starting local PostgreSQL {versions[-1]}")
            subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "start"], check=False)
    if not _port_open("127.0.0.1", 6379) and shutil.which("redis-server"):
        say("starting local Redis")
        subprocess.run(["redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "--port", "6379",
                        "--save", "", "--appendonly", "no"], check=False)
    for _ in range(50):
        if _port_open("127.0.0.1", 5432) and _port_open("127.0.0.1", 6379):
            return
        time.sleep(0.2)


def services_env() -> dict[str, str]:
    """The environment naming the services: the caller's settings, else the local servers."""
    env = dict(os.environ)
    if "LOUSHO_DATABASE_URL" not in env or "LOUSHO_REDIS_URL" not in env:
        _start_local_services()
        if not (_port_open("127.0.0.1", 5432) and _port_open("127.0.0.1", 6379)):
            sys.exit("[dev] no PostgreSQL and Redis: set LOUSHO_DATABASE_URL and LOUSHO_REDIS_URL, "
                     "or install and start them on 127.0.0.1:5432 and 127.0.0.1:6379")
        env.setdefault("LOUSHO_DATABASE_URL", LOCAL_DATABASE)
        env.setdefault("LOUSHO_REDIS_URL", LOCAL_REDIS)
    return env


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 11):  # noqa: UP036  # this file runs before any venv exists
        sys.exit("Lousho Worker needs Python 3.11 or newer")
    if not argv or argv[0] not in ("demo", "test", "lousho"):
        print(__doc__)
        return 2
    bootstrap()
    env = services_env()
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return subprocess.run([str(VENV / "bin" / "lousho"), "demo", *rest], cwd=ROOT, env=env).returncode
    if command == "lousho":
        return subprocess.run([str(VENV / "bin" / "lousho"), *rest], cwd=ROOT, env=env).returncode
    checks = [[str(PYTHON), "-m", "ruff", "check", "store", "worker", "producer", "tests", "bench", "examples"],
              [str(PYTHON), "-m", "mypy", "store", "worker", "producer"]]
    for check in checks:
        if subprocess.run(check, cwd=ROOT, env=env).returncode != 0:
            return 1
    return subprocess.run([str(PYTHON), "-m", "pytest", *rest], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
