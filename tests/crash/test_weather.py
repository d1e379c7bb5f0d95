"""Production weather with real ``celery worker`` processes (issue 10, points 1-3).

- A failed follow-up: the run is listed by ``pending()`` as parked, the sweep leaves it alone, and
  ``resume()`` or a later send finishes it with the follow-up applied once. Runs that cannot
  progress never crowd a stalled run out of the sweep's batch.
- A 15-second provider outage (503s, then connections refused) is ridden out by every active run,
  with the project's default retry settings.
- A rolling deploy: an old and a new worker side by side finish every run of an agent only the new
  one has, and a run whose agent no live worker has is parked only once the retry budget is spent.

The workers load ``tests.support.weather_agents``; its JSONL log (``LOUSHO_WEATHER_LOG``) records
every provider call, every ``lousho.advance`` delivered, and every one published, with the task
that published it, which is how re-sends by the sweep are counted here.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import celery
import psycopg
import pytest
from psycopg.types.json import Jsonb

from store.inputs import normalize_input
from store.settings import Settings
from tests.fakes.provider_server import FakeProviderServer
from tests.support import checker, services
from tests.support.agents import run_input
from tests.support.cluster import Cluster, wait_until
from tests.support.weather_agents import (
    ADVANCE,
    AGENT,
    LOG_ENV,
    NEW_AGENT,
    RECOVER,
    RELEASE_ENV,
    URL_ENV,
    WeatherScript,
    ask,
    read_events,
)

pytest.importorskip("openai")

TIMING = services.test_settings()
LEASE_TTL_S = TIMING.lease_ttl_ms / 1000
SWEEP_S = TIMING.recover_interval_s
#: The project's defaults (the outage test must pass with them, not with a tuned budget).
DEFAULTS = {name: field.default for name, field in Settings.model_fields.items()}
BACKOFF_MAX_S = float(DEFAULTS["retry_backoff_max_s"])
#: One step of the test agents (model turn or tool batch) on a loaded 2-core machine, generously.
STEP_S = 2.0
SLACK_S = 5.0
OUTAGE_S = 15.0
BOTH_MODULES = "tests.support.agents,tests.support.weather_agents"
AGENT_NOT_FOUND = "LOUSHO_AGENT_NOT_FOUND"


@pytest.fixture
def provider() -> Iterator[tuple[FakeProviderServer, WeatherScript]]:
    """The fake OpenAI-compatible server, answering the ``weather`` agent through a ``WeatherScript``."""
    server = FakeProviderServer().start()
    script = WeatherScript()
    server.script = script
    try:
        yield server, script
    finally:
        server.stop()


def _weather_cluster(make_cluster: Callable[..., Cluster], url: str, **env: str) -> Cluster:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": "tests.support.weather_agents", URL_ENV: url, **env})
    cluster.extra_env[LOG_ENV] = str(_weather_log(cluster))
    return cluster


def _weather_log(cluster: Cluster) -> Path:
    return cluster.workdir / "weather.jsonl"


def _events(cluster: Cluster, kind: str, since: float = 0.0, until: float = float("inf")) -> list[dict[str, Any]]:
    return [e for e in read_events(_weather_log(cluster)) if e.get("kind") == kind and since <= e["ts"] <= until]


def _rows(cluster: Cluster, session_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Control columns of runs, straight from Postgres."""
    with psycopg.connect(cluster.database_url) as conn:
        found = conn.execute(
            "SELECT session_id, status, seq, last_error, inbox_head, inbox_cursor FROM runs WHERE session_id = ANY(%s)",
            (list(session_ids),),
        ).fetchall()
    return {
        r[0]: {"status": r[1], "seq": r[2], "last_error": r[3], "inbox_head": r[4], "inbox_cursor": r[5]} for r in found
    }


def _parked(row: dict[str, Any] | None) -> bool:
    error = (row or {}).get("last_error")
    return isinstance(error, dict) and bool(error) and not error.get("retryable", False)


def _settled(row: dict[str, Any] | None) -> bool:
    """Finished, every input applied, no error left."""
    return (
        row is not None
        and row["status"] == "finished"
        and row["last_error"] is None
        and row["inbox_cursor"] >= row["inbox_head"]
    )


