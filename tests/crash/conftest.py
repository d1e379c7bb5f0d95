"""Crash-tier fixtures: a cluster factory whose processes are always killed, with their logs shown on failure."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import reports
from tests.support.cluster import Cluster


@pytest.fixture
def make_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Cluster]]:
    """Make clusters under ``tmp_path``; each is closed (every process killed) when the test ends."""
    made: list[Cluster] = []

    def make(crash_at: str = "", extra_env: dict[str, str] | None = None) -> Cluster:
        cluster = Cluster(tmp_path / f"cluster-{len(made) + 1}", crash_at=crash_at, extra_env=extra_env or {})
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        if reports.failed(request):
            cluster.dump_logs()
            cluster.save_state()
            print(f"logs, events and table copies kept in {cluster.workdir}")
        cluster.close()
