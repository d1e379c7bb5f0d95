"""The SQL of a run's durable events (table ``run_events``): the save's insert, the reader's pages, the delete.

The records and their encoding are ``store.events`` (pure); this module only holds the statements the Postgres
checkpoint store runs.
"""

from __future__ import annotations

from sqlalchemy import text

#: Adds the save's events (``:events``, from ``encode``) after the run's last one. Appended to a save's CTEs
#: after ``saved``, which must return ``events_next`` as raised by ``:n_events``.
SAVE_EVENTS = """,
events AS (
  INSERT INTO run_events (session_id, seq, type, slot, data, at)
  SELECT :sid, s.events_next - :n_events + e.n - 1, e.v ->> 0, CAST(e.v ->> 1 AS int), e.v -> 2, s.updated_at
  FROM saved s, jsonb_array_elements(CAST(:events AS jsonb)) WITH ORDINALITY AS e(v, n)
)"""

#: A page of a run's events after ``:after``, with the transcript rows they point at.
READ = text("""
SELECT e.seq, e.type, e.at, e.data, m.message FROM run_events e
LEFT JOIN run_messages m ON m.session_id = e.session_id AND m.slot = e.slot
WHERE e.session_id = :sid AND e.seq > :after ORDER BY e.seq LIMIT :limit
""")
#: The seq of the run's latest ``run.start`` (where a consumer without a position begins).
LATEST_START = text("SELECT max(seq) FROM run_events WHERE session_id = :sid AND type = 'run.start'")
#: The seq of the ``run.start`` that merged input ``:n`` (the first one whose merged range reaches it).
INPUT_START = text(
    "SELECT min(seq) FROM run_events WHERE session_id = :sid AND type = 'run.start'"
    " AND CAST(data ->> 'input_number' AS bigint) >= :n"
)
#: Deletes the events of a run (with the run).
DELETE = text("DELETE FROM run_events WHERE session_id = :sid")

__all__ = ["DELETE", "INPUT_START", "LATEST_START", "READ", "SAVE_EVENTS"]
