"""Fork a run from a step of its history, with an optional patch; the source run is untouched.

The patch applies in a fixed order: ``messages`` (rewrite the transcript), ``business_state``
(replace it), ``tool_result`` (replace a call's result in place, or record it when missing),
``append_input`` (a user message queued after any calls still pending).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from store import errors, interfaces, payloads, records
from store.records import Checkpoint, Message

MAX_FORK_NUMBER = 10_000


@dataclass(frozen=True)
class Fork:
    """A new run made from a step of another: resume ``session_id`` to run it."""

    session_id: str
    step: int
    checkpoint: Checkpoint


def _messages(value: Any, current: list[Message]) -> list[Message]:
    if callable(value):
        value = value([m.dump() for m in current])
    if not isinstance(value, list):
        raise errors.ConfigurationError("patch['messages'] must be a list of messages or a function returning one")
    return [m if isinstance(m, Message) else Message.model_validate(payloads.sanitize(m)) for m in value]


def _tool_result(checkpoint: Checkpoint, value: Any) -> Checkpoint:
    if not isinstance(value, dict) or "tool_call_id" not in value or "result" not in value:
        raise errors.ConfigurationError("patch['tool_result'] needs 'tool_call_id' and 'result'")
    call_id = str(value["tool_call_id"])
    content = payloads.tool_result_text(value["result"])
    messages = list(checkpoint.messages)
    for index, message in enumerate(messages):
        if message.role == "tool" and message.tool_call_id == call_id:
            messages[index] = message.model_copy(update={"content": content, "is_error": None})
            return checkpoint.model_copy(update={"messages": messages})
    pending = {c.id: c for c in checkpoint.pending_tool_calls}
    if call_id not in pending:
        raise errors.ConfigurationError(f"no tool call {call_id!r} in the forked transcript")
    result = Message(role="tool", tool_call_id=call_id, name=pending[call_id].name, content=content)
    return checkpoint.with_tool_result(result)


def apply_patch(checkpoint: Checkpoint, patch: dict[str, Any]) -> tuple[Checkpoint, list[Message]]:
    """The patched checkpoint and the input to queue (from ``append_input``).

    Raises:
        ConfigurationError: an unknown key or a value of the wrong shape.
    """
    unknown = set(patch) - {"messages", "business_state", "tool_result", "append_input"}
    if unknown:
        raise errors.ConfigurationError(f"unknown patch keys: {', '.join(sorted(unknown))}")
    if "messages" in patch:
        checkpoint = checkpoint.model_copy(update={"messages": _messages(patch["messages"], checkpoint.messages)})
    if "business_state" in patch:
        payloads.check_depth(patch["business_state"])
        checkpoint = checkpoint.model_copy(update={"business_state": payloads.sanitize(patch["business_state"])})
    if "tool_result" in patch:
        checkpoint = _tool_result(checkpoint, patch["tool_result"])
    queued: list[Message] = []
    if patch.get("append_input") is not None:
        text = patch["append_input"]
        if not isinstance(text, str) or len(text) > payloads.MAX_INPUT_STRING:
            raise errors.ConfigurationError("patch['append_input'] must be a string of at most 1 MiB")
        queued.append(Message(role="user", content=payloads.clean_text(text)))
    return checkpoint, queued


def fork(
    store: interfaces.ProducerStore,
    session_id: str,
    from_step: int,
    patch: dict[str, Any] | None = None,
    new_session_id: str | None = None,
    *,
    agent: str | None = None,
) -> Fork:
    """Start a new run from the newest history entry of ``from_step`` of ``session_id``.

    Raises:
        CheckpointNotFoundError: the step is not kept (the message lists the kept steps).
        ConfigurationError: ``new_session_id`` already has a checkpoint, or the patch is malformed.
        SessionIdInvalidError: an id breaks the id rules, or ``new_session_id`` has the form of a sub-agent's run
            (``<run>.task-<16 hex>``); nothing is created.
    """
    records.validate_session_id(session_id)
    entries = store.history(session_id)
    if agent is not None:
        entries = [e for e in entries if e.checkpoint.agent == agent]
    chosen = next((e for e in entries if e.step == from_step), None)
    if chosen is None:
        kept = sorted({e.step for e in entries})
        listed = ", ".join(map(str, kept)) if kept else "none"
        raise errors.CheckpointNotFoundError(
            f"step {from_step} of run {session_id!r} is not in its history; steps kept: {listed}"
        )
    patched, queued = apply_patch(chosen.checkpoint, patch or {})
    # A fork never shares a child with its source: what the source delegated, its background tasks and its
    # waiting on them stay the source's. A ``task`` call without a result goes through the gates again and starts
    # a child of the fork's own; a task id the copied transcript names is not one of the fork's (``TaskNotFound``).
    base = patched.model_copy(
        update={
            "status": "in-progress",
            "approval_ids": [],
            "started_tool_call_ids": [],
            "last_error": None,
            "attempts": 0,
            "finish_reason": None,
            "seq": 0,
            "fence": 0,
            "inbox_cursor": 0,
            "updated_at": None,
            "delegated": None,
            "background": None,
            "waiting": False,
        }
    )
    names: list[str] = (
        [records.validate_session_id(new_session_id)]
        if new_session_id
        else [f"{session_id}.fork-{n}" for n in range(1, MAX_FORK_NUMBER)]
    )
    for name in names:
        records.validate_session_id(name)
        if records.is_child_id(name):
            # Only a lead's step makes such a run: one made here would be deleted, aborted and woken with that lead.
            raise errors.SessionIdInvalidError(name, "ends with .task-<16 hex>, the mark of sub-agent runs")
        candidate = base.model_copy(update={"session_id": name})
        if store.create_run(candidate, queued):
            return Fork(session_id=name, step=chosen.step, checkpoint=candidate)
        if new_session_id:
            raise errors.ConfigurationError(f"run {new_session_id!r} already exists: pick another id")
    raise errors.ConfigurationError(f"run {session_id!r} has no free fork id left")
