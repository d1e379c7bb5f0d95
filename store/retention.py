"""Retention: finished runs and everything kept under their ids are pruned after an age, in bounded batches.

A run is due when it is finished with nothing left to do (no unread input, no ``on_run_end`` hooks owed), is a
run of its own (a sub-agent's run goes with its lead's, never before it) whose every sub-agent run is settled
too, and its last save is older than the cutoff. Runs of their own in progress, awaiting approval, retrying,
aborted, stopped by a budget or parked are never due: each can still be continued by a send, a resume or a
decision. A sub-agent run is settled when it finished or was stopped (an abort, a budget) with nothing left to
do, or is parked: its lead will not read it again, so it does not hold a finished lead back. A sub-agent run
whose lead is gone (an earlier release's delete could miss one) is due on its own once settled and older than
the cutoff. A batch deletes, in one statement, the due runs with their sub-agent runs, history, message rows,
events, inbox, send idempotency keys and approvals.

Webhook delivery ids, GitHub body hashes and claimed schedule ticks are not run state: they are what stops a
redelivery, a replayed body or a second beat from starting a run again, so they outlive their runs with an age
of their own (``Retention``). A delivery id stays while its run exists, whatever its age: without it a
redelivery would queue its body again as new input. Ages are measured against Postgres ``now()``. This module
must not touch Redis (its keys expire by themselves) nor decide when to run: the beat's task and
``lousho prune`` do.

Stays whole: each prune statement sits beside the rule that says which rows are due; they change together.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import Engine, TextClause, text

from store import errors, runs
from store.database import Transaction

__all__ = [
    "BATCH",
    "KEYS_MIN_AGE",
    "KEYS_RUNS_FACTOR",
    "SWEEP_BATCHES",
    "SWEEP_BUDGET_S",
    "Batch",
    "PruneResult",
    "Retention",
    "batch_plans",
    "count_due",
    "keys_age",
    "parse_age",
    "prune",
    "prune_keys",
    "prune_runs",
    "sweep",
]

#: Runs of their own (each with its sub-agent runs) a batch deletes at most (and as many sub-agent runs whose lead
#: is gone), and rows of each kind of key.
BATCH = 500
#: Batches one pass of the beat's sweep runs at most, so a backlog of millions is worked off over many passes.
SWEEP_BATCHES = 10
#: Seconds after which a pass of the sweep starts no further batch.
SWEEP_BUDGET_S = 5.0
#: The age of keys when only the runs' age is set: this many times the runs' age, and at least ``KEYS_MIN_AGE``.
KEYS_RUNS_FACTOR = 4
KEYS_MIN_AGE = timedelta(days=30)


def _settled(t: str) -> str:
    """SQL true for a sub-agent run (aliased ``t``) that will not move again by itself.

    Finished, or stopped by an abort or a budget, with nothing left to do (no unread input, no hooks owed: the
    has-work rule) and no children pending; or parked. A person could still resume it, but its lead will not
    read it again: once the lead itself is done, or gone, it is not a reason to keep the lead.
    """
    return (
        f"((({t}.status = 'finished' OR {t}.aborted) AND NOT {t}.waiting AND NOT {runs.has_work_sql(t)})"
        f" OR NOT {runs.not_parked_sql(t)})"
    )


_SETTLED_C = _settled("c")
# Only the columns the rule reads are carried down the tree.
_RULE_COLUMNS = ", ".join(
    f"c.{column}"
    for column in (
        "session_id",
        "status",
        "waiting",
        "aborted",
        "inbox_head",
        "inbox_cursor",
        "abort_requested",
        "end_due",
        "last_error",
    )
)
# No run under ``r`` (its children, theirs, ...) that is not settled.
_ALL_BELOW_SETTLED = f"""NOT EXISTS (
    WITH RECURSIVE below AS (
      SELECT {_RULE_COLUMNS} FROM runs c WHERE c.parent_id = r.session_id
      UNION
      SELECT c.* FROM below b CROSS JOIN LATERAL (
        SELECT {_RULE_COLUMNS} FROM runs c WHERE c.parent_id = b.session_id OFFSET 0) c
    )
    SELECT 1 FROM below c WHERE NOT ({_SETTLED_C}))"""
# Due runs of their own, oldest first: the predicate of ``runs_retention_idx`` (migration 0011), then the rest.
_DUE_LEADS = f"""
SELECT r.session_id FROM runs r
WHERE r.status = 'finished' AND r.parent_id IS NULL AND r.updated_at < now() - make_interval(secs => :age)
  AND NOT r.waiting AND NOT {runs.has_work_sql("r")}
  AND {_ALL_BELOW_SETTLED}
