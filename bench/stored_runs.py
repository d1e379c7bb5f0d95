"""Stored runs made in bulk with ``generate_series`` inserts, for the benchmarks that need a full table.

``fill_states`` spreads runs over the states of the runs' one vocabulary (``STATE_MIX``; ``bench.listing``);
``fill_mix`` builds on it a table as a live one looks (sub-agent runs, approvals, history, events, runs moving,
crashed, due for a retry, cohorts of old runs; ``bench.scale``). ``bench.retention`` uses its document and message
bodies for the runs it prunes.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

DOCUMENT = (
    '{"format": 2, "messages_count": 20, "step": 20, "finish_reason": "stop", "final_text": "Order 7 has'
    ' shipped by express; the customer was told.", "usage": {"input_tokens": 5210, "output_tokens": 880,'
    ' "requests": 10}, "business_state": {"order": 7, "carrier": "express"}, "fingerprint": {"tools":'
    ' ["charge", "ship", "email"], "model": "mock"}}'
)
MESSAGE = (
    '{"role": "assistant", "content": "Checking the order, then the carrier; this text stands for a model'
    ' turn of ordinary length with a little reasoning in it.", "tool_calls": [{"id": "call_1", "name":'
    ' "ship", "args": {"order": 7, "carrier": "express"}}]}'
)


#: How ``fill_states`` spreads runs over the states of the runs' one vocabulary, out of 100: (state, share,
#: the columns that put a run there). Most runs are finished, as in any table that keeps runs for a while.
STATE_MIX = (
    ("finished", 80, "status = 'finished', inbox_head = 1, inbox_cursor = 1"),
    ("running", 5, "inbox_head = 1"),
    (
        "retrying",
        3,
        """last_error = '{"code": "LOUSHO_PROVIDER_ERROR", "retryable": true}',
                       next_attempt_at = now() + interval '1 minute'""",
    ),
    ("awaiting-approval", 4, "status = 'awaiting-approval', inbox_head = 1, inbox_cursor = 1"),
    ("waiting", 2, "waiting = true, inbox_head = 1, inbox_cursor = 1"),
    (
        "parked",
        2,
        """last_error = '{"code": "LOUSHO_AGENT_DRIFT", "retryable": false}', inbox_head = 1,
                     inbox_cursor = 1""",
    ),
    ("aborted", 2, "aborted = true, inbox_head = 1, inbox_cursor = 1"),
    (
        "budget-exceeded",
        2,
        """aborted = true, inbox_head = 1, inbox_cursor = 1,
                              document = document || '{"finish_reason": "budget-exceeded"}'""",
    ),
)


def fill_states(conn: psycopg.Connection[object], runs: int, agents: int = 4, days: int = 90) -> dict[str, int]:
    """Insert ``runs`` runs of ``agents`` agents (``agent-0``...), created over the last ``days`` days, in every state.

    Each gets a format-2 document of ordinary size (step, usage, finish reason); a run's state follows its number
    (``STATE_MIX``). Returns how many runs each state should hold.
    """
    conn.execute(f"""INSERT INTO runs (session_id, agent, status, seq, document, created_at, updated_at)
                     SELECT 'run-' || lpad(g::text, 7, '0'), 'agent-' || (g % {agents}), 'in-progress', 20,
                            '{DOCUMENT}', now() - make_interval(secs => ({runs} - g) * {days} * 86400.0 / {runs}),
                            now() - make_interval(secs => ({runs} - g) * {days} * 86400.0 / {runs})
                     FROM generate_series(1, {runs}) g""")
    expected: dict[str, int] = {}
    low = 0
    for state, share, columns in STATE_MIX:
        high = low + share
        number = "(substr(session_id, 5)::int % 100)"
        conn.execute(
            f"UPDATE runs SET {columns} WHERE substr(session_id, 1, 4) = 'run-'"
            f" AND {number} >= {low} AND {number} < {high}"
        )
        expected[state] = sum(1 for g in range(1, runs + 1) if low <= g % 100 < high)
        low = high
    return expected


#: The events a run's steps leave, in turn (``describe`` adds up the ``step.done`` costs).
_EVENT_TYPES = ("run.start", "step.done", "tool.done", "step.done", "run.done")
#: A run's number (``fill_states``), for runs aliased ``r``: the seven digits a sub-agent run shares with its lead.
_NUMBER = "substr(r.session_id, 5, 7)::int"


@dataclass(frozen=True)
class Mix:
    """What ``fill_mix`` stored, by kind, for a check against the database."""

    #: Runs of their own (``run-...``) by listed state.
    states: dict[str, int]
    #: Sub-agent runs: two under one finished run in ten, under every waiting lead and one cohort run in ten.
    children: int
    #: Running runs silent for days: what the recovery sweep must send on.
    crashed: int
    #: Retrying runs whose retry time has come.
    retries_due: int
    #: Waiting leads whose children have all settled after their last save (a wake-up that was lost).
    lost_wakeups: int
    #: Waiting leads paused on their second child's approval (listed as waiting all the same).
    paused_leads: int
    #: Retention cohorts, and the finished runs of their own in each (``old-...``; sub-agent runs not counted).
    cohorts: int
    cohort_runs: int
    #: Rows each run (children and cohorts included) has of message rows, history and events.
    messages: int
    history: int
    events: int

    @property
    def total_runs(self) -> int:
        """Every run row: runs of their own, the cohorts' and all sub-agent runs."""
        return sum(self.states.values()) + self.cohorts * self.cohort_runs + self.children