def _wait_parked(cluster: Cluster, session_ids: Sequence[str], timeout: float) -> float:
    started = time.monotonic()
    wait_until(
        lambda: (
            all(_parked(r) for r in _rows(cluster, session_ids).values())
            and len(_rows(cluster, session_ids)) == len(session_ids)
        ),
        timeout,
        f"{list(session_ids)} to be parked",
    )
    return time.monotonic() - started


def _wait_settled(cluster: Cluster, session_ids: Sequence[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rows = _rows(cluster, session_ids)
        if all(_settled(rows.get(s)) for s in session_ids):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"runs not settled after {timeout} s: { {s: rows.get(s) for s in session_ids} }")
        time.sleep(0.1)


def _user_texts(cluster: Cluster, session_id: str) -> list[str]:
    checkpoint = cluster.client.store.load(session_id)
    assert checkpoint is not None
    return [str(m.content) for m in checkpoint.messages if m.role == "user"]


def _final_text(cluster: Cluster, session_id: str) -> str | None:
    checkpoint = cluster.client.store.load(session_id)
    assert checkpoint is not None
    last = checkpoint.messages[-1]
    return str(last.content) if last.role == "assistant" else None


# -- point 1: failed follow-ups ---------------------------------------------------------------------------


def test_a_failed_follow_up_is_listed_as_parked_left_alone_by_the_sweep_and_finished_by_resume_or_send(
    make_cluster: Callable[..., Cluster], provider: tuple[FakeProviderServer, WeatherScript]
) -> None:
    server, script = provider
    cluster = _weather_cluster(make_cluster, server.openai_url)
    cluster.start_worker("w1", concurrency=2)
    cluster.start_beat()
    resumed, resent = "followup-resume", "followup-send"
    runs = [resumed, resent]
    for sid in runs:
        cluster.send(AGENT, sid, ask(sid))
    cluster.wait_finished(runs, timeout=30)

    # Given a key rotation: the provider refuses the follow-ups of both runs with a 401 (not retryable)
    script.failing.update(runs)
    for sid in runs:
        cluster.send(AGENT, sid, f"follow-up for {sid}")
    _wait_parked(cluster, runs, timeout=20)

    # When several sweep intervals pass (the run is stale after one lease TTL)
    window_s = LEASE_TTL_S + 4 * SWEEP_S
    start = time.time() + 0.5
    time.sleep(window_s + 0.5)
    delivered = Counter(e["run_id"] for e in _events(cluster, "deliver", since=start) if e["run_id"] in runs)
    by_sweep = Counter(
        e["run_id"] for e in _events(cluster, "publish", since=start) if e["run_id"] in runs and e.get("by") == RECOVER
    )
    listed = {p.session_id: p for p in cluster.client.agent(AGENT).pending()}
    print(
        f"over {window_s:.0f} s ({window_s / SWEEP_S:.0f} sweep intervals) after the failed follow-ups:"
        f" sweep re-sends {dict(by_sweep)}, steps delivered {dict(delivered)};"
        f" pending() lists {sorted(s for s in listed if s in runs)} with states"
        f" { {s: getattr(p, 'state', None) for s, p in listed.items() if s in runs} }"
    )

    # Then both are listed, parked, with why; the sweep sent them nothing
    assert any(e["run_id"] in runs for e in _events(cluster, "deliver", until=start)), (
        "the weather log saw none of the runs' own steps: the re-send counts would be vacuous"
    )
    for sid in runs:
        assert sid in listed, f"pending() does not list {sid} (row: {_rows(cluster, [sid])[sid]})"
        entry = listed[sid]
        assert entry.last_error is not None and not entry.last_error.retryable, entry
        assert "401" in entry.last_error.message or "auth" in entry.last_error.message, entry.last_error
        assert getattr(entry, "state", None) == "parked", entry
    assert sum(by_sweep.values()) == 0, f"the sweep re-sent runs that cannot progress: {dict(by_sweep)}"
    assert sum(delivered.values()) == 0, f"steps delivered to parked runs: {dict(delivered)}"

    # When the cause is fixed: one run is resumed, the other gets a later message
    script.failing.clear()
    run = cluster.client.agent(AGENT).resume(resumed)
    assert run is not None, "resume() of the parked run did nothing"
    cluster.send(AGENT, resent, f"later for {resent}")
    _wait_settled(cluster, runs, timeout=20)

    # Then each follow-up is in the transcript exactly once, in order, and was answered
    assert _user_texts(cluster, resumed) == [ask(resumed), f"follow-up for {resumed}"]
    assert _final_text(cluster, resumed) == f"reply 2 for {resumed}: follow-up for {resumed}"
    assert _user_texts(cluster, resent) == [ask(resent), f"follow-up for {resent}", f"later for {resent}"]
    assert _final_text(cluster, resent) == f"reply 3 for {resent}: later for {resent}"


_FILLER_OLD = "now() - interval '1 hour' - g * interval '1 millisecond'"


def _fill(database_url: str, template: str, per_kind: int, waiting: int) -> Counter[str]:
    """Rows of runs that cannot progress, older than anything else, built from ``template`` (a parked run).

    - ``filler-parked-*``: copies of the template, in whatever shape the engine parks a failed follow-up;
    - ``filler-legacy-*``: a finished run whose failed follow-up is still queued (rows stored before the fix);
    - ``filler-waiting-*``: retrying, next attempt in an hour (paused on an approval where the schema has
      no retry time).
    """
    made: Counter[str] = Counter()
    with psycopg.connect(database_url, autocommit=True) as conn:
        columns = {
            r[0]
            for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'runs'"
            ).fetchall()
        }

        def clone(prefix: str, count: int, overrides: str, params: Sequence[Any] = ()) -> None:
            conn.execute(
                f"""
                INSERT INTO runs SELECT (jsonb_populate_record(NULL::runs, to_jsonb(r) || jsonb_build_object(
                    'session_id', %s::text || g, 'updated_at', {_FILLER_OLD}, 'created_at', {_FILLER_OLD})
                    || {overrides})).*
                FROM runs r, generate_series(1, %s) g WHERE r.session_id = %s""",
                (prefix, *params, count, template),
            )
            made[prefix] += count

        clone("filler-parked-", per_kind, "'{}'::jsonb")
        conn.execute(
            "INSERT INTO inbox (session_id, n, messages) SELECT 'filler-parked-' || g, i.n, i.messages"
            " FROM inbox i, generate_series(1, %s) g WHERE i.session_id = %s",
            (per_kind, template),
        )
        legacy_error = {
            "code": "LOUSHO_PROVIDER_REQUEST_FAILED",
            "message": "openai: auth (HTTP 401)",
            "retryable": False,
        }
        clone(
            "filler-legacy-",
            per_kind,
            "jsonb_build_object('status', 'finished', 'last_error', %s::jsonb, 'inbox_head', r.inbox_cursor + 1)",
            (Jsonb(legacy_error),),
        )
        conn.execute(
            "INSERT INTO inbox (session_id, n, messages) SELECT 'filler-legacy-' || g, r.inbox_cursor + 1,"
            ' \'[{"role": "user", "content": "a follow-up that failed"}]\'::jsonb'
            " FROM runs r, generate_series(1, %s) g WHERE r.session_id = %s",
            (per_kind, template),
        )
        if "next_attempt_at" in columns:
            retrying = {
                "code": "LOUSHO_PROVIDER_REQUEST_FAILED",
                "message": "openai: server (HTTP 503)",
                "retryable": True,
            }
            clone(
                "filler-waiting-",
                waiting,
                "jsonb_build_object('status', 'in-progress', 'last_error', %s::jsonb, 'inbox_head', r.inbox_cursor,"
                " 'next_attempt_at', now() + interval '1 hour', 'retry_since', now(), 'failures', 3)",
                (Jsonb(retrying),),
            )
        else:
            clone(
                "filler-waiting-",
                waiting,
                "jsonb_build_object('status', 'awaiting-approval', 'last_error', NULL, 'inbox_head', r.inbox_cursor)",
            )
    return made


