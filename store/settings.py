"""Settings from the environment (prefix ``LOUSHO_``), built once at the edge and passed down."""

from __future__ import annotations

from datetime import timedelta

from pydantic import SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from store import errors
from store.model_limit import ModelLimit, parse_fairness_weights, parse_model_limits


class Settings(BaseSettings):
    """Everything a worker, producer or CLI needs to reach the services and pace recovery."""

    model_config = SettingsConfigDict(env_prefix="LOUSHO_", extra="ignore")

    database_url: str = "postgresql://127.0.0.1:5432/lousho"
    #: Server-side prepared statements for the repeated statements of a step (psycopg prepares a statement
    #: once it has run a few times on a connection). Turn off behind PgBouncer in transaction mode, where a
    #: statement prepared on one server connection is not there on the next.
    database_prepared_statements: bool = True
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None
    #: A Celery result backend URL for ``lousho.start``'s answers (the run id, or the error that refused the start)
    #: on Lousho's own app (``celery -A worker``): callers read them with the same backend. Unset: none are
    #: stored. Lousho's other tasks never store results; an app given to ``install`` keeps its own backend.
    result_backend: str | None = None
    #: With a ``sentinel://`` Redis or broker URL: the name Sentinel knows the master by (``store.redis_client``).
    redis_sentinel_master: str | None = None
    #: The Sentinel nodes' own password, when they have one (the URL's password is the master's).
    redis_sentinel_password: SecretStr | None = None
    agents: str = ""
    #: Comma-separated modules whose ``beat_schedule`` dict (entries made by ``worker.starts.beat_entry``, or any
    #: Celery beat entry) a beat of Lousho's app, or of an app given to ``install``, adds to its own at start.
    beat_modules: str = ""
    lease_ttl_ms: int = 30_000
    lease_renew_ms: int = 10_000
    recover_interval_s: float = 30.0
    #: How often beat sends the I19 checker (``lousho.doctor``, ``store.doctor``), which publishes
    #: ``lousho_runs_unexplained``; 0 sends none (``lousho doctor`` still looks when asked).
    doctor_interval_s: float = 60.0
    history_limit: int = 50
    #: Whether saves write the runs' durable events (``run.events()``, the SSE route, ``lousho watch``). Turn
    #: off only to measure what they cost: without them a consumer waits for nothing.
    events: bool = True
    #: Starts of one step in a row that never finished (the worker died) before the run is parked: the
    #: poison-pill guard. Failures a step records (a provider outage) do not count here.
    max_attempts: int = 5
    #: Tool calls given up on past their timeout that still run (Python cannot stop a thread) that a prefork pool
    #: process keeps before it exits after its step, for Celery to start a fresh one; their threads are replaced
    #: meanwhile, so calls never wait on them.
    hung_tool_calls_max: int = 16
    #: Seconds after its input a run whose agent name no worker has ever registered (a typo) is parked with
    #: ``LOUSHO_AGENT_NOT_FOUND``; an agent some worker registered waits for a worker within ``retry_for_s``.
    agent_grace_s: float = 600.0
    #: Longest backoff of our own before a failed step is retried (a provider's Retry-After may ask for more).
    retry_backoff_max_s: float = 30.0
    #: How long a run keeps retrying transient failures (provider outages, a deploy in progress) before it
    #: is parked; long enough to ride out a provider incident.
    retry_for_s: float = 6 * 3600.0
    #: Steps of one run a step task takes in a row under the lease it holds (1: one step per task, each next step
    #: sent through the broker). Above 1, a task goes on with its run's next step itself until ``continue_ms``
    #: has passed since it began or this many steps were taken, and stops sooner at a pause, a child run, a
    #: handoff, a retry's countdown, an abort or a steer; every step is still claimed and saved fenced on its own.
    continue_steps: int = 1
    #: The time slice of a task that chains steps, in ms: no next step starts after it (a run queued behind this
    #: one waits at most this much longer). At most a tenth of the soft step time limit, so the step that starts
    #: last keeps nine tenths of it.
    continue_ms: int = 100
    step_soft_time_limit_s: float = 240.0
    step_time_limit_s: float = 300.0
    visibility_timeout_s: int = 3600
    queue: str = "lousho"
    #: Celery remote control (pidbox). Flower needs it; anyone who can write to the broker can then shut
    #: workers down, so turn it off where Flower is not used.
    remote_control: bool = True
    #: Celery task events (worker and sender): Flower lists steps, including the ones that ran or waited in a
    #: queue before it started. Off only to measure what they cost.
    task_events: bool = True
    #: Port of the worker's Prometheus ``/metrics`` (served by the worker's parent for all its pool processes);
    #: unset: no port. Needs the ``metrics`` extra.
    metrics_port: int | None = None
    #: Folder of the prefork processes' metric files (prometheus-client's multiprocess mode); made and emptied
    #: by the worker's parent at start. Unset: a folder under the system's temporary folder, per worker.
    metrics_dir: str | None = None
    #: File the worker's parent touches every few seconds while its consumer consumes (``worker.probes``); the
    #: liveness probe ``python -m worker.probes check`` fails once it grows old. Unset: no file.
    heartbeat_file: str | None = None
    #: OpenTelemetry traces of runs (one trace per run input across its steps); needs the ``otel`` extra and
    #: the usual ``OTEL_*`` exporter settings.
    tracing: bool = False
    #: ``text`` or ``json``: JSON log lines carry the run's id, agent, seq, step and the Celery task id as fields.
    log_format: str = "text"
    #: Period of the beat's schedule sweep; ticks are claimed in Postgres, so any number of beats is safe.
    schedule_interval_s: float = 5.0
    #: How late a tick may still fire as itself (at least 3 periods are used); older ticks follow catch_up.
    schedule_grace_s: float = 60.0
    #: Days a finished run is kept after its last save, with its history, events, input and approvals; the beat's
    #: retention sweep prunes older ones (``store.retention``). Unset: runs are kept forever.
    retention_days: float | None = None
    #: Days webhook delivery ids, GitHub body hashes and claimed schedule ticks are kept (a delivery id always as
    #: long as its run), at least ``retention_days``. Unset: 4 x ``retention_days``, at least 30. Without
    #: ``retention_days`` they are kept forever.
    retention_keys_days: float | None = None
    #: Period of the beat's retention sweep (each pass does a bounded amount of work).
    retention_interval_s: float = 300.0
    # The webhook receiver's fields; ``producer.http.config.WebhookConfig.from_settings`` interprets them.
    #: Standard Webhooks secrets (``whsec_...``), comma-separated: two of them during a rotation; an item
    #: ``agent=whsec_...`` verifies only that agent's deliveries.
    webhook_secrets: SecretStr = SecretStr("")
    #: GitHub webhook secrets, comma-separated, for ``X-Hub-Signature-256``; empty turns GitHub intake off.
    github_webhook_secrets: SecretStr = SecretStr("")
    #: Bearer key of ``GET /runs/{id}`` and ``POST /approvals/{id}``; unset or empty refuses both routes.
    api_key: SecretStr | None = None
    #: Named API keys, comma-separated ``name=key[;read][;agents=a|b]`` (``producer.http.access``): read-only
    #: keys and keys limited to some agents' runs, on the JSON routes, the event stream and the browser pages.
    api_keys: SecretStr = SecretStr("")
    #: The HTTP server's parts: webhook intake (``POST /webhooks/{agent}``) and the run pages (``/ui``; only with
    #: an API key set). Either may be turned off.
    webhooks_enabled: bool = True
    ui_enabled: bool = True
    #: Key that signs the pages' session cookies; unset: derived from the API keys (changing a key signs
    #: everyone out). Set it when several servers share sessions behind one address.
    ui_session_secret: SecretStr | None = None
    #: Hours a page session lasts after sign-in.
    ui_session_hours: float = 12.0
    #: A header set by an authenticating proxy (OpenID Connect, for example ``X-Forwarded-Email``) that signs a
    #: person in as its value, with ``ui_proxy_access`` (``read``, ``agents=a|b``, both with ``;``, or empty:
    #: full access). Only behind a proxy that sets it on every request and drops it from clients' requests.
    ui_proxy_user_header: str | None = None
    ui_proxy_access: str = ""
    #: The proxy's addresses, comma-separated: the header counts only on requests that come straight from one of
    #: them (anyone reaching the server past the proxy could set it). Empty: the header is never trusted.
    ui_proxy_addresses: str = ""
    #: Flower's address (``http://flower.internal:5555``): a run's steps link to their tasks there.
    flower_url: str | None = None
    #: The address the run pages are served at (``https://lousho.internal``): ``lousho show`` links to a run's page.
    ui_url: str | None = None
    #: Largest webhook body accepted, in bytes (413 beyond).
    webhook_max_body_bytes: int = 1024 * 1024
    #: ``agent=/json/pointer`` pairs: the part of a webhook body that becomes that agent's input.
    webhook_input: str = ""
    #: Where a webhook delivery's fairness key is read, per agent (``*``: every agent): ``agent=header:X-Tenant``
    #: (a request header) or ``agent=/json/pointer`` (a field of the body), comma-separated. Unset: no key.
    webhook_fairness: str = ""

    #: Limits shared by the whole fleet, per provider account or model (``store.model_limit``):
    #: ``"openai-main=concurrent:8,rpm:500,tpm:200000;anthropic=concurrent:4"``. A key named here wins over the
    #: numbers agents give it in code.
    model_limits: str = ""
    #: Shares of fairness keys when model slots are contended: ``"acme=2,globex=3"`` (unnamed keys: 1).
    fairness_weights: str = ""

    @field_validator("history_limit")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0")
        return value

    @field_validator("max_attempts")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be >= 1 (0 would park every run at its first step)")
        return value

    @field_validator("hung_tool_calls_max")
    @classmethod
    def _hung_calls(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be >= 1 (0 would end a pool process at its first hung call)")
        return value

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        if value not in ("text", "json"):
            raise ValueError("must be text or json")
        return value

    @field_validator("metrics_port")
    @classmethod
    def _port(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 65535:
            raise ValueError("must be a TCP port (0 picks a free one)")
        return value

    @field_validator("retention_days", "retention_keys_days")
    @classmethod
    def _positive_days(cls, value: float | None) -> float | None:
        if value is not None and not value > 0:
            raise ValueError("must be > 0 (unset keeps everything)")
        return value

    @field_validator("doctor_interval_s")
    @classmethod
    def _not_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError("must be >= 0 (0 turns the beat's looks off)")
        return value

    @field_validator(
        "retry_backoff_max_s",
        "retry_for_s",
        "recover_interval_s",
        "schedule_interval_s",
        "schedule_grace_s",
        "retention_interval_s",
        "agent_grace_s",
    )
    @classmethod
    def _positive(cls, value: float) -> float:
        if not value > 0:
            raise ValueError("must be > 0")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> Settings:
        if self.lease_renew_ms <= 0 or self.lease_renew_ms * 2 > self.lease_ttl_ms:
            raise errors.ConfigurationError("LOUSHO_LEASE_RENEW_MS must be > 0 and at most half the lease TTL")
        if self.continue_steps < 1:
            raise errors.ConfigurationError(
                "LOUSHO_CONTINUE_STEPS must be at least 1", variable="LOUSHO_CONTINUE_STEPS"
            )
        if self.continue_ms <= 0 or self.continue_ms > self.step_soft_time_limit_s * 100:
            raise errors.ConfigurationError(
                "LOUSHO_CONTINUE_MS must be > 0 and at most a tenth of the soft step time limit",
                variable="LOUSHO_CONTINUE_MS",
            )
        if self.step_soft_time_limit_s >= self.step_time_limit_s:
            raise errors.ConfigurationError("the soft step time limit must be below the hard one")
        if self.visibility_timeout_s < 2 * self.step_time_limit_s:
            raise errors.ConfigurationError("LOUSHO_VISIBILITY_TIMEOUT_S must be at least twice the step time limit")
        self.model_limit_table  # noqa: B018  # refused at start, not at the first model call
        self.fairness_weight_table  # noqa: B018
        if (
            self.retention_days is not None
            and self.retention_keys_days is not None
            and self.retention_keys_days < self.retention_days
        ):
            raise errors.ConfigurationError(
                "LOUSHO_RETENTION_KEYS_DAYS must be at least LOUSHO_RETENTION_DAYS: a"
                " pruned run's delivery id must still stop a redelivery",
                variable="LOUSHO_RETENTION_KEYS_DAYS",
            )
        return self

    @property
    def sqlalchemy_url(self) -> str:
        """The database URL with the psycopg 3 driver named, as SQLAlchemy wants it."""
        url = self.database_url
        for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
            if url.startswith(prefix):
                return "postgresql+psycopg://" + url[len(prefix) :]
        raise errors.ConfigurationError("LOUSHO_DATABASE_URL must be a postgresql:// URL")

    @property
    def schedule_grace(self) -> timedelta:
        """How late a tick may still fire as itself: ``schedule_grace_s``, and never under three sweep periods.

        A tick is normally up to one period late, and a beat restarting during a deploy must not turn on-time
        ticks into missed ones.
        """
        return timedelta(seconds=max(self.schedule_grace_s, 3 * self.schedule_interval_s))

    @property
    def broker(self) -> str:
        """The Celery broker URL: ``LOUSHO_BROKER_URL`` or the Redis URL."""
        return self.broker_url or self.redis_url

    def agent_queue(self, agent: str | None) -> str:
        """The queue that carries the steps of ``agent``'s runs (the shared queue when unknown).

        Workers consume the queues of the agents they load, so during a rolling deploy a step only
        reaches a worker that can run it; the shared queue stays consumed by every worker.
        """
        return f"{self.queue}.{agent}" if agent else self.queue

    @property
    def model_limit_table(self) -> dict[str, ModelLimit]:
        """``LOUSHO_MODEL_LIMITS`` by key.

        Raises:
            ConfigurationError: it does not parse.
        """
        return parse_model_limits(self.model_limits)

    @property
    def fairness_weight_table(self) -> dict[str, int]:
        """``LOUSHO_FAIRNESS_WEIGHTS`` by fairness key.

        Raises:
            ConfigurationError: it does not parse.
        """
        return parse_fairness_weights(self.fairness_weights)

    @property
    def agent_modules(self) -> list[str]:
        """Modules named in ``LOUSHO_AGENTS``."""
        return [name.strip() for name in self.agents.split(",") if name.strip()]

    @property
    def beat_module_names(self) -> list[str]:
        """Modules named in ``LOUSHO_BEAT_MODULES``."""
        return [name.strip() for name in self.beat_modules.split(",") if name.strip()]


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment (and ``overrides``), with errors that name the variable.

    Raises:
        ConfigurationError: a variable is malformed or out of range; the message names it and
            never repeats its value (it may be a secret).
    """
    try:
        return Settings(**overrides)  # type: ignore[arg-type]  # field names are checked by pydantic
    except ValidationError as exc:
        problems, variables = [], []
        for problem in exc.errors():
            field = ".".join(str(part) for part in problem.get("loc", ())) or "settings"
            variables.append(f"LOUSHO_{field.upper()}")
            problems.append(f"{variables[-1]}: {problem.get('msg', 'invalid')}")
        raise errors.ConfigurationError("; ".join(problems), variable=variables[0] if variables else None) from None
