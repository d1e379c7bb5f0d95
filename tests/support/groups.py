"""The whole test suite as two pytest sessions side by side: ``python -m tests.support.groups [pytest options]``.

What ``python3 dev.py test`` runs when it is given no test paths. The tests of ``tests/crash`` drive real
``celery worker`` processes and spend most of their time waiting on them, so they run beside the rest instead of
after it: each session has its own test database and Redis database (``LOUSHO_TEST_DATABASE``,
``LOUSHO_TEST_REDIS_DB``) and its own temporary folder, so neither sees the other's rows, keys or files. A few crash
files go with the rest (``WITH_THE_REST``) so that both sessions take about as long. The rest prints as it runs;
the worker tests' output follows once they end. The exit status is the first non-zero one (0 when both passed).
``LOUSHO_TEST_GROUPS=1`` runs one session, as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["WITH_THE_REST", "WORKER_FOLDER", "main"]

ROOT = Path(__file__).resolve().parents[2]
#: The folder whose tests start real worker, beat and server processes: a session of its own.
WORKER_FOLDER = "tests/crash"
#: Crash files run in the other session, to even out the two sessions' times (the pages in a browser, the
#: Kubernetes manifests).
WITH_THE_REST = (
    "tests/crash/test_ui_browser.py",
    "tests/crash/test_ui_run_drawing.py",
    "tests/crash/test_ui_run_why.py",
    "tests/crash/test_deploy_k8s.py",
)


def _rest() -> list[str]:
    """The test folders but the worker folder, and the crash files that run with them."""
    folders = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").iterdir()
        if path.is_dir() and str(path.relative_to(ROOT)) != WORKER_FOLDER and any(path.glob("test_*.py"))
    )
    return [*folders, *WITH_THE_REST]


def _database(env: dict[str, str]) -> tuple[str, int]:
    """The worker session's test database and Redis database, beside the main session's."""
    name = env.get("LOUSHO_TEST_DATABASE", "lousho_test")
    redis_db = int(env.get("LOUSHO_TEST_REDIS_DB", "14"))
    return f"{name}_workers", redis_db - 1 if redis_db > 0 else redis_db + 1


def main(options: list[str]) -> int:
    """Run the worker folders and the rest as two pytest sessions at once; the first non-zero status, else 0."""
    pytest = [sys.executable, "-m", "pytest", *options]
    if os.environ.get("LOUSHO_TEST_GROUPS") == "1":
        return subprocess.run(pytest, cwd=ROOT).returncode
    env = dict(os.environ)
    database, redis_db = _database(env)
    env.update({"LOUSHO_TEST_DATABASE": database, "LOUSHO_TEST_REDIS_DB": str(redis_db)})
    with tempfile.TemporaryDirectory(prefix="lousho-workers-") as scratch:
        log_path = Path(scratch) / "workers.log"
        started = time.monotonic()
        with open(log_path, "wb") as log:
            workers = subprocess.Popen(
                [
                    *pytest,
                    *("-p", "no:cacheprovider", "--basetemp", str(Path(scratch) / "tmp"), WORKER_FOLDER),
                    *(f"--ignore={path}" for path in WITH_THE_REST),
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                rest = subprocess.run([*pytest, *_rest()], cwd=ROOT)
                rest_done = time.monotonic() - started
                workers_status = workers.wait()
            except BaseException:
                workers.kill()
                workers.wait()
                raise
        print(f"\n[tests] the worker tests ({WORKER_FOLDER}), run beside the rest:", flush=True)
        sys.stdout.buffer.write(log_path.read_bytes())
        print(
            f"[tests] the rest: exit {rest.returncode} after {rest_done:.0f} s; the worker tests: exit"
            f" {workers_status}; both after {time.monotonic() - started:.0f} s",
            flush=True,
        )
    return rest.returncode or workers_status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