def test_runs_that_cannot_progress_never_crowd_a_stalled_run_out_of_the_sweep(
    make_cluster: Callable[..., Cluster], provider: tuple[FakeProviderServer, WeatherScript]
) -> None:
    server, script = provider
    cluster = _weather_cluster(make_cluster, server.openai_url)
    cluster.start_worker("w1", concurrency=2)
    cluster.start_beat()
    template = "template-parked"
    cluster.send(AGENT, template, ask(template, turns=1))
    cluster.wait_finished([template], timeout=30)
    script.failing.add(template)
    cluster.send(AGENT, template, "a follow-up the provider refuses")
    _wait_parked(cluster, [template], timeout=20)

    # Given 600 runs that cannot progress, all older than any other run (the sweep takes the oldest 500)
    made = _fill(cluster.database_url, template, per_kind=260, waiting=80)
    assert sum(made.values()) == 600
    # And a stalled run: its input is durable but its producer died before publishing the step
    stalled = "stalled-ordinary"
    filled = time.time()
    cluster.client.store.append_input(stalled, AGENT, normalize_input(ask(stalled)))

    # When the sweep runs for a while
    bound_s = LEASE_TTL_S + SWEEP_S + STEP_S + SLACK_S
    deadline = time.monotonic() + bound_s
    recovered_after = None
    while time.monotonic() < deadline:
        if _rows(cluster, [stalled])[stalled]["seq"] >= 1:
            recovered_after = time.time() - filled
            break
        time.sleep(0.1)
    time.sleep(max(0.0, LEASE_TTL_S + 2 * SWEEP_S - (time.time() - filled)))
    swept = Counter(
        e["run_id"].rsplit("-", 1)[0]
        for e in _events(cluster, "publish", since=filled)
        if str(e["run_id"]).startswith("filler-") and e.get("by") == RECOVER
    )
    delivered = sum(1 for e in _events(cluster, "deliver", since=filled) if str(e["run_id"]).startswith("filler-"))
    print(
        f"fillers {dict(made)}; stalled run recovered after"
        f" {'never' if recovered_after is None else f'{recovered_after:.1f} s'} (bound {bound_s:.0f} s);"
        f" sweep re-sends of fillers {dict(swept)}, filler steps delivered {delivered}"
    )

    # Then the stalled run was recovered within the recovery bound and finishes; no filler was sent
    assert recovered_after is not None, (
        f"the stalled run was not recovered within {bound_s:.0f} s: the sweep re-sent {sum(swept.values())}"
        f" runs that cannot progress instead"
    )
    assert sum(swept.values()) == 0, f"the sweep re-sent runs that cannot progress: {dict(swept)}"
    assert any(e["run_id"] == stalled and e.get("by") == RECOVER for e in _events(cluster, "publish", since=filled)), (
        "the weather log saw no sweep publish of the stalled run: the filler counts would be vacuous"
    )
    assert delivered == 0
    cluster.wait_finished([stalled], timeout=20)


