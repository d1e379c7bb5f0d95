"""The one error family of Lousho Worker: every error has a stable ``code`` and ``retryable``.

Producers, workers and the CLI raise and catch these; nothing here does I/O.
"""

from __future__ import annotations

from typing import Any, ClassVar


class LoushoError(Exception):
    """Root of every error the project raises on purpose.

    ``code`` is stable API (callers branch on it, never on the message) and ``retryable``
    says whether trying the same thing again later can succeed.
    """

    code: ClassVar[str] = "LOUSHO_GENERIC_ERROR"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)

    def to_record(self) -> dict[str, Any]:
        """The ``last_error`` shape stored on a checkpoint."""
        return {"code": self.code, "message": self.message, "retryable": self.retryable}


class ConfigurationError(LoushoError):
    """A setting, option or argument is missing or has a value we cannot use."""

    code = "LOUSHO_CONFIG_INVALID"


class SessionIdInvalidError(LoushoError):
    """A run id breaks the id rules (1-200 of ``A-Za-z0-9_.-``, no edge dot, no reserved suffix)."""

    code = "LOUSHO_SESSION_ID_INVALID"

    def __init__(self, session_id: object, reason: str) -> None:
        shown = repr(session_id)[:80]
        super().__init__(f"invalid session id {shown}: {reason}", session_id=session_id)


class SessionBusyError(LoushoError):
    """Another worker or process holds the run's lease right now; nothing was run."""

    code = "LOUSHO_SESSION_BUSY"
    retryable = True

    def __init__(self, session_id: str) -> None:
        super().__init__(f"run {session_id!r} is running elsewhere (lease held)", session_id=session_id)


class SessionAwaitingApprovalError(LoushoError):
    """New input or a resume reached a run paused on an approval; decide the approval first."""

    code = "LOUSHO_SESSION_AWAITING_APPROVAL"

    def __init__(self, session_id: str, approval_id: str | None) -> None:
        super().__init__(
            f"run {session_id!r} waits on approval {approval_id!r}: resolve it first",
            session_id=session_id,
            approval_id=approval_id,
        )


class FencedOutError(LoushoError):
    """A save carried a fencing token older than the run's: another holder took over."""

    code = "LOUSHO_SESSION_BUSY"
    retryable = True

    def __init__(self, session_id: str, fence: int) -> None:
        super().__init__(f"save of run {session_id!r} with fence {fence} refused: lease lost",
                         session_id=session_id, fence=fence)


class AgentNotFoundError(LoushoError):
    """No agent of that name is registered with the workers."""

    code = "LOUSHO_AGENT_NOT_FOUND"

    def __init__(self, name: str, known: list[str] | None = None) -> None:
        listed = f"; known agents: {', '.join(sorted(known))}" if known else ""
        super().__init__(f"unknown agent {name!r}{listed}", agent=name)


class ApprovalOrphanedError(LoushoError):
    """The approval's run checkpoint was deleted, pruned or replaced; it was withdrawn."""

    code = "LOUSHO_APPROVAL_ORPHANED"


class ApprovalNotFoundError(LoushoError):
    """No pending approval has that id (unknown, or already decided)."""

    code = "LOUSHO_APPROVAL_NOT_FOUND"


class AgentDriftError(LoushoError):
    """The resuming agent differs from the one that saved the checkpoint (``on_agent_drift='error'``)."""

    code = "LOUSHO_AGENT_DRIFT"


class ResumeToolMissingError(LoushoError):
    """A pending tool call names a tool the agent no longer has."""

    code = "LOUSHO_RESUME_TOOL_MISSING"


class CheckpointCorruptError(LoushoError):
    """A stored checkpoint cannot be read; delete it to start over."""

    code = "LOUSHO_CHECKPOINT_CORRUPT"


class CheckpointFormatError(LoushoError):
    """A stored checkpoint was written in a newer format than this worker reads (a rolling deploy is
    under way); the step is handed back to a worker of the newer release."""

    code = "LOUSHO_CHECKPOINT_FORMAT_UNKNOWN"
    retryable = True

    def __init__(self, session_id: str, found: int, supported: int) -> None:
        super().__init__(f"checkpoint of run {session_id!r} has format {found}; this worker reads up to {supported}",
                         session_id=session_id, found=found, supported=supported)


class CheckpointNotFoundError(LoushoError):
    """The asked-for checkpoint or history step is not stored."""

    code = "LOUSHO_CHECKPOINT_NOT_FOUND"


class ProviderError(LoushoError):
    """The model provider failed; ``retryable`` follows the failure's class.

    ``category`` is one of ``rate-limit``, ``timeout``, ``connection``, ``server``, ``invalid-request``,
    ``auth``, ``not-found``, ``context-length`` or ``unknown``; ``retry_after`` (seconds) is the
    provider's own hint (a 429's ``Retry-After``).
    """

    code = "LOUSHO_PROVIDER_REQUEST_FAILED"

    def __init__(self, message: str, *, retryable: bool = True, category: str = "unknown",
                 retry_after: float | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable  # type: ignore[misc]  # per instance: 5xx retry, 400 does not
        self.category = category
        self.retry_after = retry_after
        self.status = status


class ProviderRateLimitedError(ProviderError):
    """The provider answered 429; retried after its ``Retry-After`` (or our backoff)."""

    code = "LOUSHO_PROVIDER_RATE_LIMITED"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message, retryable=True, category="rate-limit", retry_after=retry_after, status=429)


class StepAttemptsExceededError(LoushoError):
    """A step was started too many times in a row without progress; the run is parked."""

    code = "LOUSHO_STEP_ATTEMPTS_EXCEEDED"


class InputTooLargeError(LoushoError):
    """Input passed a size or depth limit and was refused before anything was written."""

    code = "LOUSHO_INPUT_TOO_LARGE"


class StorageError(LoushoError):
    """A store could not be reached or answered with an error."""

    code = "LOUSHO_STORAGE_FAILED"
    retryable = True


class RunTimeoutError(LoushoError):
    """``Run.wait`` gave up before the run settled; the run goes on."""

    code = "LOUSHO_OPERATION_TIMEOUT"
    retryable = True


class RunFailedError(LoushoError):
    """The run stopped with an error whose code has no class of its own here."""

    def __init__(self, code: str, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.code = code  # type: ignore[misc]  # carries the stored code verbatim
        self.retryable = retryable  # type: ignore[misc]


_BY_CODE: dict[str, type[LoushoError]] = {
    cls.code: cls
    for cls in (
        ConfigurationError, SessionBusyError, AgentNotFoundError, ApprovalOrphanedError,
        ApprovalNotFoundError, AgentDriftError, ResumeToolMissingError, CheckpointCorruptError,
        CheckpointFormatError, CheckpointNotFoundError, StepAttemptsExceededError, InputTooLargeError, StorageError,
    )
}


def from_record(record: dict[str, Any]) -> LoushoError:
    """Rebuild the typed error a run stopped with from its stored ``last_error``."""
    code = str(record.get("code", "LOUSHO_GENERIC_ERROR"))
    message = str(record.get("message", ""))
    retryable = bool(record.get("retryable", False))
    if code == ProviderError.code:
        return ProviderError(message, retryable=retryable)
    if code == ProviderRateLimitedError.code:
        limited = ProviderRateLimitedError(message)
        limited.retryable = retryable  # type: ignore[misc]  # parked after too many attempts
        return limited
    cls = _BY_CODE.get(code)
    if cls is None:
        return RunFailedError(code, message, retryable)
    # Bypass the subclass constructors: they build messages from fields we do not have here.
    error = cls.__new__(cls)
    LoushoError.__init__(error, message)
    return error