ORDER BY r.updated_at"""
# Due sub-agent runs whose lead is gone (deleted before deletes took every child along): settled, each pruned with
# the runs under it. Read from ``runs_child_age_idx`` (migration 0021) when few sub-agent runs are older than the
# cutoff, as in a table kept pruned, so a pass does not read every sub-agent run; from ``runs_parent_idx`` in its
# order when most are (a backlog), so a batch stops at its limit. ``OFFSET 0`` keeps the check of the lead a lookup
# per candidate.
_DUE_ORPHANS = f"""
SELECT r.session_id FROM runs r
WHERE r.parent_id IS NOT NULL AND r.updated_at < now() - make_interval(secs => :age)
  AND {_settled("r")}
  AND NOT EXISTS (SELECT 1 FROM runs l WHERE l.session_id = r.parent_id OFFSET 0)
  AND {_ALL_BELOW_SETTLED}
ORDER BY r.parent_id"""
# The due runs' trees: each lead or orphan (locked, so a concurrent send or claim waits or is skipped) and its
# descendants. Down a tree, ``LATERAL (... OFFSET 0)`` keeps each level a lookup of ``runs_parent_idx`` per run:
# joined whole, the planner may read the whole index at every level instead. UNION, not UNION ALL: a loop of
# parent ids ends.
_TREE = """
roots AS (SELECT session_id FROM leads UNION ALL SELECT session_id FROM orphans),
tree AS (
  SELECT session_id FROM roots
  UNION
  SELECT c.session_id FROM tree t CROSS JOIN LATERAL (
    SELECT c.session_id FROM runs c WHERE c.parent_id = t.session_id OFFSET 0) c
)"""


def _gone(name: str, table: str) -> str:
    """A CTE deleting the pruned runs' rows of ``table`` (an index on ``session_id`` first serves each)."""
    return f"{name} AS (DELETE FROM {table} WHERE session_id = ANY(ARRAY(SELECT session_id FROM gone)) RETURNING 1)"


# One statement per batch: ``= ANY(ARRAY(...))`` makes each delete an index scan on the pruned ids, whatever
# the planner guesses of the CTEs' sizes.
_PRUNE_RUNS = text(f"""
WITH RECURSIVE leads AS ({_DUE_LEADS}
  LIMIT :limit FOR UPDATE OF r SKIP LOCKED
),
orphans AS ({_DUE_ORPHANS}
  LIMIT :limit FOR UPDATE OF r SKIP LOCKED
),{_TREE},
gone AS (DELETE FROM runs WHERE session_id = ANY(ARRAY(SELECT session_id FROM tree)) RETURNING session_id),
{_gone("history_gone", "checkpoint_history")},
{_gone("messages_gone", "run_messages")},
{_gone("events_gone", "run_events")},
{_gone("inputs_gone", "inbox")},
{_gone("sends_gone", "sends")},
{_gone("approvals_gone", "approvals")}
SELECT (SELECT count(*) FROM leads) AS leads, (SELECT count(*) FROM orphans) AS orphans,
  (SELECT count(*) FROM gone) AS runs,
  (SELECT count(*) FROM history_gone) AS history, (SELECT count(*) FROM messages_gone) AS messages,
  (SELECT count(*) FROM events_gone) AS events, (SELECT count(*) FROM inputs_gone) AS inputs,
  (SELECT count(*) FROM sends_gone) AS sends, (SELECT count(*) FROM approvals_gone) AS approvals
""")
# Keys by age, oldest first, each kind from its index (migration 0011). A delivery id whose run still exists is
# kept: a redelivery would otherwise be taken for a new one and queue its body again on that run. ``OFFSET 0``
# keeps that check a lookup per delivery read: as a join, the planner would read both tables whole and sort.
_DUE_DELIVERIES = """
SELECT d.ctid FROM deliveries d WHERE d.received_at < now() - make_interval(secs => :age)
  AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.session_id = d.session_id OFFSET 0)
ORDER BY d.received_at"""
_DUE_BODIES = """
SELECT b.ctid FROM delivery_bodies b WHERE b.received_at < now() - make_interval(secs => :age) ORDER BY b.received_at"""
_DUE_TICKS = """
SELECT f.ctid FROM schedule_fires f WHERE f.claimed_at < now() - make_interval(secs => :age) ORDER BY f.claimed_at"""