# -- point 2: a provider outage -----------------------------------------------------------------------------


class Gate:
    """A TCP relay in front of the fake provider. ``down()`` is a real outage: the port refuses
    connections and open ones are cut; ``up()`` listens again on the same port."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """``base_url`` of an OpenAI client going through the relay."""
        return f"http://127.0.0.1:{self.port}/v1"

    def up(self) -> Gate:
        """Listen (again) on the relay's port."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.1)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="gate-accept", daemon=True).start()
        return self

    def down(self) -> None:
        """Stop listening and cut every open connection."""
        listener, self._listener = self._listener, None
        if listener is not None:
            _close(listener)
        with self._lock:
            connections, self._open = list(self._open), set()
        for connection in connections:
            _close(connection)

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                _close(client)
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, target), name="gate-pump", daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                _close(end)
                with self._lock:
                    self._open.discard(end)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def test_a_fifteen_second_provider_outage_is_ridden_out_by_every_active_run(
    make_cluster: Callable[..., Cluster], provider: tuple[FakeProviderServer, WeatherScript]
) -> None:
    server, script = provider
    gate = Gate(server.port).up()
    try:
        _ride_out_an_outage(make_cluster, gate, script)
    finally:
        gate.down()


def _ride_out_an_outage(make_cluster: Callable[..., Cluster], gate: Gate, script: WeatherScript) -> None:
    cluster = _weather_cluster(make_cluster, gate.url)
    cluster.start_worker("w1", concurrency=2)
    cluster.start_beat()
    runs = [f"outage-{n}" for n in range(6)]
    for sid in runs:
        cluster.send(AGENT, sid, ask(sid, turns=3, ms=400))
    wait_until(
        lambda: all(r["seq"] >= 1 for r in _rows(cluster, runs).values()) and len(_rows(cluster, runs)) == 6,
        20,
        "every run's first model turn",
    )
    before = {sid: row["seq"] for sid, row in _rows(cluster, runs).items()}

    # When the provider is down for 15 s: first it answers 503, then its port refuses connections
    start = time.time()
    script.outage = True
    parked: dict[str, tuple[float, Any]] = {}
    states: Counter[str] = Counter()
    while time.time() < start + OUTAGE_S:
        if script.outage and time.time() >= start + OUTAGE_S / 3:
            gate.down()
        for sid, row in _rows(cluster, runs).items():
            if _parked(row) and sid not in parked:
                parked[sid] = (time.time() - start, row["last_error"])
        states.update(str(getattr(p, "state", None)) for p in cluster.client.agent(AGENT).pending())
        time.sleep(0.25)
    end = time.time()
    script.outage = False
    gate.up()

    # Then every run finishes once it is back (or we stop at the first parked run)
    bound_s = BACKOFF_MAX_S + LEASE_TTL_S + SWEEP_S + 4 * STEP_S + SLACK_S
    finished_after = None
    while time.time() < end + bound_s:
        rows = _rows(cluster, runs)
        for sid, row in rows.items():
            if _parked(row) and sid not in parked:
                parked[sid] = (time.time() - start, row["last_error"])
        if parked:
            break
        if all(_settled(rows.get(s)) for s in runs):
            finished_after = time.time() - end
            break
        time.sleep(0.2)
    calls = [e for e in _events(cluster, "provider", since=start, until=end) if e["phase"] == "start"]
    outcomes = Counter(
        e.get("outcome") for e in _events(cluster, "provider", since=start, until=end) if e["phase"] == "end"
    )
    print(
        f"outage of {OUTAGE_S:.0f} s over {len(runs)} active runs: {len(calls)} provider calls during it"
        f" ({dict(Counter(e['run_id'] for e in calls))}; outcomes {dict(outcomes)});"
        f" all finished {'never' if finished_after is None else f'{finished_after:.1f} s'} after it ended"
        f" (bound {bound_s:.0f} s); pending() states seen during it {dict(states)}"
    )

    assert not parked, "runs parked by a transient outage: " + "; ".join(
        f"{sid} after {at:.1f} s: {error}" for sid, (at, error) in sorted(parked.items())
    )
    assert finished_after is not None, f"not finished {bound_s:.0f} s after the outage: {_rows(cluster, runs)}"
    assert len({e["run_id"] for e in calls}) == len(runs), "the outage did not hit every run"
    assert len(calls) <= 40 * len(runs), "the provider was hammered during the outage (no backoff)"
    assert states["retrying"] > 0, f"pending() never showed a run as retrying: {dict(states)}"
    for sid in runs:
        assert _final_text(cluster, sid) == f"report for {sid}"
        assert _rows(cluster, [sid])[sid]["seq"] > before[sid]