def state_of(state: str, t: str = "r") -> str:
    """SQL true for a run of ``fill_states`` (aliased ``t``) that ``STATE_MIX`` puts in ``state``.

    Its number is read from the first seven digits of the id, which a sub-agent run shares with its lead, so
    sub-agent runs are left out by ``parent_id``.
    """
    low = 0
    for name, share, _ in STATE_MIX:
        if name == state:
            number = f"(substr({t}.session_id, 5, 7)::int % 100)"
            return (
                f"({t}.parent_id IS NULL AND substr({t}.session_id, 1, 4) = 'run-'"
                f" AND {number} >= {low} AND {number} < {low + share})"
            )
        low += share
    raise ValueError(f"no state {state!r} in STATE_MIX")


#: Columns of sub-agent runs (status, inbox head and cursor, last save; SQL over the lead ``l`` and the number ``c``):
#: both finished before their lead's last save, or after it (a wake-up the lead has not had); or the first finished
#: and the second, for a lead of an even number, paused on an approval before the lead's last save (the lead is
#: paused on it), else still running (a worker moves it).
_SETTLED_BEFORE = "'finished', 1, 1, l.updated_at - interval '1 minute'"
_SETTLED_AFTER = "'finished', 1, 1, l.updated_at + interval '1 minute'"
_EVEN_LEAD = "substr(l.session_id, 5, 7)::int % 2 = 0"
_ONE_WAITED_ON = f"""CASE WHEN c = 1 THEN 'finished' WHEN {_EVEN_LEAD} THEN 'awaiting-approval' ELSE 'in-progress' END,
  1, CASE WHEN c = 2 AND NOT {_EVEN_LEAD} THEN 0 ELSE 1 END,
  CASE WHEN c = 1 THEN l.updated_at - interval '1 minute' WHEN {_EVEN_LEAD} THEN l.updated_at - interval '30 seconds'
       ELSE now() END"""


def _children(conn: psycopg.Connection[object], leads: str, columns: str) -> int:
    """Two sub-agent runs under each run ``leads`` selects (as ``l``), with ``columns`` (SQL over ``l`` and ``c``)."""
    cursor = conn.execute(f"""INSERT INTO runs (session_id, parent_id, agent, seq, document, created_at, status,
                                                inbox_head, inbox_cursor, updated_at)
                              SELECT l.session_id || '.task-' || lpad(to_hex(c), 16, '0'), l.session_id, 'research',
                                     20, '{DOCUMENT}', l.created_at + interval '1 second', {columns}
                              FROM ({leads}) l, generate_series(1, 2) c""")
    return cursor.rowcount


