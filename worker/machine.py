"""The pure step machine: a checkpoint (and queued input) in, the next action and new checkpoint out.

No database, Redis, Celery or clock here: every guarantee of a run lives in these functions, so
they are tested in microseconds and replayed deterministically.

Stays whole: the pure step machine's rules (plan, merge, fit) decide one next action together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from store import payloads
from store.records import Checkpoint, InboxEntry, Message, ToolCall, Usage


@dataclass(frozen=True)
class ModelTurn:
    """Call the model on ``checkpoint.messages`` (input already merged)."""

    checkpoint: Checkpoint
    drained_inbox: bool


@dataclass(frozen=True)
class ToolBatch:
    """Run ``calls`` (the last turn's calls without a result), then save each result."""

    checkpoint: Checkpoint
    calls: list[ToolCall]


@dataclass(frozen=True)
class Save:
    """Nothing to run: store ``checkpoint`` as it is (finished by max steps, or input consumed)."""

    checkpoint: Checkpoint
    drained_inbox: bool


@dataclass(frozen=True)
class Idle:
    """Nothing to do; the run is paused, finished or waiting for input."""

    reason: str


Action = ModelTurn | ToolBatch | Save | Idle


def plan(
    checkpoint: Checkpoint,
    inbox: Sequence[InboxEntry],
    *,
    instructions: str,
    max_steps: int,
    over_budget: Callable[[Checkpoint], bool] | None = None,
) -> Action:
    """Decide the one step a task performs for this run.

    Pending tool calls always come first; queued input is merged only at a boundary where every
    call of the last turn has its result, so input never lands between a call and its result. Before a
    model call, ``over_budget`` (the input's limits) may stop the run instead (``budget-exceeded``).
    """
    if checkpoint.status == "awaiting-approval" and not checkpoint.waiting:
        return Idle("awaiting-approval")  # (a lead paused on its children's approvals looks at them again)
    if checkpoint.aborted:
        if not inbox:
            return Idle("aborted")
        # New input continues an aborted run (every call already has its result).
        checkpoint = checkpoint.model_copy(update={"aborted": False, "finish_reason": None})
    elif checkpoint.finish_reason in _STOPS and checkpoint.status == "in-progress":
        checkpoint = checkpoint.model_copy(update={"finish_reason": None})  # resumed after an abort or a budget
    pending = checkpoint.pending_tool_calls
    if pending:
        return ToolBatch(checkpoint, pending)
    merged = merge_input(checkpoint, inbox, instructions=instructions) if inbox else checkpoint
    drained = merged.inbox_cursor != checkpoint.inbox_cursor
    if merged.status == "finished":
        return Save(merged, drained) if drained else Idle("finished")
    if not any(m.role == "user" for m in merged.messages[merged.run_start :]):
        return Save(merged, drained) if drained else Idle("no input")
    last = merged.messages[-1]
    if last.role == "assistant" and not last.tool_calls:
        return Save(finish(merged, "stop"), drained)
    if merged.step >= max_steps:
        return Save(finish(merged, "max-steps"), drained)
    if over_budget is not None and over_budget(merged):
        return Save(stopped(merged, "budget-exceeded"), drained)
    return ModelTurn(merged, drained)


def finish(checkpoint: Checkpoint, reason: str) -> Checkpoint:
    """The checkpoint of a run that ended with ``reason``."""
    return checkpoint.model_copy(update={"status": "finished", "finish_reason": reason})


#: Reasons a run stops in progress until a send or a resume moves it again.
_STOPS = ("aborted", "budget-exceeded")


def stopped(checkpoint: Checkpoint, reason: str) -> Checkpoint:
    """The checkpoint of a run stopped (in progress) for ``reason``: it waits for a send or a resume."""
    return checkpoint.model_copy(update={"status": "in-progress", "aborted": True, "finish_reason": reason})


def _signature(message: Message) -> tuple[Any, ...]:
    calls = tuple((c.name, payloads.dumps(c.args)) for c in message.tool_calls or ())
    return message.role, payloads.dumps(message.content), calls


def _starts_with(items: Sequence[Message], prefix: Sequence[Message]) -> bool:
    return len(prefix) <= len(items) and all(
        _signature(a) == _signature(b) for a, b in zip(items, prefix, strict=False)
    )


def merge_input(checkpoint: Checkpoint, inbox: Sequence[InboxEntry], *, instructions: str) -> Checkpoint:
    """Apply queued sends in order, following the send-again rules.

    - A finished run continues as a conversation: a new run starts with zeroed step and usage.
    - Input that re-sends the stored history contributes only what follows it.
    - Input that re-sends the message the unfinished run started from is a retry, not new input.
    - System messages in input are ignored once the run has a transcript.
    - Business state sent with an input replaces the run's (a retried input's too: the sender meant it).
    """
    current = checkpoint
    for entry in inbox:
        if entry.n <= current.inbox_cursor:
            continue
        current = _merge_one(current, [m for m in entry.messages], instructions)
        update: dict[str, Any] = {"inbox_cursor": entry.n}
        if entry.metadata is not None:
            update["metadata"] = entry.metadata
        if entry.business_state is not None:
            update["business_state"] = entry.business_state
        if entry.fairness_key is not None:
            update["fairness_key"] = entry.fairness_key
        current = current.model_copy(update=update)
    return current


def _merge_one(checkpoint: Checkpoint, incoming: list[Message], instructions: str) -> Checkpoint:
    messages = list(checkpoint.messages)
    if not messages:
        # A new run: its own system prompt, then the first input (system input ignored).
        head = [Message(role="system", content=instructions)] if instructions else []
        body = [m for m in incoming if m.role != "system"]
        if not body:
            return checkpoint
        return checkpoint.model_copy(
            update={
                "messages": head + body,
                "run_start": len(head),
                "step": 0,
                "status": "in-progress",
                "finish_reason": None,
            }
        )
    incoming = [m for m in incoming if m.role != "system"]
    stored = [m for m in messages if m.role != "system"]
    if _starts_with(incoming, stored):
        incoming = incoming[len(stored) :]
    elif checkpoint.status != "finished":
        started_with = [m for m in messages[checkpoint.run_start :] if m.role == "user"][: len(incoming)]
        if incoming and len(started_with) == len(incoming) and _starts_with(started_with, incoming):
            incoming = []
    if not incoming:
        return checkpoint
    if checkpoint.status == "finished":
        return checkpoint.model_copy(
            update={
                "messages": messages + incoming,
                "run_start": len(messages),
                "step": 0,
                "usage": Usage(),
                "status": "in-progress",
                "finish_reason": None,
                "business_state": checkpoint.business_state,
                "metadata": None,
                "clock_spent_s": None,
                "clock_since": None,
                "background": None,
            }
        )
    return checkpoint.model_copy(update={"messages": messages + incoming})


#: Provider stop reasons that end a run with a reason of their own (anything else without calls is ``stop``).
_PROVIDER_FINISH = {
    "length": "length",
    "max_tokens": "length",
    "content_filter": "content-filter",
    "refusal": "content-filter",
}


def apply_model_response(
    checkpoint: Checkpoint, text: str | None, calls: list[ToolCall], usage: Usage, provider_finish: str | None = None
) -> Checkpoint:
    """Record one model turn. With calls the run stays in progress; without, it finished.

    It finished with ``stop``, or with ``length`` or ``content-filter`` when the provider says the answer was cut
    at its token limit (``length``, ``max_tokens``) or withheld (``content_filter``, ``refusal``).
    """
    content = payloads.clean_text(text) if text is not None else None
    # Calls come from the provider: a NUL or an oversized number in them would fail every save.
    calls = [
        c.model_copy(
            update={
                "id": payloads.clean_text(c.id),
                "name": payloads.clean_text(c.name),
                "args": payloads.sanitize(c.args),
                "invalid_args": None if c.invalid_args is None else payloads.clean_text(c.invalid_args),
            }
        )
        for c in calls
    ]
    turn = Message(role="assistant", content=content, tool_calls=calls or None)
    update: dict[str, Any] = {
        "messages": [*checkpoint.messages, turn],
        "step": checkpoint.step + 1,
        "usage": checkpoint.usage + usage,
    }
    if not calls:
        update.update(status="finished", finish_reason=_PROVIDER_FINISH.get(provider_finish or "", "stop"))
    return checkpoint.model_copy(update=update)


def record_tool_result(checkpoint: Checkpoint, result: Message) -> Checkpoint:
    """Insert a tool result at its call's position among the last turn's results.

    Results settle in any order; keeping them sorted by call order means the transcript is
    valid as soon as the last one lands. A second result for the same call is ignored.
    """
    updated = checkpoint.with_tool_result(result)
    if updated.approval_ids and updated.status == "in-progress" and not updated.pending_tool_calls:
        # The turn is complete: its decisions are spent. Until then they stay, so a crash before an
        # approved call is marked started finds the decision again instead of asking the human twice.
        updated = updated.model_copy(update={"approval_ids": []})
    return updated


def mark_started(checkpoint: Checkpoint, call_id: str) -> Checkpoint:
    """Record that an approved call or a ``once`` call is about to run (the same checkpoint when it is marked).

    A step that finds it without a result does not run it again: an approved call gets an ``interrupted``
    result, a ``once`` call is reconciled (``worker.once``).
    """
    if call_id in checkpoint.started_tool_call_ids:
        return checkpoint
    return checkpoint.model_copy(update={"started_tool_call_ids": [*checkpoint.started_tool_call_ids, call_id]})


def drop_approval(checkpoint: Checkpoint, approval_id: str) -> Checkpoint:
    """The checkpoint without ``approval_id`` among its decisions (the same one when it is not there).

    A reconciliation approved to run its call again is spent by that execution: a crash during it is reconciled
    anew instead of running the call once more on the same decision.
    """
    if approval_id not in checkpoint.approval_ids:
        return checkpoint
    return checkpoint.model_copy(update={"approval_ids": [a for a in checkpoint.approval_ids if a != approval_id]})


def attempt_of(checkpoint: Checkpoint) -> int:
    """``ToolContext.attempt`` of the calls a step runs from ``checkpoint`` as claimed (``attempts`` counted it).

    ``attempts`` counts the starts since the last save. When the last turn already has a result or a started mark,
    that save came from an earlier start of this batch, which may have run the calls still without a result:
    one more. So a call gets 1 when no earlier start can have run it, and 2 or more when one may have.
    """
    base = max(checkpoint.attempts, 1)
    if checkpoint.started_tool_call_ids:
        return base + 1
    for index in range(len(checkpoint.messages) - 1, -1, -1):
        role = checkpoint.messages[index].role
        if role == "assistant":
            return base
        if role == "tool":
            return base + 1
    return base


def pause(checkpoint: Checkpoint, approval_ids: list[str]) -> Checkpoint:
    """The checkpoint of a run waiting on a decision for each of ``approval_ids``."""
    return checkpoint.model_copy(update={"status": "awaiting-approval", "approval_ids": list(approval_ids)})


def interrupted(call: ToolCall) -> Message:
    """The result of an approved call that was running when its worker died: never run twice."""
    return tool_error(
        call,
        "interrupted",
        "ToolInterrupted",
        "this approved call was interrupted while running; it may or may not have taken effect."
        " Check before trying it again.",
    )


def not_done(call: ToolCall, note: str | None) -> Message:
    """The result of a ``once`` call a person found had not taken effect and chose not to run again."""
    body = {
        "error": "ReconciledNotDone",
        "tool_name": call.name,
        "kind": "not-done",
        "tool_call_id": call.id,
        "message": "this call was interrupted and a person found it did not take effect; it was not run again",
        "note": note,
    }
    return Message(role="tool", tool_call_id=call.id, name=call.name, content=payloads.dumps(body), is_error=True)


def aborted(checkpoint: Checkpoint, inbox: Sequence[InboxEntry], *, instructions: str) -> Checkpoint:
    """The checkpoint of a run stopped by an abort.

    Every call without a result gets a ``cancelled`` one, input already queued is kept in the transcript
    after them, and the run waits (in progress, ``finish_reason="aborted"``) for a send or a resume; the
    decisions of a pause are dropped (its approvals are withdrawn with the save).
    """
    updated = checkpoint
    for call in checkpoint.pending_tool_calls:
        updated = updated.with_tool_result(cancelled(call))
    if inbox:
        updated = merge_input(updated.model_copy(update={"status": "in-progress"}), inbox, instructions=instructions)
    return updated.model_copy(
        update={
            "status": "in-progress",
            "aborted": True,
            "finish_reason": "aborted",
            "approval_ids": [],
            "started_tool_call_ids": [],
            "delegated": None,
            "waiting": False,
        }
    )


def cancelled(call: ToolCall) -> Message:
    """The result of a call an abort stopped before it finished (or before it started)."""
    return tool_error(
        call, "cancelled", "RunAborted", "the run was aborted before this call finished; it may not have taken effect"
    )


def redirected(call: ToolCall) -> Message:
    """The result of a call a steer kept from starting: the user sent a new message instead."""
    return tool_error(
        call,
        "not-run",
        "RunRedirected",
        "the user redirected the run with a new message before this call started; it did not run",
    )


def answered(call: ToolCall, answer: str | None) -> Message:
    """The result of an ``ask_question`` call a person answered."""
    return tool_message(call, {"answer": answer})


def declined(call: ToolCall, note: str | None) -> Message:
    """The result of an ``ask_question`` call a person declined to answer, with their note."""
    body = {
        "error": "QuestionDeclined",
        "tool_name": call.name,
        "kind": "declined",
        "tool_call_id": call.id,
        "message": "the person declined to answer this question",
        "note": note,
    }
    return Message(role="tool", tool_call_id=call.id, name=call.name, content=payloads.dumps(body), is_error=True)


def rejected(call: ToolCall, note: str | None) -> Message:
    """The result of a call a human rejected, with the human's note."""
    body = {
        "error": "ApprovalRejected",
        "tool_name": call.name,
        "kind": "rejected",
        "tool_call_id": call.id,
        "message": "a human rejected this call",
        "note": note,
    }
    return Message(role="tool", tool_call_id=call.id, name=call.name, content=payloads.dumps(body), is_error=True)


def tool_message(call: ToolCall, value: Any, *, replaced_by_hook: bool = False) -> Message:
    """A tool's return value as its result message (sanitized, size-capped); a hook's, when ``replaced_by_hook``."""
    return Message(
        role="tool",
        tool_call_id=call.id,
        name=call.name,
        content=payloads.tool_result_text(value),
        replaced_by_hook=True if replaced_by_hook else None,
    )


def tool_error(call: ToolCall, kind: str, error: str, message: str) -> Message:
    """A structured error result the model sees instead of a crash."""
    body = {
        "error": error,
        "tool_name": call.name,
        "message": payloads.clean_error(message),
        "kind": kind,
        "tool_call_id": call.id,
    }
    return Message(role="tool", tool_call_id=call.id, name=call.name, content=payloads.dumps(body), is_error=True)


def transcript_problems(messages: Sequence[Message]) -> list[str]:
    """Why a transcript is not valid for a provider (empty when valid).

    Every call's result follows its turn, one per call, in call order; nothing else sits
    between a turn and its results; no result without a call.
    """
    problems: list[str] = []
    index = 0
    while index < len(messages):
        message = messages[index]
        if message.role == "tool":
            problems.append(f"message {index}: result {message.tool_call_id!r} without a call turn")
            index += 1
            continue
        index += 1
        if message.role == "assistant" and message.tool_calls:
            expected = [c.id for c in message.tool_calls]
            got: list[str | None] = []
            while index < len(messages) and messages[index].role == "tool":
                got.append(messages[index].tool_call_id)
                index += 1
            if got != expected:
                problems.append(f"turn {index}: results {got} do not match calls {expected}")
    return problems
