"""The "why" at the top of an unfinished run's page: what ``Client.describe`` says it waits on and what moves it.

Turns a ``RunSummary`` into template data, with links to the approvals to decide and the children waited on. It
asks ``describe`` (which scans the broker's queues) only when the page asks it to, and never for a finished run.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from producer.client import Client
from producer.ui import tree, views
from store import errors
from store.records import Approval
from store.summaries import RunSummary, WaitingOn

#: What the page says, per place of a step message (``WaitingOn.step_message``).
_PLACES = {
    "queued": "waits in the broker's queue for a worker",
    "reserved": "was taken by a worker that has not finished it yet",
}


@dataclass
class ApprovalWait:
    """An undecided approval the run waits on, and where a person decides it."""

    approval_id: str
    #: Its page, with the approval's place on it (None: the viewer does not see its run).
    href: str | None = None
    tool_name: str | None = None
    #: The run it belongs to, when that is not the run shown (a lead waits on its children's approvals).
    of_run: str | None = None


@dataclass
class ChildWait:
    """A child run that has not settled, which its lead waits for."""

    run_id: str
    #: Its state as the tree under the run shows it (None: the viewer does not see it).
    state: str | None = None


@dataclass
class Why:
    """Why an unfinished run is not finished, as ``describe`` saw it at ``seen_at``."""

    state: str
    next_action: str
    seen_at: str | None
    lease_holder: str | None = None
    lease_age_ms: int | None = None
    #: Where its step message is, in words (None: none was seen in the broker).
    step_message: str | None = None
    retry_at: str | None = None
    failures: int = 0
    approvals: list[ApprovalWait] = field(default_factory=list)
    children: list[ChildWait] = field(default_factory=list)
    unserved_agent: str | None = None
    #: A person must act before the run moves.
    person: bool = False
    #: The model limit the run waits on before its model call, and why, in words.
    model_limit: str | None = None
    model_limit_reason: str | None = None


#: What a page shows when ``describe`` could not be read (the rest of the page still shows).
UNREADABLE = "What the run waits on cannot be read now (Postgres, Redis or the broker did not answer)."


#: Why a run waits on its model limit, as the page says it.
_LIMIT_REASONS = {
    "slot": "a model slot",
    "requests": "the requests per minute",
    "tokens": "the tokens per minute",
    "cool-down": "the cool-down after a 429/529",
}


def anchor(approval_id: str) -> str:
    """The id of an approval's card on its run's page (a link's fragment)."""
    return f"approval-{approval_id}"


def _states(nodes: list[tree.Node]) -> Iterator[tuple[str, str]]:
    for node in nodes:
        yield node.run.session_id, node.state
        yield from _states(node.children)


def describe(client: Client | None, run_id: str, status: str) -> tuple[RunSummary | None, str | None]:
    """``describe`` of run ``run_id`` whose page shows ``status``, and what to say when it cannot be read.

    Nothing for a finished run (its page has no why), nor without a client: ``describe`` scans the broker's
    queues, which a finished run does not need.
    """
    if status == "finished" or client is None:
        return None, None
    try:
        summary = client.describe(run_id)
    except errors.StorageError:
        return None, UNREADABLE
    if summary is None or summary.state == "finished" or summary.waiting_on is None:
        return None, None
    return summary, None


def why(
    summary: RunSummary,
    run_id: str,
    approvals: Mapping[str, Approval],
    under: tree.Tree,
    sees: Callable[[str | None], bool],
) -> Why:
    """What the page says of ``summary`` (a ``describe`` of the run ``run_id`` shown).

    ``approvals`` holds the approvals it waits on that could be read; one of a run whose agent the viewer does not
    see (``sees``) is named without a link. A child's state comes from ``under``, the tree the page shows.
    """
    waiting = summary.waiting_on or WaitingOn()
    shown: list[ApprovalWait] = []
    for approval_id in waiting.approval_ids:
        approval = approvals.get(approval_id)
        if approval is None or not sees(approval.agent):
            shown.append(ApprovalWait(approval_id))
            continue
        own = approval.session_id == run_id
        place = f"#{anchor(approval_id)}"
        href = place if own else f"/ui/runs/{urllib.parse.quote(approval.session_id)}{place}"
        shown.append(ApprovalWait(approval_id, href, approval.tool_name, None if own else approval.session_id))
    states = dict(_states(under.roots))
    return Why(
        state=summary.state,
        next_action=summary.next_action or "",
        seen_at=views.iso(datetime.now(UTC)),
        lease_holder=waiting.lease_holder,
        lease_age_ms=waiting.lease_age_ms,
        step_message=_PLACES.get(waiting.step_message or ""),
        retry_at=views.iso(waiting.retry_at),
        failures=summary.failures,
        approvals=shown,
        children=[ChildWait(child, states.get(child)) for child in waiting.children],
        unserved_agent=waiting.unserved_agent,
        person=waiting.person,
        model_limit=waiting.model_limit,
        model_limit_reason=_LIMIT_REASONS.get(waiting.model_limit_reason or "", waiting.model_limit_reason),
    )


__all__ = ["UNREADABLE", "ApprovalWait", "ChildWait", "Why", "anchor", "describe", "why"]