def _approve(conn: psycopg.Connection[object], runs: str, decided: bool) -> None:
    """An approval named ``ap-<run id>`` for each run ``runs`` selects (as ``r``): pending, or approved long ago.

    A pending one is a question one time in four, and expires in a week one time in two.
    """
    one_in = f"CASE WHEN {_NUMBER} % 4 = 0 AND NOT {decided} THEN"
    conn.execute(f"""INSERT INTO approvals (approval_id, session_id, tool_call_id, tool_name, args, agent, status,
                                            kind, question, created_at, decided_at, expires_at)
                     SELECT 'ap-' || r.session_id, r.session_id, 'call_1', 'ship', '{{"order": 7}}', r.agent,
                            CASE WHEN {decided} THEN 'approved' ELSE 'pending' END,
                            {one_in} 'question' ELSE 'tool' END, {one_in} 'Ship by express?' END,
                            r.updated_at - interval '5 minutes',
                            CASE WHEN {decided} THEN r.updated_at - interval '4 minutes' END,
                            CASE WHEN {_NUMBER} % 2 = 0 AND NOT {decided} THEN now() + interval '7 days' END
                     FROM ({runs}) r""")


def _pause(conn: psycopg.Connection[object], runs: str) -> None:
    """Pause the runs ``runs`` selects (as ``r``) on their own pending approval."""
    _approve(conn, runs, decided=False)
    conn.execute(f"""UPDATE runs SET document = document || jsonb_build_object('approval_ids',
                                                                 jsonb_build_array('ap-' || session_id))
                     WHERE session_id IN (SELECT r.session_id FROM ({runs}) r)""")


def _moving(conn: psycopg.Connection[object], crashed: int, retries_due: int) -> None:
    """Running runs saved just now but the ``crashed`` first; retries ahead but the ``retries_due`` first."""
    running, retrying = state_of("running"), state_of("retrying")
    conn.execute(f"""UPDATE runs r SET updated_at = now(), fence = 3, attempts = 1 WHERE {running}
                     AND r.session_id NOT IN (SELECT r.session_id FROM runs r WHERE {running}
                                              ORDER BY r.session_id LIMIT {crashed})""")
    # Sent on by the sweep and still moving: the report of recoveries has nothing to say of them yet.
    conn.execute(f"""UPDATE runs r SET recovery = jsonb_build_object('seq', seq, 'failures', failures)
                     WHERE r.session_id IN (SELECT r.session_id FROM runs r WHERE {running}
                                            ORDER BY r.session_id DESC LIMIT 10)""")
    conn.execute(f"""UPDATE runs r SET failures = 2, retry_since = now() - interval '2 minutes',
                       updated_at = now() - interval '1 minute',
                       next_attempt_at = CASE WHEN r.session_id IN (SELECT r.session_id FROM runs r WHERE {retrying}
                                                                     ORDER BY r.session_id LIMIT {retries_due})
                                              THEN now() - interval '10 seconds'
                                              ELSE now() + make_interval(secs => 600 + {_NUMBER} % 3000) END
                     WHERE {retrying}""")


