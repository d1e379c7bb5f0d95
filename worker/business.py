"""A run's business state as tools and hooks write it: what they are handed, what counts as a write, its event.

Pure: a write is saved by the step that made it, with what it goes with (a call's result, a model turn), in
that step's fenced save. It must not save anything itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from store import errors, payloads, runs
from store.records import EventDraft

__all__ = ["Holder", "InvalidWrite", "Write", "changed", "handed", "hook_written", "read_only", "sent", "written"]

Writer = Literal["tool", "hook", "send"]
H = TypeVar("H", bound="Holder")


class Holder:
    """Mixin of the contexts tools and hooks get: every field is read-only but ``business_state``.

    A context made with ``read_only`` refuses ``business_state`` too: where nothing would save a write (an approval
    rule, a ``reconcile`` function, ``on_run_end``), assigning it raises rather than being lost without a word.
    """

    def __post_init__(self) -> None:
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_sealed", False):
            kind = type(self).__name__
            if name != "business_state":
                raise AttributeError(f"{kind}.{name} is read-only; only business_state may be assigned")
            if getattr(self, "_state_read_only", False):
                raise AttributeError(
                    f"{kind}.business_state cannot be written here: nothing would save it (write it"
                    " from a tool, a hook around a model or tool call, or send it with input)"
                )
        object.__setattr__(self, name, value)


def read_only(holder: H) -> H:
    """``holder`` with ``business_state`` refused as well."""
    object.__setattr__(holder, "_state_read_only", True)
    return holder


class InvalidWrite(Exception):
    """A tool or a hook wrote a business state that cannot be saved; the caller decides what it costs."""


@dataclass(frozen=True)
class Write:
    """A new business state, checked as JSON, and who wrote it."""

    value: Any
    by: Writer


def handed(value: Any) -> Any:
    """The value a tool or a hook gets: a copy, so a change in place is seen as a write, never as a leak.

    Without the copy a tool that appends to a list in the state would change the step's own checkpoint, and the
    change would ride along with whatever the step saved next, with no event and no fence of its own.
    """
    return copy.deepcopy(value) if value is not None else None


def written(before: Any, after: Any, by: Writer) -> Write | None:
    """The write a tool or a hook made (``after`` differs from what it was handed, ``before``), or None.

    Raises:
        InvalidWrite: the value is not JSON, too deep, or over ``runs.MAX_BUSINESS_STATE_BYTES``.
    """
    if after is before or after == before:
        return None
    try:
        return Write(runs.check_business_state(after), by)
    except (errors.ConfigurationError, errors.InputTooLargeError) as exc:
        raise InvalidWrite(f"the business_state a {by} wrote was not saved: {exc}") from None


def hook_written(before: Any, ctx: Holder) -> Write | None:
    """What hooks wrote into ``ctx.business_state`` (handed ``before``), or None.

    Raises:
        HookFailedError: the value cannot be saved (not JSON, too large): a hook's mistake stops the run, as a
            hook that raised does.
    """
    try:
        return written(before, getattr(ctx, "business_state", None), "hook")
    except InvalidWrite as exc:
        raise errors.HookFailedError(payloads.clean_error(str(exc))) from None


def changed(write: Write, **where: Any) -> EventDraft:
    """The durable event of a write: ``business_state.changed`` with the writer, where it wrote, and the value."""
    return EventDraft(type="business_state.changed", data={"by": write.by, **where, "business_state": write.value})


def sent(value: Any, input_number: int) -> EventDraft:
    """The event of a business state that came with an input (``send(..., business_state=...)``)."""
    return changed(Write(value, "send"), input_number=input_number)
