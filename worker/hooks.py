"""Hooks: the application's code around every model call, tool call and run end of an agent.

A hook is any object with some of these methods, given as ``Agent(..., hooks=[...])`` and run in list order:

- ``pre_generate(ctx, request)``: before each model call. It may change ``request.messages`` or
  ``request.tools`` (or return a new ``ModelRequest``); only the outgoing request changes, never the saved
  transcript.
- ``post_generate(ctx, response)``: after each model call, before its turn is saved (observe only).
- ``pre_tool_call(ctx)``: after a call's arguments validated, before ``needs_approval``. Return None to go on,
  ``Deny(reason)`` for a ``denied`` error result, ``Result(value)`` to skip the call with that result, or
  ``Input(args)`` to run it with other arguments (validated again; the next hook sees them). The first
  ``Deny`` or ``Result`` ends the chain. It runs again, with ``ctx.resumed_after_approval``, before an
  approved call runs; the arguments a person approved are pinned then: an ``Input`` that changes them gets
  the call a ``validation`` error result instead of running.
- ``post_tool_call(ctx, result)``: after a call ran, with its result message (``content`` text, ``is_error``).
  Return ``Result(value)`` to replace it (the result is marked ``replaced_by_hook``).
- ``on_run_end(ctx, end)``: after the save that ends the run's input (finished, paused, aborted or stopped at
  a budget). At least once: a crash before it returned runs it again on another worker, with the same
  ``end.end_id``, so make it idempotent with that id.

Hooks are synchronous and run on the worker, in the step's threads (tool hooks in the call's thread). A hook
that raises stops the run: it keeps its last save, ``last_error`` is ``LOUSHO_HOOK_FAILED``, ``pending()``
lists it and ``resume()`` tries again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from store import errors, payloads
from store.records import Message, Usage
from worker import business
from worker.providers.base import ModelResponse, ToolSpec

__all__ = ["Deny", "HookContext", "Input", "ModelRequest", "Result", "RunEnd"]


@dataclass(frozen=True)
class Deny:
    """``pre_tool_call`` refuses the call: it gets a ``denied`` error result with ``reason``."""

    reason: str


@dataclass(frozen=True)
class Result:
    """The call's result is ``value`` (from ``pre_tool_call``: the call is skipped)."""

    value: Any


@dataclass(frozen=True)
class Input:
    """``pre_tool_call`` runs the call with ``args`` instead (validated against the tool's schema)."""

    args: dict[str, Any]


@dataclass
class ModelRequest:
    """What goes to the model: copies a ``pre_generate`` hook may change freely."""

    messages: list[Message]
    tools: list[ToolSpec]


@dataclass
class HookContext(business.Holder):
    """What a hook learns about the run and, for tool hooks, the call.

    Every field is read-only but ``business_state``: a hook around a model call may assign it (or change it in
    place) and the value is saved with the model turn; a hook around a tool call, with the call's result. In
    ``on_run_end`` it is read-only (the run's input ended: nothing would save it).
    """

    session_id: str
    agent: str
    #: The run's step (model turns so far in the current input).
    step: int
    #: Metadata sent with the input the run is working on (``send(..., metadata=...)``), if known.
    metadata: dict[str, Any] | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    #: The call's arguments as they stand (after earlier hooks' ``Input``).
    args: dict[str, Any] = field(default_factory=dict)
    #: True when the call runs after a person approved it.
    resumed_after_approval: bool = False
    #: The run's business state (a copy; see above).
    business_state: Any = None


@dataclass(frozen=True)
class RunEnd:
    """How the run's input ended, for ``on_run_end``; ``end_id`` is the same each time it is delivered."""

    end_id: str
    session_id: str
    agent: str
    #: ``finished``, ``awaiting-approval`` or ``in-progress`` (stopped by an abort or a budget).
    status: str
    finish_reason: str | None
    text: str | None
    steps: int
    usage: Usage
    approval_ids: Sequence[str] = ()


def _failed(hook: object, method: str, exc: Exception) -> errors.HookFailedError:
    return errors.HookFailedError(
        payloads.clean_error(f"hook {type(hook).__name__}.{method} raised {type(exc).__name__}: {exc}")
    )


def call(hook: object, method: str, *args: Any) -> Any:
    """``hook.method(*args)``, or None when the hook has no such method.

    Raises:
        HookFailedError: the hook raised (the run stops at its last save).
    """
    fn = getattr(hook, method, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception as exc:  # recorded as the run's last error, never swallowed
        raise _failed(hook, method, exc) from exc


def having(hooks: Sequence[object], method: str) -> list[object]:
    """The hooks that define ``method``."""
    return [hook for hook in hooks if callable(getattr(hook, method, None))]


def pre_generate(hooks: Sequence[object], ctx: HookContext, request: ModelRequest) -> ModelRequest:
    """Run every ``pre_generate`` hook on ``request`` (each may change it or return a new one)."""
    for hook in hooks:
        returned = call(hook, "pre_generate", ctx, request)
        if returned is not None:
            if not isinstance(returned, ModelRequest):
                raise _failed(hook, "pre_generate", TypeError("must return None or a ModelRequest"))
            request = returned
    return request


def post_generate(hooks: Sequence[object], ctx: HookContext, response: ModelResponse) -> None:
    """Run every ``post_generate`` hook on the model's answer."""
    for hook in hooks:
        call(hook, "post_generate", ctx, response)


def pre_tool_call(hooks: Sequence[object], ctx: HookContext) -> Deny | Result | Input | None:
    """The chain of ``pre_tool_call`` hooks: the first ``Deny`` or ``Result``, or the last ``Input``, or None.

    Each hook after an ``Input`` sees the new arguments in ``ctx.args``.
    """
    rewritten: Input | None = None
    for hook in hooks:
        verdict = call(hook, "pre_tool_call", ctx)
        if verdict is None:
            continue
        if isinstance(verdict, Deny | Result):
            return verdict
        if not isinstance(verdict, Input) or not isinstance(verdict.args, dict):
            raise _failed(hook, "pre_tool_call", TypeError("must return None, Deny, Result or Input(dict)"))
        rewritten = verdict
        # The same context, so a business state an earlier hook wrote stays with it (``args`` is ours to change).
        object.__setattr__(ctx, "args", dict(verdict.args))
    return rewritten


def post_tool_call(hooks: Sequence[object], ctx: HookContext, result: Message) -> Result | None:
    """The last ``Result`` a ``post_tool_call`` hook returned for ``result`` (each sees the one before), or None."""
    replaced: Result | None = None
    for hook in hooks:
        verdict = call(hook, "post_tool_call", ctx, result)
        if verdict is None:
            continue
        if not isinstance(verdict, Result):
            raise _failed(hook, "post_tool_call", TypeError("must return None or Result"))
        replaced = verdict
        result = result.model_copy(update={"content": payloads.tool_result_text(verdict.value)})
    return replaced


def on_run_end(hooks: Sequence[object], ctx: HookContext, end: RunEnd) -> None:
    """Run every ``on_run_end`` hook."""
    for hook in hooks:
        call(hook, "on_run_end", ctx, end)
