"""Every error of the family survives pickling (prefork pool processes hand failures to the worker's parent that
way, and Flower shows what arrives) and Celery's JSON result backend (``cls(*args)`` on the caller's side), with its
type, code and message, the message once."""

from __future__ import annotations

import pickle

import pytest
from celery import Celery
from celery.backends.base import BaseBackend

from devkit.errors import EmbeddedError
from store import errors

#: One instance of every error class, as the code raises it.
SAMPLES: list[errors.LoushoError] = [
    errors.ConfigurationError("LOUSHO_QUEUE is empty", variable="LOUSHO_QUEUE"),
    errors.SessionIdInvalidError("has space", "only A-Za-z0-9_.- are allowed"),
    errors.SessionBusyError("order-7"),
    errors.SessionAwaitingApprovalError("order-7", "ap-1"),
    errors.FencedOutError("order-7", 4),
    errors.AgentNotFoundError("shpo", ["shop", "support"]),
    errors.ApprovalOrphanedError("its run was deleted", approval_id="ap-1", session_id="order-7"),
    errors.ApprovalNotFoundError("no pending approval 'ap-9'"),
    errors.ApprovalExpiredError("approval 'ap-1' expired"),
    errors.AgentDriftError("the agent changed"),
    errors.ResumeToolMissingError("tool 'ship' is gone"),
    errors.CheckpointCorruptError("checkpoint of 'order-7' cannot be read"),
    errors.CheckpointFormatError("order-7", 9, 3),
    errors.CheckpointNotFoundError("run 'order-7' is not stored"),
    errors.ProviderError("upstream 502", retryable=True, category="server", status=502),
    errors.ProviderRateLimitedError("429 from the provider", retry_after=2.5),
    errors.PropagatingToolError("stop the run", retryable=True),
    errors.HookFailedError("hook raised"),
    errors.ConfigResolverError("resolve raised"),
    errors.StepAttemptsExceededError("step started 6 times"),
    errors.ReconcileFailedError("reconcile of the charge call c1 raised ValueError", tool_call_id="c1"),
    errors.LeadGoneError("the lead of 'order-7.task-0123456789abcdef' was deleted"),
    errors.InputTooLargeError("input over 1 MiB"),
    errors.StorageError("broker unavailable: OSError"),
    errors.RunTimeoutError("run 'order-7' did not settle within 3 s"),
    errors.RunFailedError("LOUSHO_SOMETHING_NEW", "a newer release's error", True),
    errors.ScheduleNotFoundError("daily"),
    errors.ScheduleBrokenError("daily", "cron-invalid", "bad minute"),
    EmbeddedError("redis-server did not start: see .lousho/redis.log"),
]


def _classes(root: type[errors.LoushoError]) -> set[type[errors.LoushoError]]:
    found = set()
    for sub in root.__subclasses__():
        found |= {sub, *_classes(sub)}
    return found


def test_every_error_class_has_a_sample() -> None:
    assert {type(error) for error in SAMPLES} == _classes(errors.LoushoError)


@pytest.mark.parametrize("error", SAMPLES, ids=lambda error: type(error).__name__)
def test_an_error_survives_pickling_with_its_code_message_and_fields(error: errors.LoushoError) -> None:
    again = pickle.loads(pickle.dumps(error))

    assert type(again) is type(error)
    assert (again.code, again.retryable, str(again), again.message) == (
        error.code,
        error.retryable,
        str(error),
        error.message,
    )
    assert again.fields == error.fields
    assert repr(again) == repr(error) and repr(error).count(error.message) == 1


@pytest.mark.parametrize("error", SAMPLES, ids=lambda error: type(error).__name__)
def test_an_error_survives_celery_s_json_result_backend_with_its_code_and_message_once(
    error: errors.LoushoError,
) -> None:
    backend = BaseBackend(app=Celery("caller", set_as_current=False), serializer="json")

    again = backend.exception_to_python(backend.prepare_exception(error))

    assert type(again) is type(error)
    assert (again.code, str(again)) == (error.code, str(error))


def test_the_public_errors_are_listed_once_and_every_package_exports_exactly_them() -> None:
    import producer
    import store
    import worker

    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.LoushoError)
    }
    assert set(errors.__all__) == classes - {"FencedOutError"}
    for package in (store, worker, producer):
        exported = {name for name in package.__all__ if name in classes}
        assert exported == set(errors.__all__), package.__name__
        assert all(getattr(package, name) is getattr(errors, name) for name in errors.__all__)