def _delete_keys(name: str, table: str, due: str) -> str:
    """A CTE deleting up to ``:limit`` due rows of ``table`` (locked first; rows another pass holds are skipped)."""
    return (
        f"{name} AS (DELETE FROM {table} WHERE ctid = ANY(ARRAY({due}\n"
        "  LIMIT :limit FOR UPDATE SKIP LOCKED)) RETURNING 1)"
    )


_PRUNE_KEYS = text(f"""
WITH {_delete_keys("deliveries_gone", "deliveries", _DUE_DELIVERIES)},
{_delete_keys("bodies_gone", "delivery_bodies", _DUE_BODIES)},
{_delete_keys("ticks_gone", "schedule_fires", _DUE_TICKS)}
SELECT (SELECT count(*) FROM deliveries_gone) AS deliveries, (SELECT count(*) FROM bodies_gone) AS bodies,
  (SELECT count(*) FROM ticks_gone) AS ticks
""")


def _unordered(selection: str) -> str:
    """A selection without its ORDER BY, for counting."""
    return selection.rsplit("ORDER BY", 1)[0]


_COUNT_RUNS = text(f"""
WITH RECURSIVE leads AS ({_unordered(_DUE_LEADS)}), orphans AS ({_unordered(_DUE_ORPHANS)}),{_TREE}
SELECT count(*) AS runs FROM tree
""")
_COUNT_KEYS = text(f"""
SELECT (SELECT count(*) FROM ({_unordered(_DUE_DELIVERIES)}) d) AS deliveries,
  (SELECT count(*) FROM ({_unordered(_DUE_BODIES)}) b) AS bodies,
  (SELECT count(*) FROM ({_unordered(_DUE_TICKS)}) f) AS ticks
""")
# The planner prices the check of each candidate's sub-agent runs as if every candidate had a deep tree, and a
# price that high has Postgres compile the statement first (JIT): some 300 ms of CPU for a batch that takes 50.
_NO_JIT = text("SET LOCAL jit = off")
#: The selections of the batches, by what they select (for ``batch_plans``).
_SELECTIONS = {
    "runs": _DUE_LEADS,
    "orphans": _DUE_ORPHANS,
    "deliveries": _DUE_DELIVERIES,
    "bodies": _DUE_BODIES,
    "ticks": _DUE_TICKS,
}
_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}


class PruneResult(BaseModel):
    """What was pruned (or, from ``count_due``, what is due): rows per kind.

    ``runs`` counts sub-agent runs too. ``more`` is true when a batch was full: more may be due at once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    runs: int = 0
    history: int = 0
    messages: int = 0
    events: int = 0
    #: Inbox rows: input sent to the runs.
    inputs: int = 0
    #: Idempotency keys of sends (kept with their run, unlike delivery ids).
    sends: int = 0
    approvals: int = 0
    deliveries: int = 0
    #: GitHub body hashes.
    bodies: int = 0
    #: Claimed schedule ticks.
    ticks: int = 0
    more: bool = False

    def __add__(self, other: PruneResult) -> PruneResult:
        counts = {name: getattr(self, name) + getattr(other, name) for name in _COUNTS}
        return PruneResult.model_validate({**counts, "more": self.more or other.more})


_COUNTS = tuple(name for name in PruneResult.model_fields if name != "more")


class Retention(BaseModel):
    """How long finished runs, and the keys that outlive them, are kept; ``runs`` None keeps everything."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    runs: timedelta | None = None
    keys: timedelta | None = None

    @classmethod
    def of(cls, older_than: timedelta, keys_older_than: timedelta | None = None) -> Retention:
        """Runs kept ``older_than``, keys ``keys_older_than`` (see ``keys_age``).

        Raises:
            ConfigurationError: an age that is not positive, or keys kept less long than runs.
        """
        return cls(runs=older_than, keys=keys_age(older_than, keys_older_than))

    @classmethod
    def from_days(cls, runs_days: float | None, keys_days: float | None = None) -> Retention:
        """The policy of ``LOUSHO_RETENTION_DAYS`` and ``LOUSHO_RETENTION_KEYS_DAYS`` (see ``of``).

        With no runs' age everything is kept, keys included: a key is only ever pruned after its run.

        Raises:
            ConfigurationError: a number of days that is not positive, or keys kept less long than runs.
        """
        if runs_days is None:
            return cls()
        try:
            return cls.of(timedelta(days=runs_days), None if keys_days is None else timedelta(days=keys_days))
        except errors.ConfigurationError as exc:
            variable = "LOUSHO_RETENTION_DAYS" if runs_days <= 0 else "LOUSHO_RETENTION_KEYS_DAYS"
            raise errors.ConfigurationError(f"{variable}: {exc}", variable=variable) from None


