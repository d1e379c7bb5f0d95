"""Input rules: how a send's input becomes chat messages, the limits it is held to, and the known-agent check.

One owner for every way input gets in (the client, schedules, webhooks); no I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from store import errors, payloads
from store.records import Message

MAX_INPUT_MESSAGES = 1000
#: Longest note kept with an approval decision, in characters.
MAX_NOTE_CHARS = 10_000

#: What ``send`` accepts: a string (one user message) or a list of chat messages.
Input = str | Sequence[dict[str, Any] | Message]


def normalize_input(input: Input) -> list[Message]:
    """Messages from a string or a list of chat dicts, checked against the input limits.

    Raises:
        InputTooLargeError: too many messages, a string over 1 MiB, or nesting over 32 levels.
        ConfigurationError: a message does not have the chat shape.
    """
    if isinstance(input, str):
        raw: list[Any] = [{"role": "user", "content": input}]
    elif isinstance(input, Sequence):
        raw = list(input)
    else:
        raise errors.ConfigurationError("input must be a string or a list of messages")
    if len(raw) > MAX_INPUT_MESSAGES:
        raise errors.InputTooLargeError(f"at most {MAX_INPUT_MESSAGES} messages per send")
    total = 0
    messages = []
    for item in raw:
        if isinstance(item, Message):
            item = item.dump()
        payloads.check_depth(item)
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, str) and len(content) > payloads.MAX_INPUT_STRING:
            raise errors.InputTooLargeError(f"a message is over {payloads.MAX_INPUT_STRING} characters")
        try:
            message = Message.model_validate(payloads.sanitize(item))
        except ValidationError as exc:
            raise errors.ConfigurationError(f"not a chat message: {exc.errors()[0]['msg']}") from None
        total += len(payloads.dumps(message.dump()).encode("utf-8"))
        if total > payloads.MAX_INPUT_TOTAL:
            raise errors.InputTooLargeError(
                f"one send carries at most {payloads.MAX_INPUT_TOTAL} bytes of messages; split it or attach less"
            )
        messages.append(message)
    return messages


def leaves_room(size: int) -> bool:
    """Whether a run whose checkpoint holds ``size`` bytes still has room for a model's reply under the limit."""
    return size + payloads.REPLY_ROOM <= payloads.MAX_CHECKPOINT


def no_room(session_id: str, size: int, *, queued: bool) -> errors.InputTooLargeError:
    """The refusal of input that leaves run ``session_id`` no room for a reply; it names the way out.

    ``size``: the bytes the run's checkpoint would hold with its queued input and this one. ``queued``: the
    input was queued before (a step found it too large to merge), rather than refused by ``send``.
    """
    what = (
        "the input queued for run {sid!r} does not fit: merged, the run would hold {size:,} bytes"
        if queued
        else "run {sid!r} has no room for this input: with its transcript and queued input it would hold {size:,} bytes"
    )
    then = "the model was not called and the input stays queued" if queued else "nothing was queued"
    return errors.InputTooLargeError(
        what.format(sid=session_id, size=size)
        + f", and a checkpoint keeps {payloads.REPLY_ROOM:,} of its {payloads.MAX_CHECKPOINT:,} bytes free for a"
        f" reply; {then}. To go on, fork the run with trimmed messages and continue there:"
        f" fork({session_id!r}, from_step=<its step>, patch={{'messages': <a shorter transcript>,"
        " 'append_input': <the input>}), then resume the fork",
        session_id=session_id,
        size=size,
    )


def check_agent(name: str, known: list[str]) -> None:
    """Refuse input for an agent the workers did not register; any name passes while none registered.

    Raises:
        AgentNotFoundError: ``known`` is not empty and ``name`` is not in it.
    """
    if known and name not in known:
        raise errors.AgentNotFoundError(name, known)


def decision_status(kind: str, approved: bool | None, answer: str | None) -> tuple[str, str | None]:
    """The status a decision gives an approval of ``kind``, and the answer it stores.

    A question is answered (``answer`` implies approval) or declined (``approved=False``); a tool approval
    is approved or rejected and takes no answer. A reconciliation (kind ``reconcile``) is approved (the call runs
    again), rejected (it is recorded as not done) or answered (the answer is recorded as the call's result).

    Raises:
        ConfigurationError: an answer for a tool approval, a question approved without an answer, or no decision.
    """
    if answer is not None:
        if kind not in ("question", "reconcile"):
            raise errors.ConfigurationError(
                "answer= is for questions (ask_question) and reconciliations; decide a tool call with approved="
            )
        if approved is False:
            raise errors.ConfigurationError(f"a declined {'question' if kind == 'question' else kind} takes no answer")
        return "approved", payloads.truncate_text(payloads.clean_text(str(answer)), MAX_NOTE_CHARS)
    if approved is None:
        raise errors.ConfigurationError("give approved= (or answer= for a question or a reconciliation)")
    if kind == "question" and approved:
        raise errors.ConfigurationError("a question is answered with answer=, or declined with approved=False")
    return ("approved" if approved else "rejected"), None


def clean_note(note: str | None) -> str | None:
    """A decision's note as stored: valid Unicode, at most ``MAX_NOTE_CHARS`` characters (longer is cut, marked)."""
    return None if note is None else payloads.truncate_text(payloads.clean_text(note), MAX_NOTE_CHARS)