def _waiting(conn: psycopg.Connection[object], lost_wakeups: int) -> tuple[int, int]:
    """Two children under each waiting lead, which waits on those without a result (``delegated``).

    The ``lost_wakeups`` first leads by id wait on both, settled since; the others on their second, running or,
    under a lead of an even number, paused on an approval (and the lead paused on it). Returns the children made
    and the paused leads.
    """
    ordered = f"SELECT r.* FROM runs r WHERE {state_of('waiting')} ORDER BY r.session_id"
    made = _children(conn, f"{ordered} LIMIT {lost_wakeups}", _SETTLED_AFTER)
    made += _children(conn, f"{ordered} OFFSET {lost_wakeups}", _ONE_WAITED_ON)
    child = "r.session_id || '.task-' || lpad(to_hex({}), 16, '0')"
    conn.execute(f"""UPDATE runs r SET document = document || jsonb_build_object('delegated',
                       CASE WHEN r.session_id IN (SELECT l.session_id FROM ({ordered} LIMIT {lost_wakeups}) l)
                            THEN jsonb_build_object('call_1', {child.format(1)}, 'call_2', {child.format(2)})
                            ELSE jsonb_build_object('call_2', {child.format(2)}) END)
                     WHERE {state_of("waiting")}""")
    paused_children = "SELECT r.* FROM runs r WHERE r.parent_id IS NOT NULL AND r.status = 'awaiting-approval'"
    _pause(conn, paused_children)
    cursor = conn.execute(f"""UPDATE runs l SET status = 'awaiting-approval',
                                document = l.document || jsonb_build_object('approval_ids',
                                                           jsonb_build_array('ap-' || c.session_id))
                              FROM ({paused_children}) c WHERE c.parent_id = l.session_id""")
    paused = cursor.rowcount
    # Each lead's news (``lead_news``): a child settled before its last step, which saw it, but for the lost
    # wake-ups, whose children settled after it.
    conn.execute(f"""INSERT INTO lead_news (lead_id, n, seen)
                     SELECT l.session_id, nextval('lead_news_ids'), 0 FROM ({ordered}) l
                     ON CONFLICT (lead_id) DO UPDATE SET n = EXCLUDED.n""")
    conn.execute(f"""UPDATE lead_news SET seen = CASE WHEN lead_id IN (
                       SELECT l.session_id FROM ({ordered} LIMIT {lost_wakeups}) l) THEN 0 ELSE n END
                     WHERE lead_id IN (SELECT l.session_id FROM ({ordered}) l)""")
    return made, paused


#: Message rows, history entries and events of each run ``fill_mix`` and ``add_cohort`` store.
ROWS_PER_RUN = (20, 10, 20)


def _rows(conn: psycopg.Connection[object], rows: tuple[int, int, int], of: str = "runs") -> None:
    """The message rows, history ring, events and input of the runs ``of`` holds (a table or an aliased query)."""
    messages, history, events = rows
    conn.execute(f"""INSERT INTO run_messages (session_id, slot, seq, message)
                     SELECT session_id, m, m, '{MESSAGE}' FROM {of}, generate_series(0, {messages - 1}) m""")
    conn.execute(f"""INSERT INTO checkpoint_history (session_id, seq, fence, step, status, document, saved_at)
                     SELECT session_id, h, 1, h, 'in-progress', '{DOCUMENT}',
                            updated_at - make_interval(secs => 20 - h)
                     FROM {of}, generate_series(20 - {history} + 1, 20) h""")
    types = "(ARRAY['" + "', '".join(_EVENT_TYPES) + "'])"
    conn.execute(f"""INSERT INTO run_events (session_id, seq, type, slot, data, at)
                     SELECT session_id, e, {types}[e % {len(_EVENT_TYPES)} + 1], e,
                            '{{"name": "ship", "ms": 12, "cost": 0.0012}}', updated_at
                     FROM {of}, generate_series(0, {events - 1}) e""")
    conn.execute(f"""INSERT INTO inbox (session_id, n, messages, created_at)
                     SELECT session_id, 1, '[{{"role": "user", "content": "Charge and ship order 7"}}]', created_at
                     FROM {of} WHERE inbox_head >= 1""")


def add_cohort(
    conn: psycopg.Connection[object], cohort: int, runs: int, rows: tuple[int, int, int] = ROWS_PER_RUN
) -> int:
    """Add retention cohort ``cohort``: ``runs`` finished runs (``old-<cohort>-<n>``) last saved 400 - cohort days ago.

    One in ten has two finished sub-agent runs; each has its rows (``rows``). A pass pruning runs older than
    400 - cohort - 0.5 days prunes it, once the older cohorts are gone. Returns the sub-agent runs made.
    """
    saved = f"now() - make_interval(days => {400 - cohort}, secs => n)"
    prefix = f"old-{cohort:03d}-"
    conn.execute(f"""INSERT INTO runs (session_id, agent, status, seq, inbox_head, inbox_cursor, document,
                                       created_at, updated_at)
                     SELECT '{prefix}' || lpad(n::text, 5, '0'), 'agent-' || (n % 4), 'finished', 20, 1, 1,
                            '{DOCUMENT}', {saved} - interval '1 hour', {saved}
                     FROM generate_series(1, {runs}) n""")
    leads = f"SELECT * FROM runs WHERE session_id LIKE '{prefix}%' AND substr(session_id, 9)::int % 10 = 0"
    made = _children(conn, leads, _SETTLED_BEFORE)
    _rows(conn, rows, f"(SELECT * FROM runs WHERE session_id LIKE '{prefix}%') r")
    return made