def keys_age(older_than: timedelta, keys_older_than: timedelta | None = None) -> timedelta:
    """How long keys are kept beside runs kept ``older_than``.

    ``keys_older_than`` when given, else ``KEYS_RUNS_FACTOR`` times ``older_than`` and at least ``KEYS_MIN_AGE``.

    Raises:
        ConfigurationError: an age that is not positive, or keys kept less long than runs (a pruned run's
            delivery id must still stop a redelivery).
    """
    if older_than <= timedelta(0) or (keys_older_than is not None and keys_older_than <= timedelta(0)):
        raise errors.ConfigurationError("an age must be more than 0")
    if keys_older_than is None:
        return max(older_than * KEYS_RUNS_FACTOR, KEYS_MIN_AGE)
    if keys_older_than < older_than:
        raise errors.ConfigurationError(
            "keys must be kept at least as long as runs (they stop redeliveries of pruned runs)",
            field="keys_older_than",
        )
    return keys_older_than


def parse_age(value: str) -> timedelta:
    """An age written as a number and a unit, ``s``, ``m``, ``h``, ``d`` or ``w`` (``30d``, ``12h``, ``1w2d``).

    Raises:
        ConfigurationError: not such an age, or zero.
    """
    spelled = value.strip().lower()
    parts = list(_AGE.finditer(spelled))
    if not parts or "".join(p.group(0) for p in parts) != spelled.replace(" ", ""):
        raise errors.ConfigurationError(f"not an age: {value[:40]!r} (write it like 30d, 12h, 90m or 1w)")
    age = timedelta(seconds=sum(float(p.group(1)) * _UNITS[p.group(2)] for p in parts))
    if age <= timedelta(0):
        raise errors.ConfigurationError("an age must be more than 0")
    return age


def _check(older_than: timedelta, limit: int) -> dict[str, Any]:
    if older_than <= timedelta(0):
        raise errors.ConfigurationError("an age must be more than 0")
    if limit < 1:
        raise errors.ConfigurationError("a batch holds at least 1 row", field="limit")
    return {"age": older_than.total_seconds(), "limit": limit}


#: ``prune_runs`` or ``prune_keys``: one batch of ``(engine, older_than, limit)``.
Batch = Callable[[Engine, timedelta, int], PruneResult]


def _run(engine: Engine, statement: TextClause, params: dict[str, Any]) -> dict[str, int]:
    with Transaction(engine) as conn:
        conn.execute(_NO_JIT)
        row = conn.execute(statement, params).one()
    return {name: int(value) for name, value in row._mapping.items()}


def prune_runs(engine: Engine, older_than: timedelta, limit: int = BATCH) -> PruneResult:
    """Delete one batch: up to ``limit`` due runs of their own last saved over ``older_than`` ago, oldest first.

    Each goes with its sub-agent runs and every row kept under their ids (history, message rows, events, inbox,
    send keys, approvals), in one transaction. Runs a concurrent step, send or pass holds are skipped.

    Raises:
        ConfigurationError: ``older_than`` is not positive or ``limit`` below 1.
        StorageError: the database failed; nothing of the batch was deleted.
    """
    counts = _run(engine, _PRUNE_RUNS, _check(older_than, limit))
    roots = max(counts.pop("leads"), counts.pop("orphans"))
    return PruneResult.model_validate({**counts, "more": roots >= limit})


