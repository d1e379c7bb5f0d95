"""The ``task`` calls of a tool batch: child runs started with the lead's save, their results, background tasks.

Children are started in the transaction of the lead's fenced save; a child's result is taken once it settled.
"""

from __future__ import annotations

from store import errors, records
from store.records import EventDraft, ToolCall
from worker import batch_state, machine, subagents
from worker.agents import (
    AGENT_AWAIT,
    AGENT_CANCEL,
    AGENT_STATUS,
    TASK,
    Agent,
)


def delegate(
    batch: batch_state.Batch, agent: Agent, calls: list[ToolCall], undecided: list[str]
) -> list[tuple[str, str | None]]:
    """Record the result of each delegated call whose child settled, then start children for new ``task`` calls.

    At most ``tool_concurrency`` children run at once; the other calls wait for a free place (a settling child
    wakes the run). The run stays paused while a child waits on an approval or ``undecided`` (its own) are not
    decided yet. Children are started under the run's fence (``StepStore.start_children``): a batch that lost its
    lease, or whose run was deleted meanwhile, starts none. Returns the children to send a step (the new ones),
    once the save that names them is durable.
    """
    if not calls or batch.fenced:
        return []
    lead = batch.checkpoint.session_id
    # Only the run's own children count: a child named by another run (a fork of a release that copied its
    # source's) is not waited on, and its call gets a child of this run's.
    own = {
        call_id: child
        for call_id, child in (batch.checkpoint.delegated or {}).items()
        if records.lead_of(child) == lead
    }
    delegated = dict(own)
    paused_on = settle_delegated(batch, delegated, {call.id: call for call in calls})
    new: list[tuple[ToolCall, str]] = []
    events: list[EventDraft] = []
    sent: list[tuple[str, str | None]] = []
    for call in calls:
        if call.id in delegated or call.id in own:
            continue
        if call.name != TASK:
            follow_background(batch, call, delegated, sent)
            continue
        background = bool(call.args.get("background"))
        if len(delegated) >= agent.tool_concurrency and not background:
            continue  # started when a child settles
        started = subagents.child_id(lead, batch.checkpoint.step, call.id)
        if records.depth_of(lead) + 1 > agent.max_subagent_depth:
            batch.settle(
                machine.tool_error(
                    call,
                    "denied",
                    "SubagentDepthExceeded",
                    f"sub-agents may nest {agent.max_subagent_depth} level(s) deep",
                )
            )
        elif started is None:
            batch.settle(
                machine.tool_error(
                    call, "execution", "SubagentIdTooLong", "this run's id is too long to name a sub-agent's run"
                )
            )
        elif background:
            if _start(batch, [(call, started)]):
                batch.settle_background(
                    call,
                    machine.tool_message(call, {"task_id": started, "status": "running", "agent": call.args["agent"]}),
                    started,
                    subagents.started(call, started),
                )
                sent.append((started, str(call.args["agent"])))
        else:
            delegated[call.id] = started
            new.append((call, started))
    started_now = _start(batch, new)
    for call, child in new:
        if child in started_now:
            events.append(subagents.started(call, child))
        else:
            del delegated[call.id]
    batch.delegate(delegated, events, undecided + paused_on)
    return sent + [(child, str(call.args["agent"])) for call, child in new if child in started_now]


def _start(batch: batch_state.Batch, children: list[tuple[ToolCall, str]]) -> set[str]:
    """Create the child runs of ``children`` (``task`` calls and the ids of their runs) under the batch's fence.

    Returns the ids started (or found started by an earlier run of this step). A call whose id another run took
    gets an error result; a batch fenced out starts none (and its lease is lost).
    """
    if not children or batch.fenced:
        return set()
    try:
        refused = set(
            batch.deps.store.start_children(
                batch.checkpoint.session_id,
                batch.checkpoint.agent,
                [(child, str(call.args["agent"]), str(call.args["prompt"])) for call, child in children],
                fence=batch.checkpoint.fence,
            )
        )
    except errors.FencedOutError:
        batch.fenced = True
        batch.lease.lost.set()
        return set()
    for call, child in children:
        if child in refused:
            batch.settle(
                machine.tool_error(
                    call,
                    "execution",
                    "SubagentIdTaken",
                    f"a run named {child!r} exists and is not this run's sub-agent; the task did not start",
                )
            )
    return {child for _, child in children if child not in refused}


def settle_delegated(batch: batch_state.Batch, delegated: dict[str, str], calls: dict[str, ToolCall]) -> list[str]:
    """Record the results of the delegated calls whose child settled (dropping them from ``delegated``).

    Returns the approvals children wait on.
    """
    paused_on: list[str] = []
    for call_id, child in list(delegated.items()):
        if call_id not in calls:
            continue
        state = batch.deps.store.load(child)
        result = subagents.result_of(calls[call_id], state)
        if result is not None:
            batch.settle_child(calls[call_id], result, child, state)
            del delegated[call_id]
        else:
            batch.seen[child] = subagents.state_of(state)
            if batch.seen[child] == "awaiting-approval" and state is not None:
                paused_on.extend(state.approval_ids)
    return paused_on


def watched_children(batch: batch_state.Batch) -> tuple[tuple[str, str], ...]:
    """The children the run waits on once the step ends, with the state the step found each in.

    A child started or awaited by this step was not read: it counts as running.
    """
    return tuple((child, batch.seen.get(child, "running")) for child in (batch.checkpoint.delegated or {}).values())


def follow_background(
    batch: batch_state.Batch, call: ToolCall, delegated: dict[str, str], sent: list[tuple[str, str | None]]
) -> None:
    """``agent_status``, ``agent_cancel`` (answered now) or ``agent_await`` (delegated to the task's child)."""
    task_id = str(call.args.get("task_id", ""))
    if task_id not in (batch.checkpoint.background or []) or records.lead_of(task_id) != batch.checkpoint.session_id:
        batch.settle(
            machine.tool_error(call, "not-found", "TaskNotFound", f"no background task {task_id!r} in this run")
        )
    elif call.name == AGENT_AWAIT:
        delegated[call.id] = task_id
    elif call.name == AGENT_STATUS:
        batch.settle(machine.tool_message(call, subagents.status_of(task_id, batch.deps.store.load(task_id))))
    elif call.name == AGENT_CANCEL:
        batch.deps.store.request_abort(task_id)
        sent.append((task_id, None))
        batch.settle(machine.tool_message(call, {"task_id": task_id, "cancelled": True}))
