"""The one error family of Lousho Worker: every error has a stable ``code`` and ``retryable``.

Producers, workers and the CLI raise and catch these; nothing here does I/O.

Stays whole: the one error family and its single public list; codes must stay unique across it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal


class LoushoError(Exception):
    """Root of every error the project raises on purpose; raised only through a subclass.

    ``code`` is stable API (callers branch on it, never on the message) and ``retryable``
    says whether trying the same thing again later can succeed. A subclass with structured
    fields sets them as typed attributes in its ``__init__`` and names them in ``field_names``.

    An error crosses processes two ways, and comes out whole from both: pickled (a prefork pool process hands
    its failure to the worker's parent, which shows it in Flower), with ``__reduce__``; and through a Celery
    result backend as ``cls(*args)``, so ``args`` are the constructor's positional arguments (kept as
    ``BaseException.__new__`` set them; a subclass with required keyword arguments sets ``args`` itself) while
    ``str()`` is the message.
    """

    #: Set by each class; an error rebuilt from a stored record carries the stored code (``RunFailedError``).
    code: str = "LOUSHO_GENERIC_ERROR"
    #: The class's answer; the errors whose ``__init__`` takes ``retryable`` answer per instance.
    retryable: bool = False
    #: The typed attributes ``fields`` lists, in order; each subclass's ``__init__`` sets them.
    field_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str) -> None:
        # No ``super().__init__(message)``: it would make ``args`` the message, and ``cls(*args)`` would build
        # an error about the message (the message twice, or a TypeError for a constructor of two arguments).
        self.message: str = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.message, self.args), dict(vars(self))

    @property
    def fields(self) -> dict[str, object]:
        """The structured fields by name (none for an error rebuilt by ``from_record``: they are not stored)."""
        attributes = vars(self)
        return {name: attributes[name] for name in self.field_names if name in attributes}

    def to_record(self) -> dict[str, Any]:
        """The ``last_error`` shape stored on a checkpoint."""
        return {"code": self.code, "message": self.message, "retryable": self.retryable}


class ConfigurationError(LoushoError):
    """Raised when a setting, option or argument is missing or has a value we cannot use.

    ``field`` names the invalid field of a definition (a schedule's, say) and ``variable`` the
    environment variable at fault, when the raiser knows one.
    """

    code = "LOUSHO_CONFIG_INVALID"
    field_names = ("field", "variable")

    def __init__(self, message: str, *, field: str | None = None, variable: str | None = None) -> None:
        super().__init__(message)
        self.field: str | None = field
        self.variable: str | None = variable


class SessionIdInvalidError(LoushoError):
    """Raised when a run id breaks the id rules (1-200 of ``A-Za-z0-9_.-``, no edge dot, no reserved suffix).

    ``session_id`` is the refused value as given (it may not even be a string).
    """

    code = "LOUSHO_SESSION_ID_INVALID"
    field_names = ("session_id", "reason")

    def __init__(self, session_id: object, reason: str) -> None:
        shown = repr(session_id)[:80]
        super().__init__(f"invalid session id {shown}: {reason}")
        self.session_id: object = session_id
        self.reason: str = reason


class SessionBusyError(LoushoError):
    """Raised when another worker or process holds the run's lease right now; nothing was run."""

    code = "LOUSHO_SESSION_BUSY"
    retryable = True
    field_names = ("session_id",)

    def __init__(self, session_id: str) -> None:
        super().__init__(f"run {session_id!r} is running elsewhere (lease held)")
        self.session_id: str = session_id


class SessionAwaitingApprovalError(LoushoError):
    """Raised when new input or a resume reaches a run paused on an approval; decide the approval first."""

    code = "LOUSHO_SESSION_AWAITING_APPROVAL"
    field_names = ("session_id", "approval_id")

    def __init__(self, session_id: str, approval_id: str | None) -> None:
        super().__init__(f"run {session_id!r} waits on approval {approval_id!r}: resolve it first")
        self.session_id: str = session_id
        self.approval_id: str | None = approval_id


class FencedOutError(LoushoError):
    """Raised when a save carries a fencing token older than the run's: another holder took over."""

    code = "LOUSHO_SESSION_BUSY"
    retryable = True
    field_names = ("session_id", "fence")

    def __init__(self, session_id: str, fence: int) -> None:
        super().__init__(f"save of run {session_id!r} with fence {fence} refused: lease lost")
        self.session_id: str = session_id
        self.fence: int = fence


class AgentNotFoundError(LoushoError):
    """Raised when no agent of that name is registered with the workers."""

    code = "LOUSHO_AGENT_NOT_FOUND"
    field_names = ("agent",)

    def __init__(self, name: str, known: list[str] | None = None) -> None:
        listed = f"; known agents: {', '.join(sorted(known))}" if known else ""
        super().__init__(f"unknown agent {name!r}{listed}")
        self.agent: str = name


class ApprovalOrphanedError(LoushoError):
    """Raised when deciding an approval whose run checkpoint was deleted, pruned or replaced; it was withdrawn."""

    code = "LOUSHO_APPROVAL_ORPHANED"
    field_names = ("approval_id", "session_id")

    def __init__(self, message: str, approval_id: str, session_id: str) -> None:
        super().__init__(message)
        self.args = (message, approval_id, session_id)  # given by keyword: ``cls(*args)`` needs all three
        self.approval_id: str = approval_id
        self.session_id: str = session_id


class ApprovalNotFoundError(LoushoError):
    """Raised when no pending approval has that id (unknown, or already decided)."""

    code = "LOUSHO_APPROVAL_NOT_FOUND"


class ApprovalExpiredError(ApprovalNotFoundError):
    """Raised when a decision comes after the approval's ``expires_at``: it was recorded as rejected instead."""

    code = "LOUSHO_APPROVAL_EXPIRED"


class AgentDriftError(LoushoError):
    """Raised when the resuming agent differs from the one that saved the checkpoint (``on_agent_drift='error'``)."""

    code = "LOUSHO_AGENT_DRIFT"


class ResumeToolMissingError(LoushoError):
    """Raised when a pending tool call names a tool the agent no longer has."""

    code = "LOUSHO_RESUME_TOOL_MISSING"


class CheckpointCorruptError(LoushoError):
    """Raised when a stored checkpoint cannot be read; delete it to start over."""

    code = "LOUSHO_CHECKPOINT_CORRUPT"


class CheckpointFormatError(LoushoError):
    """Raised when a stored checkpoint is in a newer format than this worker reads.

    A rolling deploy is under way: the step is handed back to a worker of the newer release.
    """

    code = "LOUSHO_CHECKPOINT_FORMAT_UNKNOWN"
    retryable = True
    field_names = ("session_id", "found", "supported")

    def __init__(self, session_id: str, found: int, supported: int) -> None:
        super().__init__(f"checkpoint of run {session_id!r} has format {found}; this worker reads up to {supported}")
        self.session_id: str = session_id
        self.found: int = found
        self.supported: int = supported


class CheckpointNotFoundError(LoushoError):
    """Raised when the asked-for run, checkpoint or history step is not stored."""

    code = "LOUSHO_CHECKPOINT_NOT_FOUND"


class ProviderError(LoushoError):
    """Raised by a model when its provider failed; ``retryable`` follows the failure's class.

    ``category`` is one of ``rate-limit``, ``timeout``, ``connection``, ``server``, ``invalid-request``,
    ``auth``, ``not-found``, ``context-length`` or ``unknown``; ``retry_after`` (seconds) is the
    provider's own hint (a 429's ``Retry-After``); ``status`` is the HTTP status, when there was one.
    """

    code = "LOUSHO_PROVIDER_REQUEST_FAILED"
    field_names = ("category", "retry_after", "status")

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = True,
        category: str = "unknown",
        retry_after: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable  # per instance: 5xx retry, 400 does not
        self.category: str = category
        self.retry_after: float | None = retry_after
        self.status: int | None = status


class ProviderRateLimitedError(ProviderError):
    """Raised by a model when its provider answered 429; retried after its ``Retry-After`` (or our backoff)."""

    code = "LOUSHO_PROVIDER_RATE_LIMITED"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message, retryable=True, category="rate-limit", retry_after=retry_after, status=429)


