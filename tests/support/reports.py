"""Whether a test's call failed, kept on the test item for fixtures that keep logs only then."""

from __future__ import annotations

import pytest

#: Set on each test item once its call phase ran: True when it failed (``tests/conftest.py`` sets it).
FAILED = pytest.StashKey[bool]()


def failed(request: pytest.FixtureRequest) -> bool:
    """Whether the test that ``request`` belongs to failed in its call phase."""
    return bool(request.node.stash.get(FAILED, False))
