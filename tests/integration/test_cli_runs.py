"""``lousho migrate|send|pending|resume|history|fork|compare`` on the real services.

No worker runs: a sent run is checked queued (``pending`` lists it), and runs that must finish are stepped
in this process by the driver.
"""

from __future__ import annotations

import pytest

from producer.client import Client
from store.checkpoints import PostgresCheckpointStore
from store.records import LastError
from tests.support.cli_fixtures import Lousho, drive_in_background
from tests.support.driver import Driver, postgres

pytestmark = pytest.mark.integration


def test_migrate_says_the_schema_is_up_to_date(lousho: Lousho) -> None:
    printed = lousho("migrate")
    as_json = lousho("migrate", "--json")

    assert (printed.code, printed.out) == (0, "database schema is up to date\n")
    assert (as_json.code, as_json.json()) == (0, {"migrated": True})


def test_send_queues_the_input_and_pending_lists_the_run(lousho: Lousho) -> None:
    sent = lousho("send", "weather", "Weather in Oslo?", "--session", "w-1")
    again = lousho("send", "weather", "And in Rome?", "--session", "w-1", "--json")
    listed = lousho("pending")
    as_json = lousho("pending", "--json")

    assert (sent.code, sent.out) == (0, "queued input 1 for run w-1\n")
    assert again.code == 0
    assert again.json() == {"session_id": "w-1", "input": 2, "queued": True}
    assert listed.code == 0
    assert listed.out.startswith("w-1  weather  running  step 0")
    [run] = as_json.json()
    assert run["session_id"] == "w-1" and run["agent"] == "weather" and run["status"] == "in-progress"
    assert {
        "kind",
        "checkpoint_id",
        "state",
        "step",
        "approval_id",
        "last_error",
        "attempts",
        "next_attempt_at",
    } <= run.keys()


def test_pending_shows_a_retrying_runs_failures_in_a_row_and_next_attempt(
    lousho: Lousho, store: PostgresCheckpointStore
) -> None:
    assert lousho("send", "weather", "hi", "--session", "w-1").code == 0
    for token in (10, 11):  # two transient failures in a row, the next attempt an hour away
        claim = store.claim("w-1", token, None)
        assert claim.checkpoint is not None
        store.retry_later("w-1", claim.checkpoint.fence, LastError(code="X", message="503", retryable=True), 3600)

    listed = lousho("pending")
    [run] = lousho("pending", "--json").json()

    assert "  retrying  step 0  next attempt " in listed.out and " after 2 failure(s) in a row" in listed.out
    assert (run["state"], run["failures"], run["attempts"]) == ("retrying", 2, 0) and run["next_attempt_at"]


def test_pending_filters_by_agent_and_says_when_nothing_is_pending(lousho: Lousho) -> None:
    assert lousho("send", "weather", "hi", "--session", "w-1").code == 0

    assert lousho("pending", "--agent", "bank").out == "no pending runs\n"
    assert lousho("pending", "--agent", "bank", "--json").json() == []
    assert [r["session_id"] for r in lousho("pending", "--agent", "weather", "--json").json()] == ["w-1"]


def test_send_to_an_agent_the_workers_do_not_know_is_refused(lousho: Lousho, weather: Driver) -> None:
    printed = lousho("send", "shop", "hello", "--session", "s-1")
    as_json = lousho("send", "shop", "hello", "--session", "s-1", "--json")

    assert printed.code == 1 and printed.error_code() == "LOUSHO_AGENT_NOT_FOUND"
    assert "known agents: weather" in printed.err
    assert as_json.code == 1 and as_json.json()["error"]["code"] == "LOUSHO_AGENT_NOT_FOUND"
    assert lousho("pending", "--json").json() == []


def test_send_wait_prints_how_the_run_settled(lousho: Lousho, weather: Driver) -> None:
    thread = drive_in_background(weather, "w-1", lambda: weather.deps.store.load("w-1") is not None)
    printed = lousho("send", "weather", "Weather in Oslo?", "--session", "w-1", "--wait", "--timeout", "30")
    thread.join(30)

    assert printed.code == 0, printed.err
    assert printed.out == "w-1: stop after 2 step(s)\nSunny in Oslo.\n"

    # A finished run is listed pending again once its follow-up input is queued.
    thread = drive_in_background(weather, "w-1", lambda: bool(postgres(weather.deps.store).pending("weather")))
    as_json = lousho("send", "weather", "And now?", "--session", "w-1", "--wait", "--json", "--timeout", "30")
    thread.join(30)

    assert as_json.code == 0, as_json.err
    result = as_json.json()
    assert result["session_id"] == "w-1" and result["finish_reason"] == "stop" and result["text"] == "Still sunny."
    assert {"messages", "steps", "usage", "tool_calls"} <= result.keys()