# -- point 3: rolling deploys ---------------------------------------------------------------------------


class OldProducer:
    """A producer of the previous release: it sends ``lousho.advance`` by name to the shared queue."""

    def __init__(self, broker_url: str, queue: str) -> None:
        self.app = celery.Celery("old-producer", broker=broker_url, set_as_current=False)
        self.app.conf.update(task_serializer="json", accept_content=["json"])
        self.queue = queue
        self.sent = 0

    def advance(self, session_id: str) -> None:
        self.app.send_task(ADVANCE, args=(session_id, None), queue=self.queue)
        self.sent += 1

    def close(self) -> None:
        self.app.close()


def _outcomes_in(log_text: str, session_ids: Sequence[str]) -> Counter[str]:
    """Outcomes of the worker's ``advance <id> seq=<n> -> <outcome>`` lines for these runs."""
    found: Counter[str] = Counter()
    for line in log_text.splitlines():
        marker = line.find(" advance ")
        if marker < 0 or " -> " not in line:
            continue
        words = line[marker + len(" advance ") :].split()
        if words and words[0] in session_ids:
            found[line.rsplit(" -> ", 1)[1].strip()] += 1
    return found


def test_an_old_and_a_new_worker_finish_every_run_of_an_agent_only_the_new_one_has(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": BOTH_MODULES, RELEASE_ENV: "old"})
    cluster.extra_env[LOG_ENV] = str(_weather_log(cluster))
    old = cluster.start_worker("old", concurrency=2)
    cluster.extra_env[RELEASE_ENV] = "new"
    cluster.start_worker("new", concurrency=2)
    cluster.start_beat()
    runs = [f"deploy-{n}" for n in range(10)]
    producer = OldProducer(services.test_redis_url(), TIMING.queue)
    try:
        # Given new producers starting half the runs, and old ones (input durable, then the shared queue) the rest
        for sid in runs[:5]:
            cluster.send(NEW_AGENT, sid, run_input(sid, calls="2,1", sleep="50-150"))
        for sid in runs[5:]:
            cluster.client.store.append_input(
                sid, NEW_AGENT, normalize_input(run_input(sid, calls="2,1", sleep="50-150"))
            )
            producer.advance(sid)
        # And old producers resuming every run while it runs
        for _ in range(2):
            time.sleep(0.3)
            for sid in runs:
                producer.advance(sid)

        # When the fleet works through them (stopping at the first parked run)
        deadline = time.monotonic() + 45
        parked: dict[str, Any] = {}
        while time.monotonic() < deadline:
            rows = _rows(cluster, runs)
            parked = {s: r["last_error"] for s, r in rows.items() if _parked(r)}
            if parked or all(_settled(rows.get(s)) for s in runs):
                break
            time.sleep(0.2)
    finally:
        producer.close()

    to_old = [e for e in _events(cluster, "deliver") if e["run_id"] in runs and str(e.get("node")).startswith("old-")]
    print(
        f"old-producer messages {producer.sent}; steps of {NEW_AGENT} delivered to the old worker: {len(to_old)}"
        f" (queues {dict(Counter(e.get('queue') for e in to_old))}), its outcomes"
        f" {dict(_outcomes_in(old.log_path.read_text(errors='replace'), runs))}; parked {len(parked)}"
    )

    # Then none is parked, all finish, and the steps the old worker got were handed back
    assert not parked, f"runs parked during a rolling deploy: {parked}"
    rows = _rows(cluster, runs)
    assert all(_settled(rows.get(s)) for s in runs), f"not all finished: {rows}"
    assert to_old, "the old worker never got a step of the new agent: nothing was handed back (vacuous)"
    report = checker.check(cluster.database_url, cluster.log_path, expected=runs, faults=())
    checker.print_report(report, "rolling deploy: old and new worker")
    checker.assert_clean(report)


def test_a_run_whose_agent_no_live_worker_has_is_parked_only_once_the_retry_budget_is_spent(
    make_cluster: Callable[..., Cluster],
) -> None:
    retry_for_s = 3.0
    cluster = make_cluster(
        extra_env={"LOUSHO_AGENTS": BOTH_MODULES, RELEASE_ENV: "old", "LOUSHO_RETRY_FOR_S": str(retry_for_s)}
    )
    cluster.extra_env[LOG_ENV] = str(_weather_log(cluster))
    cluster.start_worker("old", concurrency=2)
    cluster.start_beat()
    sid = "orphan-run"

    # Given a run of an agent no worker of the fleet has, sent by a new producer and by an old one
    sent = time.monotonic()
    cluster.send(NEW_AGENT, sid, run_input(sid))
    producer = OldProducer(services.test_redis_url(), TIMING.queue)
    try:
        producer.advance(sid)
    finally:
        producer.close()

    # When the retry budget is spent
    bound_s = retry_for_s + LEASE_TTL_S + 3 * SWEEP_S + STEP_S + SLACK_S
    deadline = sent + bound_s
    parked_after = None
    while time.monotonic() < deadline:
        if _parked(_rows(cluster, [sid])[sid]):
            parked_after = time.monotonic() - sent
            break
        time.sleep(0.1)
    row = _rows(cluster, [sid])[sid]
    error = row["last_error"] or {}
    swept = Counter(
        e.get("queue") for e in _events(cluster, "publish") if e["run_id"] == sid and e.get("by") == RECOVER
    )
    listed = {p.session_id: p for p in cluster.client.pending()}
    print(
        f"parked {'never' if parked_after is None else f'{parked_after:.1f} s'} after the send (budget"
        f" {retry_for_s:.0f} s, bound {bound_s:.0f} s): {error}; sweep re-sends by queue {dict(swept)};"
        f" pending() state {getattr(listed.get(sid), 'state', None)}"
    )

    # Then it is parked as an unknown agent, after the budget, saying no live worker has it
    assert parked_after is not None, f"not parked {bound_s:.0f} s after the send: {row}"
    assert error["code"] == AGENT_NOT_FOUND, error
    assert parked_after >= 0.9 * retry_for_s, (
        f"parked {parked_after:.1f} s after the send, before the {retry_for_s:.0f} s retry budget: a worker"
        f" of the new release starting meanwhile would have run it"
    )
    assert "no live worker" in error["message"].lower(), error
    assert sid in listed and getattr(listed[sid], "state", None) == "parked", listed.get(sid)