class PropagatingToolError(LoushoError):
    """Raised by a tool to stop the run instead of handing the model an error result.

    The run keeps its last save: results of the batch's other calls that finished stay, the raising call
    has none (it runs again on resume), no further call of the batch starts, and ``last_error`` records this
    error. Not ``retryable`` (the default), the run waits for a person: ``pending()`` lists it parked and
    ``resume()`` tries again; ``retryable=True`` retries it with backoff like a provider outage. Every
    other exception a tool raises stays a result the model sees.
    """

    code = "LOUSHO_TOOL_PROPAGATED"

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable  # chosen by the tool


class HookFailedError(LoushoError):
    """Recorded when a hook of the agent raised: the run keeps its last save and waits (``resume()`` retries)."""

    code = "LOUSHO_HOOK_FAILED"


class ConfigResolverError(LoushoError):
    """Recorded when a dynamic agent's ``resolve`` raised or returned something unusable; nothing ran."""

    code = "LOUSHO_CONFIG_RESOLVER_FAILED"


class StepAttemptsExceededError(LoushoError):
    """Recorded when a step was started too many times in a row without progress; the run is parked."""

    code = "LOUSHO_STEP_ATTEMPTS_EXCEEDED"


class ReconcileFailedError(LoushoError):
    """Recorded when a ``once`` tool's ``reconcile`` raised while reconciling a call its worker died in.

    Retried like any transient failure; once the retry budget (``LOUSHO_RETRY_FOR_S``) is spent, the run waits on
    an approval of kind ``reconcile`` instead of being parked. ``tool_call_id`` names the call.
    """

    code = "LOUSHO_RECONCILE_FAILED"
    retryable = True
    field_names = ("tool_call_id",)

    def __init__(self, message: str, *, tool_call_id: str = "") -> None:
        super().__init__(message)
        self.tool_call_id: str = tool_call_id


