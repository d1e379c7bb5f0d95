"""The subject of the checkpoint store contract: a store under test, its approvals, and the shared steps of checks.

Typed against ``store.interfaces`` only, so every implementation is held to the same ports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from store import interfaces
from store.records import Approval, Checkpoint, Message, StepWrite


@dataclass
class StoreSubject:
    """A store under test and the few things the contract cannot do through the store itself."""

    store: interfaces.CheckpointStore
    #: The approval store over the same data.
    approvals: interfaces.ApprovalStore
    #: The store's notion of now (Postgres ``now()``, or the fake clock).
    now: Callable[[], datetime]
    #: Make every later write carry a strictly later timestamp than every earlier one.
    tick: Callable[[], object]
    #: Overwrite a run's stored document with one that does not parse as a checkpoint.
    corrupt: Callable[[str], None]


#: Builds a subject over an empty store with the given history ring size.
StoreFactory = Callable[[int], StoreSubject]

AGENT = "contract-agent"


def user_message(text: str) -> Message:
    return Message(role="user", content=text)


def claimed_run(store: interfaces.CheckpointStore, session_id: str, token: int, seq: int | None = None) -> Checkpoint:
    claim = store.claim(session_id, token, seq)
    assert claim.checkpoint is not None, f"claim of {session_id} with token {token} refused: {claim}"
    return claim.checkpoint


def save_next(store: interfaces.CheckpointStore, checkpoint: Checkpoint, **update: Any) -> Checkpoint:
    """Save ``checkpoint`` as the next seq with ``update`` applied; it must be accepted."""
    new = checkpoint.model_copy(update={"seq": checkpoint.seq + 1, **update})
    drained = new.inbox_cursor != checkpoint.inbox_cursor
    assert write(store, new, drained_inbox=drained) is not None, f"save of seq {new.seq} refused"
    return new


def new_run(store: interfaces.CheckpointStore, session_id: str, text: str = "hello") -> Checkpoint:
    store.append_input(session_id, AGENT, [user_message(text)])
    return claimed_run(store, session_id, 1)


def comparable(checkpoint: Checkpoint) -> dict[str, Any]:
    return checkpoint.model_dump(
        mode="json", exclude={"updated_at", "attempts", "last_error", "inbox_cursor", "history_seq"}
    )


def write(
    store: interfaces.StepStore,
    checkpoint: Checkpoint,
    *,
    drained_inbox: bool = False,
    approvals: Sequence[Approval] = (),
    paused_before: bool = False,
) -> datetime | None:
    """What a step hands the store for ``checkpoint``, without saying which messages it added."""
    return store.record_step(
        StepWrite(
            checkpoint=checkpoint, drained_inbox=drained_inbox, approvals=tuple(approvals), paused_before=paused_before
        )
    )
