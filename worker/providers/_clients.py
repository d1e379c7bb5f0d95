"""SDK clients for the real providers.

Lazy import with an install hint, keys, one client per process, reading a streamed answer event by
event (cancellable between events), and the translation of SDK exceptions into ``ProviderError``.

A client holds a connection pool, which must not cross a ``fork`` (Celery's prefork pool forks
after the agents may have been imported), so each process builds its own on first use.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from store import errors
from worker.providers import _failures, base

#: Seconds a model request may take; keep it below ``LOUSHO_STEP_SOFT_TIME_LIMIT_S`` (240 by default).
DEFAULT_TIMEOUT_S = 60.0
#: Stands in for a key on local OpenAI-compatible servers that do not check one.
NO_KEY = "not-needed"

#: Client options that the models set themselves; the SDK's own retries stay off.
_RESERVED_CLIENT_OPTIONS = frozenset({"api_key", "base_url", "max_retries", "timeout"})
_SDK_REQUEST_OPTIONS = frozenset({"extra_headers", "extra_query", "extra_body"})
_SECRET_HEADER_WORDS = ("auth", "key", "token", "secret")


def import_sdk(module: str, model_class: str) -> ModuleType:
    """Import an optional provider SDK.

    Raises:
        ConfigurationError: the SDK is not installed (the message says which extra to install).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise errors.ConfigurationError(
            f"{model_class} needs the {module!r} package: pip install 'lousho-worker[{module}]'"
        ) from exc


def resolve_key(given: str | None, env_var: str, base_url: str | None, model_class: str) -> str:
    """The API key: ``given``, else ``env_var``; a placeholder for a custom ``base_url`` without one.

    Raises:
        ConfigurationError: no key anywhere and no ``base_url`` (the hosted API always needs one).
    """
    key = given or os.environ.get(env_var) or ""
    if key:
        return key
    if base_url:
        return NO_KEY
    raise errors.ConfigurationError(f"{model_class} needs an API key: set {env_var} or pass api_key=")


