"""The ``.lousho/`` folder of the embedded services: its lock, its state file and the private files in it.

It knows which servers run only through ``state.json``; it starts and stops nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from devkit.errors import EmbeddedError


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by the owner only."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a server's log, to quote in an error."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def password(path: Path) -> str:
    """The password kept in ``path``; a new random one is written there (mode 0600) the first time."""
    if path.exists():
        return path.read_text().strip()
    made = secrets.token_hex(16)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, made + "\n")
    return made


class ServerFolder:
    """``<root>/.lousho``: ``state.json`` (ports, pids and start times of the running servers) and ``lock``."""

    def __init__(self, root: Path) -> None:
        """Describe the folder of ``root``; nothing is created until it is locked."""
        self.root = root
        self.home = root / ".lousho"

    def _prepare(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        ignore = self.home / ".gitignore"
        if not ignore.exists():
            ignore.write_text("*\n")

    @contextlib.contextmanager
    def locked(self, timeout: float = 120.0) -> Iterator[None]:
        """Hold the folder's lock, which serialises starting and stopping across processes.

        Raises:
            EmbeddedError: another process held it for ``timeout`` seconds.
        """
        self._prepare()
        fd = os.open(self.home / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError as exc:
                    if time.monotonic() > deadline:
                        raise EmbeddedError(f"another process holds {self.home / 'lock'}") from exc
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def load_state(self) -> dict[str, dict[str, Any]]:
        """``{server name: {"pid", "created", "port"}}``; empty when there is no readable state file."""
        try:
            loaded = json.loads((self.home / "state.json").read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def update_state(self, name: str, entry: dict[str, Any] | None) -> None:
        """Record server ``name`` as running (``entry``) or, with None, as stopped."""
        state = self.load_state()
        if entry is None:
            state.pop(name, None)
        else:
            state[name] = entry
        write_private(self.home / "state.json", json.dumps(state, indent=2) + "\n")