def fill_mix(
    conn: psycopg.Connection[object],
    runs: int,
    *,
    crashed: int = 20,
    retries_due: int = 5,
    lost_wakeups: int = 5,
    cohorts: int = 0,
    cohort_runs: int = 50,
    rows: tuple[int, int, int] = ROWS_PER_RUN,
) -> Mix:
    """Insert ``runs`` runs of their own in ``STATE_MIX`` (``fill_states``), made to look as a live table does.

    On top of the states: running runs were saved moments ago (a worker moves them: ``touch_moving`` keeps them
    so) but for the ``crashed`` first, silent since their last save days ago; retrying runs wait for a retry
    time 10 to 60 minutes ahead but for the ``retries_due`` first; a run awaiting approval has its pending
    approval, one finished run in ten an approval decided long ago, and one other in ten two finished sub-agent
    runs; every waiting lead has two (see ``_waiting``: ``lost_wakeups`` of them lost their wake-up). Ten running
    runs are marked as sent on by the sweep and still moving. ``cohorts`` cohorts of ``cohort_runs`` finished runs
    (``add_cohort``) give a retention pass the same work whatever ``runs`` is. Every run has ``rows`` message rows,
    history entries and events, and its input in the inbox; two workers serve each agent.

    The fixed counts hold at any size, so the operations that must be bounded find the same work to do.
    """
    states = fill_states(conn, runs)
    _moving(conn, crashed, retries_due)
    _pause(conn, f"SELECT r.* FROM runs r WHERE {state_of('awaiting-approval')}")
    finished = state_of("finished")
    _approve(conn, f"SELECT r.* FROM runs r WHERE {finished} AND {_NUMBER} % 10 = 5", decided=True)
    children = _children(conn, f"SELECT r.* FROM runs r WHERE {finished} AND {_NUMBER} % 10 = 0", _SETTLED_BEFORE)
    made, paused_leads = _waiting(conn, lost_wakeups)
    _rows(conn, rows)
    conn.execute("""INSERT INTO agent_workers (agent, worker_id, formats)
                    SELECT a, 'worker-' || w, '[1, 2, 3]'
                    FROM unnest(ARRAY['agent-0', 'agent-1', 'agent-2', 'agent-3', 'research']) a,
                         generate_series(1, 2) w""")
    cohort_children = sum(add_cohort(conn, cohort, cohort_runs, rows) for cohort in range(cohorts))
    return Mix(
        states=states,
        children=children + made + cohort_children,
        crashed=min(crashed, states["running"]),
        retries_due=min(retries_due, states["retrying"]),
        lost_wakeups=min(lost_wakeups, states["waiting"]),
        paused_leads=paused_leads,
        cohorts=cohorts,
        cohort_runs=cohort_runs,
        messages=rows[0],
        history=rows[1],
        events=rows[2],
    )


def touch_moving(conn: psycopg.Connection[object]) -> int:
    """Save the runs a worker moves (``fill_mix``'s running runs but the crashed) now again; how many.

    The recovery sweep leaves a run alone for a lease TTL after its last save: timed right after this, it sees the
    running runs as moving, as it would in a live table, and only the crashed ones as silent.
    """
    cursor = conn.execute("""UPDATE runs SET updated_at = now()
                             WHERE status = 'in-progress' AND NOT waiting AND NOT aborted AND last_error IS NULL
                               AND next_attempt_at IS NULL AND updated_at > now() - interval '1 day'""")
    return cursor.rowcount