class LeadGoneError(LoushoError):
    """Recorded when a sub-agent's run is claimed after its lead was deleted; the run is parked before any model call.

    Nothing would read its result: it stops so that it spends nothing and no tool of it takes effect.
    """

    code = "LOUSHO_LEAD_GONE"


class InputTooLargeError(LoushoError):
    """Raised when input passes a size or depth limit; it is refused before anything is written.

    Also when a run has no room left for input: ``send`` refuses it, and a step that finds input queued
    earlier too large to merge parks the run with it before any model call. ``session_id`` names that run
    and ``size`` the bytes its checkpoint would hold with the input (both None for the other limits).
    """

    code = "LOUSHO_INPUT_TOO_LARGE"
    field_names = ("session_id", "size")

    def __init__(self, message: str, *, session_id: str | None = None, size: int | None = None) -> None:
        super().__init__(message)
        self.session_id: str | None = session_id
        self.size: int | None = size


class StorageError(LoushoError):
    """Raised when a store or the broker cannot be reached or answers with an error."""

    code = "LOUSHO_STORAGE_FAILED"
    retryable = True


class RunTimeoutError(LoushoError):
    """Raised when ``Run.wait`` gives up before the run settled; the run goes on."""

    code = "LOUSHO_OPERATION_TIMEOUT"
    retryable = True


