"""Why a run is not finished: what it waits on, what moves it next, and whether anything does (invariant I19).

The rule is defined from what can be observed, apart from the recovery sweep's own queries: an **owner** is a live
lease; a **timer** is a due time still ahead (``next_attempt_at``); a **waiter** is an undecided approval, a child
that has not settled, or a step message for the run in a broker queue or taken by a worker. Parked, aborted and
budget-stopped runs wait for a person by design. "The sweep will send it" is no explanation: a run only the sweep
can move is unexplained until the sweep sends it, and I19 is broken once that lasts past a grace (a lease TTL plus
a sweep interval). Pure: ``store.observed`` reads the facts, ``describe`` and ``lousho doctor`` use the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from store.records import LastError, ListedState
from store.summaries import MessagePlace, WaitingOn

#: Most characters of a last error's message quoted in a next action.
_ERROR_CHARS = 160
#: Most ids named in a next action (the rest are counted).
_NAMED = 3


@dataclass(frozen=True)
class Observed:
    """What could be seen of one run at one moment, in Postgres (``now`` is its clock) and Redis."""

    session_id: str
    agent: str
    state: ListedState
    now: datetime
    #: The latest thing that gave the run something to do: its last save, input sent, a decision, a child's save,
    #: its retry time. A run that nothing moves is overdue a grace after it.
    since: datetime
    last_error: LastError | None = None
    next_attempt_at: datetime | None = None
    #: Undecided approvals it pauses on: its own, and for a lead its children's.
    approval_ids: tuple[str, ...] = ()
    #: Its children that have not settled.
    children: tuple[str, ...] = ()
    lease_holder: str | None = None
    lease_age_ms: int | None = None
    step_message: MessagePlace | None = None
    #: A live worker serves the run's agent (it registered within the registration window).
    agent_served: bool = True
    #: The model limit the run waits on: (limit key, reason: ``slot``, ``requests``, ``tokens``, ``cool-down``).
    model_limit: tuple[str, str] | None = None


@dataclass(frozen=True)
class Explanation:
    """What the run waits on, what moves it next (in words), and whether an owner, a timer or a waiter does."""

    waiting_on: WaitingOn
    next_action: str
    #: An owner, a timer or a waiter was seen (or the run is finished, or waits for a person by design).
    explained: bool
    #: Unexplained for longer than the grace: invariant I19 is broken for this run.
    overdue: bool = False


#: States in which a person must act before the run moves, and what they do.
_PERSON = {
    "aborted": "a person: it was aborted; send to it again, or resume it",
    "budget-exceeded": "a person: it stopped at a limit of its budget; resume it with raised limits"
    " (resume(id, limits=Limits(...)), lousho resume ID --max-cost N)",
}


def explain(observed: Observed, grace: timedelta) -> Explanation:
    """The explanation of ``observed``; ``grace`` is how long a run may go unexplained (a lease TTL plus a sweep)."""
    o = observed
    retry_at = o.next_attempt_at if o.next_attempt_at is not None and o.next_attempt_at > o.now else None
    waiting = WaitingOn(
        lease_holder=o.lease_holder,
        lease_age_ms=o.lease_age_ms,
        step_message=o.step_message,
        retry_at=retry_at,
        approval_ids=list(o.approval_ids),
        children=list(o.children),
        unserved_agent=None if o.agent_served or o.state == "finished" else o.agent,
        person=o.state in ("parked", "aborted", "budget-exceeded") or bool(o.approval_ids),
        model_limit=o.model_limit[0] if o.model_limit is not None else None,
        model_limit_reason=o.model_limit[1] if o.model_limit is not None else None,
    )
    if o.state == "finished":
        return Explanation(WaitingOn(), "nothing: it is finished; a new send continues it", True)
    if o.state == "parked":
        error = o.last_error
        why = f"{error.code}: {error.message[:_ERROR_CHARS]}" if error is not None else "an error"
        return Explanation(waiting, f"a person: it stopped on {why}; fix the cause, then resume it or send again", True)
    if o.state in _PERSON:
        return Explanation(waiting, _PERSON[o.state], True)
    if o.approval_ids:
        whose = "of its children " if o.state == "waiting" else ""
        return Explanation(
            waiting, f"a person: decide the approval(s) {whose}{_names(o.approval_ids)} (lousho approvals list)", True
        )
    if o.children:
        return Explanation(waiting, f"its sub-agents' runs {_names(o.children)}: the last to settle wakes it", True)
    if retry_at is not None:
        return Explanation(waiting, f"its next attempt at {_at(retry_at)} (resume() tries at once)", True)
    if o.lease_holder is not None:
        return Explanation(waiting, f"the worker {o.lease_holder} runs its step now", True)
    if o.model_limit is not None:
        return Explanation(
            waiting, _LIMIT_WAITS.get(o.model_limit[1], _LIMIT_WAITS["slot"]).format(key=o.model_limit[0]), True
        )
    if o.step_message is not None:
        action = f"a worker takes its step message ({o.step_message})"
        if not o.agent_served:
            action += (
                f"; no live worker serves agent {o.agent!r} now: start one with it in LOUSHO_AGENTS"
                " (the run waits for it, and is parked with LOUSHO_AGENT_NOT_FOUND if none ever comes)"
            )
        return Explanation(waiting, action, True)
    due = o.since + grace
    if o.now <= due:
        return Explanation(
            waiting,
            f"the recovery sweep, which sends it a step by {_at(due)} if nothing else does"
            " (nothing holds it, no step message was seen)",
            False,
        )
    return Explanation(
        waiting,
        f"nothing seen moves it: no lease, no step message, no timer, no waiter since"
        f" {_at(o.since)}; the recovery sweep should have sent it a step by {_at(due)}"
        " (is a beat running?); lousho resume ID sends one now",
        False,
        overdue=True,
    )


#: What moves a run waiting on a model limit, by reason.
_LIMIT_WAITS = {
    "slot": "waiting on a model slot of limit {key!r}: the step that frees one wakes it (the sweep, if its holder"
    " died)",
    "requests": "waiting on the requests per minute of limit {key!r}: its step comes back when the minute allows",
    "tokens": "waiting on the tokens per minute of limit {key!r}: its step comes back when the minute allows",
    "cool-down": "waiting out the cool-down of limit {key!r} (the provider answered 429/529 with Retry-After):"
    " its step comes back when it ends",
}


def _names(ids: tuple[str, ...]) -> str:
    named = ", ".join(ids[:_NAMED])
    return named if len(ids) <= _NAMED else f"{named} and {len(ids) - _NAMED} more"


def _at(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


__all__ = ["Explanation", "Observed", "explain"]