def test_send_wait_that_times_out_prints_the_timeout_code(lousho: Lousho) -> None:
    printed = lousho("send", "weather", "hi", "--session", "w-1", "--wait", "--timeout", "0.2", "--json")

    assert printed.code == 1
    error = printed.json()["error"]
    assert error["code"] == "LOUSHO_OPERATION_TIMEOUT" and error["retryable"] is True


def test_resume_of_an_unknown_run_has_nothing_to_do(lousho: Lousho) -> None:
    printed = lousho("resume", "nobody")
    as_json = lousho("resume", "nobody", "--json")

    assert (printed.code, printed.out) == (0, "nothing pending for nobody\n")
    assert (as_json.code, as_json.json()) == (0, {"session_id": "nobody", "resumed": False})


def test_resume_of_a_queued_run_asks_a_worker_again(lousho: Lousho) -> None:
    assert lousho("send", "weather", "hi", "--session", "w-1").code == 0

    printed = lousho("resume", "w-1")
    as_json = lousho("resume", "w-1", "--json")

    assert (printed.code, printed.out) == (0, "resumed w-1\n")
    assert as_json.json() == {"session_id": "w-1", "resumed": True}


def test_send_with_metadata_stores_it_with_the_input(lousho: Lousho, store: PostgresCheckpointStore) -> None:
    sent = lousho("send", "weather", "hi", "--session", "w-1", "--metadata", '{"plan": "pro", "seats": [1, 2]}')

    assert sent.code == 0, sent.err
    (entry,) = store.inbox("w-1", 0)
    assert entry.metadata == {"plan": "pro", "seats": [1, 2]}


@pytest.mark.parametrize(
    ("metadata", "code"),
    [
        ("not json", "LOUSHO_CONFIG_INVALID"),
        ("[1, 2]", "LOUSHO_CONFIG_INVALID"),
        ('{"blob": "' + "x" * 17_000 + '"}', "LOUSHO_INPUT_TOO_LARGE"),
    ],
    ids=["not-json", "not-an-object", "too-large"],
)
def test_send_with_unusable_metadata_prints_its_code_and_queues_nothing(
    lousho: Lousho, client: Client, metadata: str, code: str
) -> None:
    printed = lousho("send", "weather", "hi", "--session", "w-1", "--metadata", metadata, "--json")

    assert printed.code == 1 and printed.json()["error"]["code"] == code
    assert client.store.load("w-1") is None


def test_resume_with_limits_writes_them_into_the_run(lousho: Lousho, client: Client) -> None:
    assert lousho("send", "weather", "hi", "--session", "w-1").code == 0

    resumed = lousho(
        "resume",
        "w-1",
        "--max-cost",
        "2.5",
        "--max-input-tokens",
        "1000",
        "--max-output-tokens",
        "200",
        "--max-duration",
        "90",
        "--json",
    )

    assert (resumed.code, resumed.json()) == (0, {"session_id": "w-1", "resumed": True})
    loaded = client.store.load("w-1")
    assert loaded is not None and loaded.limits == {
        "max_cost": 2.5,
        "max_input_tokens": 1000,
        "max_output_tokens": 200,
        "max_duration_s": 90.0,
    }
    assert lousho("resume", "w-1", "--max-output-tokens", "500").code == 0
    loaded = client.store.load("w-1")
    assert loaded is not None and loaded.limits == {"max_output_tokens": 500}


def test_resume_with_a_limit_that_is_not_positive_prints_the_configuration_code(lousho: Lousho, client: Client) -> None:
    assert lousho("send", "weather", "hi", "--session", "w-1").code == 0

    printed = lousho("resume", "w-1", "--max-cost", "-1")

    assert printed.code == 1 and printed.error_code() == "LOUSHO_CONFIG_INVALID"
    loaded = client.store.load("w-1")
    assert loaded is not None and loaded.limits is None


def test_resume_of_a_finished_run_has_nothing_to_do(lousho: Lousho, finished: str) -> None:
    assert lousho("resume", finished, "--json").json() == {"session_id": finished, "resumed": False}