def request_options(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for an SDK ``create`` call carrying ``settings``.

    Settings are request body fields, sent as given through ``extra_body``, so any field the
    server knows works whatever the installed SDK's signature; ``extra_headers``, ``extra_query``
    and ``extra_body`` keep their SDK meaning.
    """
    body = {k: v for k, v in settings.items() if k not in _SDK_REQUEST_OPTIONS}
    options = {k: v for k, v in settings.items() if k in _SDK_REQUEST_OPTIONS}
    if body:
        options["extra_body"] = {**body, **(options.get("extra_body") or {})}
    return options


def check_timeout(timeout: float) -> float:
    """``timeout`` as seconds.

    Raises:
        ConfigurationError: not a positive number.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise errors.ConfigurationError("timeout must be a positive number of seconds")
    return float(timeout)


def client_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Extra SDK client options (``organization``, ``default_headers``…).

    Raises:
        ConfigurationError: an option the model sets itself (key, URL, retries, timeout).
    """
    chosen = dict(options or {})
    clashing = sorted(_RESERVED_CLIENT_OPTIONS & chosen.keys())
    if clashing:
        raise errors.ConfigurationError(
            f"client_options may not set {', '.join(clashing)}: use the model's own arguments"
        )
    return chosen


def header_secrets(options: Mapping[str, Any]) -> list[str]:
    """Values of default headers that look like credentials (scrubbed like the key)."""
    headers = options.get("default_headers") or {}
    return [
        str(value) for name, value in headers.items() if any(word in str(name).lower() for word in _SECRET_HEADER_WORDS)
    ]


def plain_settings(settings: Mapping[str, Any], secrets: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The settings a spec may show, as JSON, and the names of those it may not.

    Headers and query parameters may carry credentials, so they are never shown; nor is a value that is
    not JSON or that holds one of ``secrets``.
    """
    shown: dict[str, Any] = {}
    left_out: list[str] = []
    for name, value in settings.items():
        if name in ("extra_headers", "extra_query"):
            left_out.append(name)
            continue
        try:
            text = json.dumps(value, allow_nan=False, sort_keys=True)
        except (TypeError, ValueError):
            left_out.append(name)
            continue
        if any(secret and secret in text for secret in secrets):
            left_out.append(name)
            continue
        shown[name] = json.loads(text)
    return shown, left_out


class ProcessClient:
    """One SDK client per process, built on first use by ``build``."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._client: Any = None

    def get(self) -> Any:
        """This process's client (a forked child builds a fresh one)."""
        with self._lock:
            if self._pid != os.getpid():
                self._client = self._build()
                self._pid = os.getpid()
            return self._client

    def close(self) -> None:
        """Close this process's client, if built; the next ``get`` builds another."""
        with self._lock:
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client = None
            self._pid = None


def translate(
    provider: str, sdk: ModuleType, exc: Exception, *, timeout: float, request_id_header: str, secrets: list[str]
) -> errors.ProviderError:
    """The ``ProviderError`` for an exception of the ``openai`` or ``anthropic`` SDK (both share one shape).

    Timeouts and connection failures are retryable; HTTP failures are classified by status and body.
    """
    if isinstance(exc, sdk.APITimeoutError):
        return _failures.timed_out(provider, timeout)
    if isinstance(exc, sdk.APIStatusError):
        headers = exc.response.headers
        if exc.status_code < 400:  # an error event inside a stream that had begun with a 200
            return _failures.from_stream_error(
                provider, exc.body, request_id=headers.get(request_id_header), secrets=secrets
            )
        return _failures.from_status(
            provider, exc.status_code, headers, exc.body, request_id=headers.get(request_id_header), secrets=secrets
        )
    if isinstance(exc, sdk.APIConnectionError):
        cause = exc.__cause__
        detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
        return _failures.unreachable(provider, detail, secrets)
    body = getattr(exc, "body", None)
    if type(exc) is sdk.APIError and body is not None:  # an error chunk inside a stream (OpenAI)
        return _failures.from_stream_error(provider, body, secrets=secrets)
    return _failures.unexpected(provider, f"{type(exc).__name__}: {exc}", secrets)


def _http_errors(stream: Any) -> tuple[Any, Any]:
    """(transport error, timeout error) classes of the HTTP library under an SDK stream.

    The ``anthropic`` SDK lets these through while a stream is read (``openai`` wraps them); which
    library it is (``httpx`` or its successor) depends on the SDK's version, so it is read off the
    stream's response.
    """
    library = sys.modules[type(stream.response).__module__.partition(".")[0]]
    return library.TransportError, library.TimeoutException


class SDKModel:
    """What the SDK-backed models share: settings checks, the key, one client per process, repr, streams."""

    #: Usage is what the provider billed, so the step executor keeps it even if the turn is lost.
    reports_usage = True
    #: Set by each provider: its name, SDK module, client class and root exception, key variable,
    #: reserved settings, and the response header that names a request.
    provider: str
    sdk_module: str
    client_class: str
    sdk_error: str
    api_key_env: str
    reserved_settings: frozenset[str]
    request_id_header: str

    def _configure(
        self,
        model: str,
        base_url: str | None,
        api_key: str | None,
        timeout: float,
        client_options_given: Mapping[str, Any] | None,
        settings: Mapping[str, Any],
    ) -> None:
        name = type(self).__name__
        if not model or not isinstance(model, str):
            raise errors.ConfigurationError(f"{name} needs a model name")
        clashing = sorted(self.reserved_settings & settings.keys())
        if clashing:
            raise errors.ConfigurationError(f"{name} settings may not set {', '.join(clashing)}")
        self._sdk = import_sdk(self.sdk_module, name)
        self.model = model
        self.model_id = f"{self.provider}:{model}"
        self.base_url = base_url
        self.timeout = check_timeout(timeout)
        self.settings = dict(settings)
        self._request_options = request_options(self.settings)
        self._options = client_options(client_options_given)
        self._key = resolve_key(api_key, self.api_key_env, base_url, name)
        self._secrets = [self._key, *header_secrets(self._options)]
        self._client = ProcessClient(self._build_client)

    def spec(self) -> dict[str, Any]:
        """What the model is, as JSON without secrets: enough to build it again (``worker.providers.specs``).

        The key, client options and request headers or query never appear. A part that cannot be written
        down (client options, headers, a query, a setting that is not JSON or holds a secret) is named in
        ``left_out``, and a model whose spec has one is not built again from its spec alone.
        """
        spec: dict[str, Any] = {"provider": self.provider, "model_id": self.model_id}
        if self.base_url:
            spec["base_url"] = self.base_url
        if self.timeout != DEFAULT_TIMEOUT_S:
            spec["timeout"] = self.timeout
        settings, left_out = plain_settings(self.settings, self._secrets)
        if settings:
            spec["settings"] = settings
        if self._options:
            left_out.append("client_options")
        if left_out:
            spec["left_out"] = sorted(left_out)
        return spec

    def __repr__(self) -> str:
        """The model and its endpoint; never the key."""
        where = f", base_url={self.base_url!r}" if self.base_url else ""
        return f"{type(self).__name__}({self.model!r}{where})"

    def _build_client(self) -> Any:
        factory = getattr(self._sdk, self.client_class)
        return factory(api_key=self._key, base_url=self.base_url, timeout=self.timeout, max_retries=0, **self._options)

    def close(self) -> None:
        """Close this process's HTTP connections (the next call opens new ones)."""
        self._client.close()

    def _translate(self, exc: Exception) -> errors.ProviderError:
        return translate(
            self.provider,
            self._sdk,
            exc,
            timeout=self.timeout,
            request_id_header=self.request_id_header,
            secrets=self._secrets,
        )

    def _stream(
        self, open_stream: Callable[[], Any], listener: base.Listener, handle: Callable[[dict[str, Any]], None]
    ) -> None:
        """Open a stream with ``open_stream`` and hand each of its events, as JSON, to ``handle``.

        ``listener.cancelled`` is checked before the request and after each event; once it is set
        the stream is closed, and nothing more read. The SDK's timeout bounds each read; the stream
        as a whole must also end within ``timeout``, as one plain request must.

        Raises:
            ModelCallCancelled: the listener cancelled the call.
            ProviderError: the request failed, the stream carried an error, broke off or took too long.
        """
        sdk_error = getattr(self._sdk, self.sdk_error)
        if listener.cancelled.is_set():
            raise base.ModelCallCancelled(f"{self.provider}: cancelled before the request")
        deadline = time.monotonic() + self.timeout
        try:
            stream = open_stream()
        except sdk_error as exc:
            # ``from None``: the SDK error holds the request, whose headers carry the key.
            raise self._translate(exc) from None
        transport_error, timeout_error = _http_errors(stream)
        with contextlib.closing(stream):
            events = iter(stream)
            while True:
                if listener.cancelled.is_set():
                    raise base.ModelCallCancelled(f"{self.provider}: cancelled while the answer streamed")
                if time.monotonic() > deadline:
                    raise _failures.timed_out(self.provider, self.timeout)
                try:
                    event = next(events, None)
                except sdk_error as exc:
                    raise self._translate(exc) from None
                except timeout_error:
                    raise _failures.timed_out(self.provider, self.timeout) from None
                except transport_error as exc:
                    raise _failures.unreachable(self.provider, f"{type(exc).__name__}: {exc}", self._secrets) from None
                except ValueError as exc:
                    raise _failures.unexpected(
                        self.provider, f"unreadable stream event: {exc}", self._secrets
                    ) from None
                if event is None:
                    return
                dump = getattr(event, "model_dump", None)
                if dump is None:
                    raise _failures.unexpected(self.provider, f"not a stream event: {str(event)[:200]}", self._secrets)
                handle(dump(mode="json", warnings=False))