class RunFailedError(LoushoError):
    """Raised by ``Run.wait`` when the run stopped with an error whose code has no class of its own here."""

    def __init__(self, code: str, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.code = code  # carries the stored code verbatim
        self.retryable = retryable


_BY_CODE: dict[str, type[LoushoError]] = {
    cls.code: cls
    for cls in (
        ConfigurationError,
        SessionBusyError,
        AgentNotFoundError,
        ApprovalOrphanedError,
        ApprovalNotFoundError,
        AgentDriftError,
        ResumeToolMissingError,
        CheckpointCorruptError,
        CheckpointFormatError,
        CheckpointNotFoundError,
        StepAttemptsExceededError,
        InputTooLargeError,
        StorageError,
        ApprovalExpiredError,
        HookFailedError,
        ConfigResolverError,
    )
}


def _rebuild(cls: type[LoushoError], message: str, args: tuple[Any, ...]) -> LoushoError:
    """An unpickled error: made without its constructor (which builds messages from fields), then given its state."""
    error = cls.__new__(cls, *args)
    LoushoError.__init__(error, message)
    return error


def from_record(record: dict[str, Any]) -> LoushoError:
    """Rebuild the typed error a run stopped with from its stored ``last_error``."""
    code = str(record.get("code", "LOUSHO_GENERIC_ERROR"))
    message = str(record.get("message", ""))
    retryable = bool(record.get("retryable", False))
    if code == ProviderError.code:
        return ProviderError(message, retryable=retryable)
    if code == PropagatingToolError.code:
        return PropagatingToolError(message, retryable=retryable)
    if code == ProviderRateLimitedError.code:
        limited = ProviderRateLimitedError(message)
        limited.retryable = retryable  # parked after too many attempts
        return limited
    cls = _BY_CODE.get(code)
    if cls is None:
        return RunFailedError(code, message, retryable)
    # Bypass the subclass constructors: they build messages from fields we do not have here.
    error = cls.__new__(cls)
    LoushoError.__init__(error, message)
    return error


#: Why a stored schedule's ticks cannot be computed; the stable prefix of its ``broken_error``.
BrokenReason = Literal[
    "timezone-unknown",  #: the host's time zone database has no such zone
    "cron-invalid",  #: the cron library rejects the stored expression
    "every-invalid",  #: the stored interval is not a positive number of seconds
    "tick-out-of-range",  #: a tick falls outside the years datetime arithmetic can hold
]


class ScheduleNotFoundError(LoushoError):
    """Raised when no schedule has that name."""

    code = "LOUSHO_SCHEDULE_NOT_FOUND"
    field_names = ("name",)

    def __init__(self, name: str) -> None:
        super().__init__(f"no schedule named {name!r}")
        self.name: str = name


class ScheduleBrokenError(LoushoError):
    """Raised by tick arithmetic when a stored schedule's ticks cannot be computed on this host.

    Its time zone is missing from this host's time zone database, the cron library rejects its
    expression, or its interval is out of range (a row written by hand, by another release, or
    checked on a host with a different tz database). The sweep stores ``str(error)`` as the
    schedule's ``broken_error`` and skips it until it is redefined or resumed.
    """

    code = "LOUSHO_SCHEDULE_BROKEN"
    field_names = ("name", "reason")

    def __init__(self, name: str, reason: BrokenReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.name: str = name
        self.reason: BrokenReason = reason


#: The public errors, listed once: ``store``, ``worker`` and ``producer`` re-export exactly these (every error class
#: here but ``FencedOutError``, which stays inside the step machine).
__all__ = [
    "AgentDriftError",
    "AgentNotFoundError",
    "ApprovalExpiredError",
    "ApprovalNotFoundError",
    "ApprovalOrphanedError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ConfigResolverError",
    "ConfigurationError",
    "HookFailedError",
    "InputTooLargeError",
    "LeadGoneError",
    "LoushoError",
    "PropagatingToolError",
    "ProviderError",
    "ProviderRateLimitedError",
    "ReconcileFailedError",
    "ResumeToolMissingError",
    "RunFailedError",
    "RunTimeoutError",
    "ScheduleBrokenError",
    "ScheduleNotFoundError",
    "SessionAwaitingApprovalError",
    "SessionBusyError",
    "SessionIdInvalidError",
    "StepAttemptsExceededError",
    "StorageError",
]
