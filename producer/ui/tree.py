"""A run's sub-agent runs as a tree, and which child run each of its ``task`` calls started.

The runs under a run are read from the store's listing (a child's id is its lead's id, ``.task-`` and a suffix, so
one search finds every level) and nested by their stored lead; a call's child comes from the run's
``subagent.start`` events and its checkpoint's open delegations. It reads no transcript and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from producer.ui import drawing
from store import interfaces, listing, records
from store.events import Event
from store.records import Checkpoint, ListedRun

#: Most runs a tree shows (the oldest first); the page says when there are more.
MAX_RUNS = 500
#: Pages of the listing read at most to find them (other runs whose id holds the same text are skipped).
_MAX_PAGES = 4


@dataclass
class Node:
    """A run under the run shown, with the runs under it (oldest first)."""

    run: ListedRun
    state: str
    #: How long a finished run took, from its creation to its last save.
    took: str | None = None
    children: list[Node] = field(default_factory=list)


@dataclass
class Tree:
    """The runs under a run: its children at the top, each with theirs; ``more`` when some were left out."""

    roots: list[Node]
    size: int
    more: bool = False


def _under(store: interfaces.ProducerStore, run_id: str, agents: frozenset[str] | None) -> tuple[list[ListedRun], bool]:
    """The runs whose id puts them under ``run_id`` (the newest ``MAX_RUNS``, oldest first); are there more."""
    prefix = run_id + records.CHILD_MARK
    found: list[ListedRun] = []
    cursor = None
    for _ in range(_MAX_PAGES):
        page = store.list_runs(agents=agents, id_contains=prefix, limit=listing.MAX_LIMIT, cursor=cursor)
        found.extend(run for run in page.items if run.session_id.startswith(prefix))
        cursor = page.next_cursor
        if cursor is None or len(found) >= MAX_RUNS:
            break
    more = cursor is not None or len(found) > MAX_RUNS
    kept = sorted(found[:MAX_RUNS], key=lambda run: (run.created_at, run.session_id))
    return kept, more


def tree(
    store: interfaces.ProducerStore, run_id: str, agents: frozenset[str] | None, state_of: Callable[[ListedRun], str]
) -> Tree:
    """The runs under ``run_id`` that a viewer of ``agents`` sees (None: every agent), nested by lead.

    A run whose lead the viewer does not see hangs from its nearest seen lead (or from the top). ``state_of``
    says what a page calls a listed run's state.
    """
    found, more = _under(store, run_id, agents)
    nodes = {
        run.session_id: Node(
            run,
            state_of(run),
            drawing.duration_text((run.updated_at - run.created_at).total_seconds())
            if run.state == "finished"
            else None,
        )
        for run in found
    }
    roots: list[Node] = []
    for run in found:
        lead = run.parent_id or records.lead_of(run.session_id)
        while lead is not None and lead != run_id and lead not in nodes:
            lead = records.lead_of(lead)
        (nodes[lead].children if lead is not None and lead in nodes else roots).append(nodes[run.session_id])
    return Tree(roots, len(found), more)


def children_of_calls(checkpoint: Checkpoint, run_events: Sequence[Event]) -> dict[str, str]:
    """Tool call id -> the child run its ``task`` call started, from the run's events and open delegations."""
    found = {
        str(event.data["tool_call_id"]): str(event.data["child_run_id"])
        for event in run_events
        if event.type == "subagent.start" and isinstance(event.data.get("child_run_id"), str)
    }
    for call_id, child in (checkpoint.delegated or {}).items():
        found.setdefault(call_id, child)
    return found


def version(found: Tree) -> str:
    """What changes when a run of the tree appears or moves (part of a run page's live version)."""

    def walk(nodes: list[Node]) -> list[str]:
        return [
            f"{n.run.session_id}={n.state}" + ("(" + ",".join(walk(n.children)) + ")" if n.children else "")
            for n in nodes
        ]

    return ",".join(walk(found.roots))


__all__ = ["MAX_RUNS", "Node", "Tree", "children_of_calls", "tree", "version"]
