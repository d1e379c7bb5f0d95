"""Importing the packages changes nothing process-wide: a Django app or a service that sends runs can import them
next to its own Celery app. Each check runs in a fresh interpreter (this one has imported everything already)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, logging, sys, threading
import celery._state

def snapshot():
    root = logging.getLogger()
    return {"current_app": repr(celery._state._tls.current_app), "default_app": repr(celery._state.default_app),
            "root_handlers": [repr(h) for h in root.handlers], "root_level": root.level,
            "root_filters": [repr(f) for f in root.filters], "excepthook": repr(sys.excepthook),
            "threading_excepthook": repr(threading.excepthook),
            "record_factory": repr(logging.getLogRecordFactory())}

before = snapshot()
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps({"before": before, "after": snapshot()}))
"""


@pytest.mark.parametrize(
    "modules",
    [["worker"], ["worker.celery"], ["producer"], ["worker", "worker.celery", "producer"]],
    ids=lambda modules: "+".join(modules),
)
def test_importing_changes_no_process_wide_state(modules: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["after"] == seen["before"]


def test_the_entry_points_app_is_made_on_first_use_with_redaction() -> None:
    probe = (
        "import sys, celery._state, worker.celery as c; before = celery._state._tls.current_app;"
        " app = c.app; print(before is None, celery._state.get_current_app() is app,"
        " sys.excepthook is not sys.__excepthook__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True"]