def test_resume_of_a_run_awaiting_approval_prints_its_code(lousho: Lousho, paused: tuple[Driver, str]) -> None:
    printed = lousho("resume", "b-1")
    as_json = lousho("resume", "b-1", "--json")

    assert printed.code == 1 and printed.error_code() == "LOUSHO_SESSION_AWAITING_APPROVAL"
    assert as_json.code == 1 and as_json.json()["error"]["code"] == "LOUSHO_SESSION_AWAITING_APPROVAL"


def test_history_lists_saved_states_newest_first(lousho: Lousho, finished: str) -> None:
    printed = lousho("history", finished)
    as_json = lousho("history", finished, "--json")
    limited = lousho("history", finished, "--limit", "1", "--json")

    assert printed.code == 0
    lines = printed.out.splitlines()
    assert lines and all(line.startswith("seq ") and "messages, last " in line for line in lines)
    assert "finished" in lines[0]
    entries = as_json.json()
    assert len(entries) == len(lines)
    assert set(entries[0]) == {"step", "seq", "saved_at", "status", "checkpoint"}
    assert entries[0]["status"] == "finished" and entries[0]["step"] == 2
    assert [e["seq"] for e in entries] == sorted((e["seq"] for e in entries), reverse=True)
    assert limited.json() == entries[:1]


def test_history_of_an_unknown_run_is_empty(lousho: Lousho) -> None:
    assert lousho("history", "nobody").out == "no history for nobody\n"
    assert lousho("history", "nobody", "--json").json() == []


def test_fork_starts_a_new_run_from_a_step(lousho: Lousho, finished: str, client: Client) -> None:
    printed = lousho("fork", finished, "--from-step", "1")
    as_json = lousho("fork", finished, "--from-step", "1", "--new-id", "w-2", "--append-input", "And Rome?", "--json")

    assert printed.code == 0
    assert printed.out.startswith(f"forked {finished} at step 1 as ")
    assert "; run it with: lousho resume " in printed.out
    made = as_json.json()
    assert as_json.code == 0
    assert made["session_id"] == "w-2" and made["step"] == 1 and made["checkpoint"]["session_id"] == "w-2"
    assert client.store.load("w-2") is not None


def test_fork_of_an_unknown_run_or_step_prints_not_found(lousho: Lousho, finished: str) -> None:
    unknown = lousho("fork", "nobody", "--from-step", "1")
    no_step = lousho("fork", finished, "--from-step", "99", "--json")

    assert unknown.code == 1 and unknown.error_code() == "LOUSHO_CHECKPOINT_NOT_FOUND"
    assert no_step.code == 1 and no_step.json()["error"]["code"] == "LOUSHO_CHECKPOINT_NOT_FOUND"


def test_fork_to_a_taken_id_prints_the_configuration_code(lousho: Lousho, finished: str) -> None:
    printed = lousho("fork", finished, "--from-step", "1", "--new-id", finished, "--json")

    assert printed.code == 1 and printed.json()["error"]["code"] == "LOUSHO_CONFIG_INVALID"


def test_compare_prints_where_two_runs_diverge(lousho: Lousho, finished: str) -> None:
    same = lousho("compare", finished, finished)
    as_json = lousho("compare", finished, finished, "--json")

    assert same.code == 0
    assert same.out == f"{finished} (2 steps) vs {finished} (2 steps): identical\n"
    comparison = as_json.json()
    assert set(comparison) == {"diverged_at", "a", "b", "drift"}
    assert comparison["diverged_at"] is None and len(comparison["a"]) == 2


def test_compare_with_an_unknown_run_prints_not_found(lousho: Lousho, finished: str) -> None:
    printed = lousho("compare", finished, "nobody", "--json")

    assert printed.code == 1 and printed.json()["error"]["code"] == "LOUSHO_CHECKPOINT_NOT_FOUND"


def test_pending_lists_a_sub_agents_run_under_its_lead(lousho: Lousho, store: PostgresCheckpointStore) -> None:
    assert lousho("send", "weather", "plan a trip", "--session", "w-1").code == 0
    assert lousho("send", "weather", "other", "--session", "w-2").code == 0
    store.start_children(
        "w-1", "weather", [("w-1.task-0123456789abcdef", "weather", "check the tides")], fence=0
    )  # no step claimed the lead yet

    listed = lousho("pending").out.splitlines()
    as_json = lousho("pending", "--json").json()

    assert [line.split("  ")[0] for line in listed] == ["w-1", "", "w-2"]
    assert listed[1].startswith("  w-1.task-0123456789abcdef  weather  running")
    assert [(r["session_id"], r["lead"]) for r in as_json] == [
        ("w-1", None),
        ("w-1.task-0123456789abcdef", "w-1"),
        ("w-2", None),
    ]