def prune_keys(engine: Engine, older_than: timedelta, limit: int = BATCH) -> PruneResult:
    """Delete up to ``limit`` of each kind of key received over ``older_than`` ago (delivery ids of live runs stay).

    Raises:
        ConfigurationError: ``older_than`` is not positive or ``limit`` below 1.
        StorageError: the database failed; nothing of the batch was deleted.
    """
    counts = _run(engine, _PRUNE_KEYS, _check(older_than, limit))
    return PruneResult.model_validate({**counts, "more": max(counts.values()) >= limit})


def prune(
    engine: Engine, older_than: timedelta, limit: int = BATCH, *, keys_older_than: timedelta | None = None
) -> PruneResult:
    """One batch of runs (``prune_runs``) and one of keys (``prune_keys``).

    Keys are pruned at ``keys_age(older_than, keys_older_than)``.

    Raises:
        ConfigurationError: an age is not positive or ``limit`` below 1.
        StorageError: the database failed; batches done before stay done.
    """
    return prune_runs(engine, older_than, limit) + prune_keys(engine, keys_age(older_than, keys_older_than), limit)


def sweep(
    engine: Engine,
    retention: Retention,
    limit: int = BATCH,
    *,
    batches: int = SWEEP_BATCHES,
    budget_s: float = SWEEP_BUDGET_S,
) -> PruneResult:
    """One pass of the retention sweep: batches while they come back full, at most ``batches`` or ``budget_s``.

    Does nothing when ``retention`` keeps everything. Runs first, then keys (at least one batch of keys, whatever
    the runs took). ``more`` in the result: the pass stopped with work left.

    Raises:
        ConfigurationError: ``limit`` or ``batches`` below 1.
        StorageError: the database failed; batches done before stay done.
    """
    if batches < 1:
        raise errors.ConfigurationError("a pass runs at least 1 batch", field="batches")
    total, left = PruneResult(), False
    started = time.monotonic()
    for age, prune_batch in ((retention.runs, prune_runs), (retention.keys, prune_keys)):
        if age is None:
            continue
        for _ in range(batches):
            done = prune_batch(engine, age, limit)
            total += done
            if not done.more or time.monotonic() - started > budget_s:
                break
        left = left or done.more
    return total.model_copy(update={"more": left})


def count_due(engine: Engine, older_than: timedelta, *, keys_older_than: timedelta | None = None) -> PruneResult:
    """What ``prune`` batches would delete now, counted without deleting: runs (with sub-agents) and keys.

    Raises:
        ConfigurationError: an age is not positive.
        StorageError: the database failed.
    """
    due_runs = _run(engine, _COUNT_RUNS, _check(older_than, 1))
    due_keys = _run(engine, _COUNT_KEYS, _check(keys_age(older_than, keys_older_than), 1))
    return PruneResult.model_validate({**due_runs, **due_keys})


def batch_plans(
    engine: Engine, older_than: timedelta, *, keys_older_than: timedelta | None = None, limit: int = BATCH
) -> dict[str, list[str]]:
    """Postgres's plan (``EXPLAIN`` lines) of each batch's selection of rows, by what it selects.

    For checking that every batch reads an index, not a whole table.

    Raises:
        ConfigurationError: an age is not positive or ``limit`` below 1.
        StorageError: the database failed.
    """
    ages = {"runs": older_than, "keys": keys_age(older_than, keys_older_than)}
    plans = {}
    with Transaction(engine) as conn:
        conn.execute(_NO_JIT)
        for name, selection in _SELECTIONS.items():
            params = _check(ages["runs" if name in ("runs", "orphans") else "keys"], limit)
            explain = text(f"EXPLAIN {selection}\n  LIMIT :limit FOR UPDATE SKIP LOCKED")
            plans[name] = [str(line) for line in conn.execute(explain, params).scalars()]
    return plans
