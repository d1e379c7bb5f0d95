"""Running one cleared tool call: the call itself, on the tool threads when it has a timeout, then its post hooks.

Whatever happens becomes the call's result; nothing here saves.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from store import errors
from store.records import Checkpoint, Message, ToolCall
from worker import business, gates, machine, tool_threads
from worker import hooks as hook_calls
from worker.agents import (
    Agent,
    ToolArgsInvalid,
)

Invoked = tuple[Message, "business.Write | None"]


def invoke(
    agent: Agent,
    checkpoint: Checkpoint,
    call: ToolCall,
    cancelled: threading.Event,
    attempt: int = 1,
    approval_id: str | None = None,
    state: Any = None,
) -> Invoked:
    """Run one cleared call, starting from business state ``state``: its result message and what it wrote.

    Whatever happens becomes the result; a tool that raised after writing the state keeps its write (it is saved
    with the error result). A write that cannot be saved (not JSON, too large) makes the result an error that
    says so, and is dropped.
    """
    tool = agent.tools[call.name]
    context = gates.call_context(agent, checkpoint, call, cancelled, attempt, approval_id, state)
    try:
        value = tool.invoke(call.args, context)
    except ToolArgsInvalid as exc:
        return machine.tool_error(call, "validation", "ToolArgsInvalid", str(exc)), None
    except (errors.PropagatingToolError, errors.HookFailedError):
        raise  # the tool (or a hook) stops the run: no result, no further call (worker.steps records it)
    except Exception as exc:  # a raising tool becomes an error result for the model
        result = machine.tool_error(call, "execution", type(exc).__name__, str(exc))
    else:
        result = machine.tool_message(call, value)
    try:
        return result, business.written(state, context.business_state, "tool")
    except business.InvalidWrite as exc:
        return machine.tool_error(call, "execution", "BusinessStateInvalid", str(exc)), None


class _CallCancelled(threading.Event):
    """``ctx.cancelled`` of a call with a timeout: set when it times out, and whenever the run is aborted."""

    def __init__(self, abort: threading.Event) -> None:
        super().__init__()
        self._abort = abort

    def is_set(self) -> bool:
        """Whether the call should stop (timed out, or the run aborted)."""
        return super().is_set() or self._abort.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the call should stop (True) or ``timeout`` passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            remaining = 0.05 if deadline is None else min(deadline - time.monotonic(), 0.05)
            if remaining <= 0:
                return False
            super().wait(remaining)
        return True


def invoke_within(
    agent: Agent,
    checkpoint: Checkpoint,
    call: ToolCall,
    abort: threading.Event,
    timeout: float,
    attempt: int = 1,
    approval_id: str | None = None,
    state: Any = None,
) -> Invoked:
    """Run a call that has a timeout on the process's tool threads; its result, whatever happens.

    A call that found no free thread within ``timeout`` is cancelled: it never runs, and its result says so
    (``not-run``), so the model may ask again without anything happening twice. A call that started gets its
    whole ``timeout`` from its start; past it, it is told through ``ctx.cancelled``, its answer (if one comes)
    is dropped, its result says it may still take effect, and its thread is replaced; what it writes into the
    business state then is dropped too (it may still be writing).
    """
    threads = tool_threads.process_threads()
    cancelled = _CallCancelled(abort)
    running = threads.submit(invoke, agent, checkpoint, call, cancelled, attempt, approval_id, state)
    try:
        outcome = threads.wait(running, timeout)
    except BaseException:
        # The step is going away (its time limit): a call that did not start must never start later.
        if not running.cancel():
            cancelled.set()
            threads.abandon(running)
        raise
    if outcome == "done":
        return running.result()
    if outcome == "not-started":
        return machine.tool_error(
            call,
            "not-run",
            "ToolNotStarted",
            f"no worker thread was free for this call within its {timeout:g} s timeout; it did not run and never will",
        ), None
    cancelled.set()
    timed_out = machine.tool_error(
        call,
        "timeout",
        "ToolTimedOut",
        f"the call ran longer than {timeout:g} s and was given up; it may still take effect",
    )
    return timed_out, None


def outcome_of(result: Message) -> str:
    """``ok``, or the kind of error a tool result is (``error``, ``timeout``, ...), for metrics and traces."""
    if not result.is_error:
        return "ok"
    try:
        kind = json.loads(result.content).get("kind") if isinstance(result.content, str) else None
    except (ValueError, AttributeError):
        kind = None
    return kind if isinstance(kind, str) and kind.isidentifier() and len(kind) <= 32 else "error"


def after_hooks(
    agent: Agent, checkpoint: Checkpoint, call: ToolCall, result: Message, resumed: bool, state: Any
) -> tuple[Message, business.Write | None]:
    """``result`` as the ``post_tool_call`` hooks leave it, and the business state they wrote (from ``state``).

    Raises:
        HookFailedError: a hook raised, or wrote a state that cannot be saved (the call gets no result; it runs
            again on resume).
    """
    hooks = hook_calls.having(agent.hooks, "post_tool_call")
    if not hooks:
        return result, None
    ctx = gates.hook_context(agent, checkpoint, call, resumed, state)
    replaced = hook_calls.post_tool_call(hooks, ctx, result)
    write = business.hook_written(state, ctx)
    if replaced is None:
        return result, write
    return machine.tool_message(call, replaced.value, replaced_by_hook=True), write
