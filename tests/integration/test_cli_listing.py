"""``lousho runs|show|delete`` on the real services: runs listed in the same state as ``Client.runs``, one run
explained with what it waits on and what moves it next, and a run deleted without naming its agent."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from producer.client import Client
from producer.inspection import parse_since
from store import errors
from store.checkpoints import PostgresCheckpointStore
from store.records import LastError, Message
from tests.support.cli_fixtures import Lousho
from tests.support.driver import Driver

pytestmark = pytest.mark.integration


def _parked(store: PostgresCheckpointStore, session_id: str) -> None:
    store.append_input(session_id, "weather", [Message(role="user", content="hi")])
    claim = store.claim(session_id, 3, None)
    assert claim.checkpoint is not None
    store.record_failure(
        session_id, claim.checkpoint.fence, LastError(code="LOUSHO_PROVIDER_ERROR", message="400", retryable=False)
    )


def test_runs_lists_every_run_in_the_state_client_runs_gives_it(
    lousho: Lousho,
    client: Client,
    store: PostgresCheckpointStore,
    weather: Driver,
    paused: tuple[Driver, str],
    finished: str,
) -> None:
    _parked(store, "w-parked")
    client.agent("weather").send("Weather in Rome?", session_id="w-queued")

    as_json = lousho("runs", "--json")
    printed = lousho("runs")

    assert as_json.code == 0 and printed.code == 0
    listed = {run["session_id"]: run["state"] for run in as_json.json()["items"]}
    assert (
        listed
        == {run.session_id: run.state for run in client.runs().items}
        == {"w-1": "finished", "b-1": "awaiting-approval", "w-parked": "parked", "w-queued": "running"}
    )
    assert as_json.json()["next_cursor"] is None
    lines = printed.out.splitlines()
    assert [line.split("  ")[:3] for line in lines] == [
        ["w-queued", "weather", "running"],
        ["w-parked", "weather", "parked (LOUSHO_PROVIDER_ERROR)"],
        ["w-1", "weather", "finished (stop)"],
        ["b-1", "bank", "awaiting-approval"],
    ]
    assert "step 2" in lines[2] and "created " in lines[2]


def test_runs_filters_pages_and_takes_the_old_word_for_a_run_awaiting_approval(
    lousho: Lousho, client: Client, weather: Driver, paused: tuple[Driver, str], finished: str
) -> None:
    for n in range(3):
        client.agent("weather").send("more", session_id=f"w-more-{n}")

    bank = lousho("runs", "--agent", "bank", "--json")
    states = lousho("runs", "--state", "finished,awaiting-approval", "--json")
    with pytest.warns(DeprecationWarning, match="'paused' is called 'awaiting-approval'"):
        old_word = lousho("runs", "--state", "paused", "--json")
    first = lousho("runs", "--agent", "weather", "--limit", "2")
    later = lousho("runs", "--since", (datetime.now(UTC) + timedelta(hours=1)).isoformat(), "--json")
    unknown = lousho("runs", "--state", "sleeping")
    too_many = lousho("runs", "--limit", "501", "--json")

    assert [r["session_id"] for r in bank.json()["items"]] == ["b-1"]
    assert [r["session_id"] for r in states.json()["items"]] == ["w-1", "b-1"]
    assert [r["session_id"] for r in old_word.json()["items"]] == ["b-1"]
    assert first.out.splitlines()[0].startswith("w-more-2  weather  running")
    cursor = first.out.splitlines()[-1].removeprefix("more: lousho runs --cursor ")
    rest = lousho("runs", "--agent", "weather", "--limit", "2", "--cursor", cursor, "--json")
    assert [r["session_id"] for r in rest.json()["items"]] == ["w-more-0", "w-1"]
    assert later.json()["items"] == []
    assert unknown.code == 1 and unknown.error_code() == "LOUSHO_CONFIG_INVALID"
    assert too_many.code == 1 and too_many.json()["error"]["code"] == "LOUSHO_CONFIG_INVALID"


def test_show_explains_a_run_awaiting_approval_with_its_last_steps_and_links(
    lousho: Lousho, paused: tuple[Driver, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, approval_id = paused
    monkeypatch.setenv("LOUSHO_UI_URL", "https://lousho.example/")
    monkeypatch.setenv("LOUSHO_FLOWER_URL", "http://flower.example:5555")

    printed = lousho("show", "b-1")
    as_json = lousho("show", "b-1", "--json")

    assert printed.code == 0
    out = printed.out
    assert out.startswith("b-1  bank  awaiting-approval\n")
    assert f"  waiting on approval ids: {approval_id}\n" in out and "  waiting on person: True\n" in out
    assert f"  next: a person: decide the approval(s) {approval_id} (lousho approvals list)\n" in out
    assert "  last steps:\n    step   1" in out
    assert "  page: https://lousho.example/ui/runs/b-1\n" in out
    assert "  flower: http://flower.example:5555/tasks?search=b-1\n" in out
    shown = as_json.json()
    assert (shown["state"], shown["finish_reason"], shown["waiting_on"]["approval_ids"]) == (
        "awaiting-approval",
        "awaiting-approval",
        [approval_id],
    )
    steps = [s["step"] for s in shown["last_steps"]]
    assert steps[0] == 1 and steps == sorted(steps, reverse=True) and shown["links"]["page"].endswith("/ui/runs/b-1")


def test_show_and_delete_of_an_unknown_run_exit_1_and_delete_drops_a_run(lousho: Lousho, finished: str) -> None:
    unknown = lousho("show", "nope")
    bad = lousho("show", "bad id!", "--json")
    deleted = lousho("delete", "w-1")
    again = lousho("delete", "w-1", "--json")

    assert unknown.code == 1 and unknown.error_code() == "LOUSHO_CHECKPOINT_NOT_FOUND"
    assert bad.code == 1 and bad.json()["error"]["code"] == "LOUSHO_SESSION_ID_INVALID"
    assert (deleted.code, deleted.out) == (0, "deleted w-1\n")
    assert again.code == 1 and again.json()["error"]["code"] == "LOUSHO_CHECKPOINT_NOT_FOUND"
    assert lousho("runs", "--json").json()["items"] == []


def test_since_takes_a_duration_or_a_time() -> None:
    assert parse_since("90s") == timedelta(seconds=90) and parse_since("6h") == timedelta(hours=6)
    assert parse_since("1.5d") == timedelta(hours=36) and parse_since(None) is None
    assert parse_since("2025-03-01T12:00:00") == datetime(2025, 3, 1, 12, tzinfo=UTC)
    assert parse_since("2025-03-01T12:00:00+02:00") == datetime(2025, 3, 1, 10, tzinfo=UTC)
    with pytest.raises(errors.ConfigurationError):
        parse_since("yesterday")
