"""The webhook receiver, an ASGI ``app``: a verified delivery starts one run; run status and approvals need a key.

Owns HTTP intake: the secrets and which agents each may start, signature checks (Standard Webhooks;
GitHub optionally), the body cap, the content type, parsing of untrusted JSON and the responses. It
must not write runs itself: the delivery row, the run and its first input are one transaction in
``store.deliveries`` (which also refuses a GitHub body replayed under a new delivery id), and the
``advance`` message is published only after that commit; a failed publish is left to the recover sweep.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import copy
import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from store import errors, inputs, payloads, records, redaction
from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.database import Transaction
from store.deliveries import PostgresDeliveryStore, Source, check_delivery_id
from store.faults import crash_point

if TYPE_CHECKING:
    from producer.client import Client

log = logging.getLogger("lousho.webhooks")

MAX_BODY_BYTES = 1024 * 1024
TOLERANCE_S = 300
_MAX_DECISION_BYTES = 64 * 1024
_MAX_SIGNATURES = 16
_AGENT = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


class Rejected(Exception):
    """A request refused with ``status``; ``message`` is generic and never echoes the request."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _bad(message: str) -> Rejected:
    return Rejected(400, "LOUSHO_WEBHOOK_BAD_REQUEST", message)


def _unsigned() -> Rejected:
    return Rejected(401, "LOUSHO_WEBHOOK_SIGNATURE_INVALID", "signature verification failed")


# -- configuration ----------------------------------------------------------------------------


def parse_secret(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret (``whsec_`` followed by base64).

    Raises:
        ConfigurationError: the part after ``whsec_`` is not base64.
    """
    encoded = secret.strip().removeprefix("whsec_")
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise errors.ConfigurationError("a webhook secret must be whsec_ followed by base64") from exc
    if not key:
        raise errors.ConfigurationError("a webhook secret must not be empty")
    return key


def _github_secret(secret: str) -> bytes:
    if not secret:
        raise errors.ConfigurationError("a GitHub webhook secret must not be empty")
    return secret.encode()


#: ``agent=secret`` binds a secret to one agent; ``*=secret`` (or a bare secret) serves every agent.
#: A Standard Webhooks secret is bound only when ``whsec_`` follows the ``=`` (base64 padding has ``=`` too).
_BOUND_STANDARD = re.compile(r"(?P<agent>[A-Za-z0-9_.-]{1,200}|\*)=(?P<secret>whsec_.*)", re.DOTALL)
_BOUND_GITHUB = re.compile(r"(?P<agent>[A-Za-z0-9_.-]{1,200}|\*)=(?P<secret>.*)", re.DOTALL)


@dataclass(frozen=True)
class _SecretSpec:
    variable: str
    bound: re.Pattern[str]
    decode: Callable[[str], bytes]


_STANDARD_SPEC = _SecretSpec("LOUSHO_WEBHOOK_SECRETS", _BOUND_STANDARD, parse_secret)
_GITHUB_SPEC = _SecretSpec("LOUSHO_GITHUB_WEBHOOK_SECRETS", _BOUND_GITHUB, _github_secret)


def _parse_secrets(spec: _SecretSpec, value: str) -> tuple[tuple[bytes, ...], dict[str, tuple[bytes, ...]]]:
    """``(unbound keys, keys per agent)`` of one secrets variable; errors name the variable, never a secret."""
    unbound: list[bytes] = []
    bound: dict[str, list[bytes]] = {}
    for number, item in enumerate((i.strip() for i in value.split(",")), start=1):
        if not item:
            continue
        match = spec.bound.fullmatch(item)
        agent, secret = (match["agent"], match["secret"].strip()) if match else ("*", item)
        where = f"item {number}" if agent == "*" else f"the secret bound to agent {agent!r} (item {number})"
        try:
            key = spec.decode(secret)
        except errors.ConfigurationError as exc:
            raise errors.ConfigurationError(
                f"{spec.variable}: {where}: {exc.message}; the form is agent=secret or secret, comma-separated",
                variable=spec.variable) from None
        (unbound if agent == "*" else bound.setdefault(agent, [])).append(key)
    return tuple(unbound), {agent: tuple(keys) for agent, keys in bound.items()}


@dataclass(frozen=True)
class WebhookConfig:
    """Secrets (several, for rotation; each for every agent or bound to one), the API key of the read and
    approval routes, limits, input mapping.

    ``secrets`` and ``github_secrets`` verify deliveries to any agent; ``agent_secrets`` and
    ``github_agent_secrets`` verify only deliveries to their agent's path, so the holder of one
    agent's secret cannot start another. ``input_pointers`` maps an agent to the JSON pointer (RFC 6901)
    of the part of the body that becomes its input; ``input_builders`` maps an agent to a function of the
    parsed body returning a string or chat messages. Agents in neither get the whole body as JSON text.
    """

    secrets: tuple[bytes, ...] = ()
    github_secrets: tuple[bytes, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    tolerance_s: int = TOLERANCE_S
    input_pointers: Mapping[str, str] = field(default_factory=dict)
    input_builders: Mapping[str, Callable[[Any], inputs.Input]] = field(default_factory=dict)
    agent_secrets: Mapping[str, tuple[bytes, ...]] = field(default_factory=dict)
    github_agent_secrets: Mapping[str, tuple[bytes, ...]] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WebhookConfig:
        """The configuration from ``LOUSHO_WEBHOOK_SECRETS`` and the other ``LOUSHO_`` variables.

        Both secret variables take comma-separated items, each ``secret`` (every agent) or
        ``agent=secret`` (that agent only); ``*=secret`` is a secret for every agent that may contain
        ``=`` itself. Also read: ``LOUSHO_API_KEY``, ``LOUSHO_WEBHOOK_MAX_BODY_BYTES`` and
        ``LOUSHO_WEBHOOK_INPUT`` (``agent=/json/pointer,...``).

        Raises:
            ConfigurationError: a malformed secret, size or input mapping, or no secret at all; the
                message names the variable and never repeats a secret.
        """
        env = os.environ if environ is None else environ
        secrets, agent_secrets = _parse_secrets(_STANDARD_SPEC, env.get(_STANDARD_SPEC.variable, ""))
        github, github_agents = _parse_secrets(_GITHUB_SPEC, env.get(_GITHUB_SPEC.variable, ""))
        pointers: dict[str, str] = {}
        for item in filter(None, (i.strip() for i in env.get("LOUSHO_WEBHOOK_INPUT", "").split(","))):
            agent, sep, pointer = item.partition("=")
            if not sep or not (pointer == "" or pointer.startswith("/")):
                raise errors.ConfigurationError("LOUSHO_WEBHOOK_INPUT is agent=/json/pointer, comma-separated")
            pointers[agent.strip()] = pointer
        try:
            max_body = int(env.get("LOUSHO_WEBHOOK_MAX_BODY_BYTES", str(MAX_BODY_BYTES)))
        except ValueError as exc:
            raise errors.ConfigurationError("LOUSHO_WEBHOOK_MAX_BODY_BYTES must be an integer") from exc
        config = cls(secrets=secrets, github_secrets=github, api_key=env.get("LOUSHO_API_KEY") or None,
                     max_body_bytes=max_body, input_pointers=pointers, agent_secrets=agent_secrets,
                     github_agent_secrets=github_agents)
        config.check()
        return config

    def standard_keys(self, agent: str) -> tuple[bytes, ...]:
        """The Standard Webhooks keys that may sign a delivery to ``agent``: the unbound ones and its own."""
        return self.secrets + tuple(self.agent_secrets.get(agent, ()))

    def github_keys(self, agent: str) -> tuple[bytes, ...]:
        """The GitHub secrets that may sign a delivery to ``agent``: the unbound ones and its own."""
        return self.github_secrets + tuple(self.github_agent_secrets.get(agent, ()))

    def check(self) -> None:
        """Refuse a configuration that could accept nothing or anything.

        Raises:
            ConfigurationError: no secret, a secret bound to a name no agent can have, or a body cap
                that is not positive.
        """
        if not (self.secrets or self.github_secrets or any(self.agent_secrets.values())
                or any(self.github_agent_secrets.values())):
            raise errors.ConfigurationError(
                "set LOUSHO_WEBHOOK_SECRETS (whsec_... or agent=whsec_...) to receive webhooks")
        for agent in (*self.agent_secrets, *self.github_agent_secrets):
            if not _AGENT.fullmatch(agent):
                raise errors.ConfigurationError("a webhook secret is bound to a name no agent can have")
        if self.max_body_bytes <= 0:
            raise errors.ConfigurationError("the webhook body cap must be positive")


@dataclass
class Backend:
    """What the routes use: the stores, the publisher, the lease reader; built once per process."""

    deliveries: PostgresDeliveryStore
    checkpoints: PostgresCheckpointStore
    approvals: PostgresApprovalStore
    #: ``enqueue(session_id, agent=…)``: send ``advance`` to that agent's queue.
    enqueue: Callable[..., None]
    lease_holder: Callable[[str], str | None]
    known_agents: Callable[[], list[str]]
    close: Callable[[], None] = lambda: None

    @classmethod
    def from_client(cls, client: Client) -> Backend:
        """A backend on a producer client's engine, broker connection and Redis."""
        engine = client.store.engine
        return cls(deliveries=PostgresDeliveryStore(engine), checkpoints=client.store,
                   approvals=PostgresApprovalStore(engine), enqueue=client.enqueuer.advance,
                   lease_holder=client.leases.holder, known_agents=client.known_agents, close=client.close)


# -- signatures -------------------------------------------------------------------------------


def _one(headers: Headers, name: str) -> str | None:
    values = headers.getlist(name)
    if len(values) > 1:
        raise _bad(f"duplicate {name} header")
    return values[0] if values else None


def sign(key: bytes, delivery_id: str, timestamp: int | str, body: bytes) -> str:
    """The Standard Webhooks ``webhook-signature`` value for ``body`` (``v1,<base64>``)."""
    digest = hmac.new(key, f"{delivery_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def standard_headers(headers: Headers) -> tuple[str, int, list[str]]:
    """``(webhook-id, webhook-timestamp, signatures)`` of a Standard Webhooks request.

    Raises:
        Rejected: 400 when a header is missing, repeated or malformed.
    """
    delivery_id, stamp, signature = (_one(headers, n) for n in ("webhook-id", "webhook-timestamp",
                                                                "webhook-signature"))
    if delivery_id is None or stamp is None or signature is None:
        raise _bad("webhook-id, webhook-timestamp and webhook-signature are required")
    try:
        check_delivery_id(delivery_id)
    except errors.ConfigurationError:
        raise _bad("webhook-id must be 1-256 printable ASCII characters") from None
    if not _TIMESTAMP.fullmatch(stamp):
        raise _bad("webhook-timestamp must be integer seconds")
    return delivery_id, int(stamp), signature.split()[:_MAX_SIGNATURES]


def check_timestamp(timestamp: int, now: float, tolerance_s: int = TOLERANCE_S) -> None:
    """Refuse a signed timestamp further than ``tolerance_s`` from ``now`` (replay window).

    Raises:
        Rejected: 401 when it is too old or too far in the future.
    """
    if abs(now - timestamp) > tolerance_s:
        raise Rejected(401, "LOUSHO_WEBHOOK_TIMESTAMP_INVALID", "webhook-timestamp outside the accepted window")


def verify_standard(keys: tuple[bytes, ...], delivery_id: str, timestamp: int, body: bytes,
                    signatures: list[str]) -> None:
    """Accept when any ``v1`` signature matches any key (rotation) over ``id.timestamp.body``.

    Raises:
        Rejected: 401 when none matches.
    """
    provided = []
    for item in signatures:
        version, _, encoded = item.partition(",")
        if version != "v1":
            continue
        try:
            provided.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            continue
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    for key in keys:
        expected = hmac.new(key, signed, hashlib.sha256).digest()
        if any(hmac.compare_digest(expected, candidate) for candidate in provided):
            return
    raise _unsigned()


def verify_github(keys: tuple[bytes, ...], signature: str, body: bytes) -> None:
    """Accept GitHub's ``X-Hub-Signature-256: sha256=<hex>`` (HMAC of the body) under any key.

    Raises:
        Rejected: 401 when it does not match.
    """
    scheme, _, hexdigest = signature.partition("=")
    try:
        provided = bytes.fromhex(hexdigest)
    except ValueError:
        raise _unsigned() from None
    if scheme == "sha256":
        for key in keys:
            if hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), provided):
                return
    raise _unsigned()


# -- request bodies ---------------------------------------------------------------------------


def _check_json_type(headers: Headers) -> None:
    content_type = _one(headers, "content-type")
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise Rejected(415, "LOUSHO_WEBHOOK_CONTENT_TYPE", "the body must be application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused past ``limit`` bytes by its Content-Length or while it streams.

    Raises:
        Rejected: 413 when too large, 400 for a malformed length or a dropped connection.
    """
    length = _one(request.headers, "content-length")
    if length is not None:
        if not length.isdigit():
            raise _bad("malformed content-length")
        if int(length) > limit:
            raise Rejected(413, "LOUSHO_WEBHOOK_TOO_LARGE", "the body is over the size limit")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise Rejected(413, "LOUSHO_WEBHOOK_TOO_LARGE", "the body is over the size limit")
    except ClientDisconnect:
        raise _bad("the client went away") from None
    return bytes(body)


def _parse(body: bytes) -> Any:
    """The body as JSON: UTF-8 only (a BOM is ignored), lone surrogates and NULs replaced by U+FFFD.

    ``\\ud800`` is valid JSON but cannot be stored; replacing it here keeps the sender from retrying
    a body that could never be accepted.
    """
    try:
        document = payloads.loads_untrusted(body.decode("utf-8-sig"))
    except (UnicodeDecodeError, errors.InputTooLargeError):
        raise _bad("the body is not acceptable JSON") from None
    return payloads.sanitize(document)


def _pointer(document: Any, pointer: str) -> Any:
    """The value at an RFC 6901 JSON pointer, or raise ``KeyError``."""
    value = document
    for token in pointer.split("/")[1:] if pointer else []:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict):
            value = value[token]
        elif isinstance(value, list) and token.isdigit() and int(token) < len(value):
            value = value[int(token)]
        else:
            raise KeyError(token)
    return value


def input_messages(config: WebhookConfig, agent: str, document: Any) -> list[records.Message]:
    """The agent's first input from a parsed body: its builder, its pointer, or the whole body as JSON text.

    Raises:
        Rejected: 422 when the configured part is missing or is not usable input.
    """
    builder = config.input_builders.get(agent)
    try:
        if builder is not None:
            chosen: inputs.Input = builder(document)
        else:
            value = _pointer(document, config.input_pointers.get(agent, ""))
            chosen = value if isinstance(value, str) else payloads.dumps(payloads.sanitize(value))
        messages = inputs.normalize_input(chosen)
    except (KeyError, errors.ConfigurationError, errors.InputTooLargeError):
        raise Rejected(422, "LOUSHO_WEBHOOK_INPUT_INVALID", "the body has no usable input for this agent") from None
    if not messages:
        raise Rejected(422, "LOUSHO_WEBHOOK_INPUT_INVALID", "the body has no usable input for this agent")
    return messages


# -- intake -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verified:
    """A delivery whose signature held: who sent it, its id, its raw body."""

    source: Source
    delivery_id: str
    body: bytes


async def _verified(request: Request, config: WebhookConfig, agent: str, now: float) -> Verified:
    """The delivery, when signed by a secret of this agent's (or an unbound one)."""
    headers = request.headers
    _check_json_type(headers)
    if (config.secrets or config.agent_secrets) and "webhook-signature" in headers:
        delivery_id, timestamp, signatures = standard_headers(headers)
        check_timestamp(timestamp, now, config.tolerance_s)
        body = await read_body(request, config.max_body_bytes)
        verify_standard(config.standard_keys(agent), delivery_id, timestamp, body, signatures)
        return Verified("standard-webhooks", delivery_id, body)
    if (config.github_secrets or config.github_agent_secrets) and "x-hub-signature-256" in headers:
        signature, github_id = _one(headers, "x-hub-signature-256"), _one(headers, "x-github-delivery")
        if signature is None or github_id is None:
            raise _bad("X-Hub-Signature-256 and X-GitHub-Delivery are required")
        try:
            check_delivery_id(github_id)
        except errors.ConfigurationError:
            raise _bad("X-GitHub-Delivery must be 1-256 printable ASCII characters") from None
        body = await read_body(request, config.max_body_bytes)
        verify_github(config.github_keys(agent), signature, body)
        return Verified("github", github_id, body)
    raise _bad("signature headers are required")


def _settled_status(backend: Backend, session_id: str) -> str:
    """How a known delivery's run stands; an interrupted one is enqueued again (harmless if it was not)."""
    try:
        checkpoint = backend.checkpoints.load(session_id)
    except errors.CheckpointCorruptError:
        return "failed"
    if checkpoint is None:
        return "deleted"
    if checkpoint.last_error is not None and not checkpoint.last_error.retryable:
        return "failed"
    if checkpoint.status == "finished":
        return "done"
    if checkpoint.status == "awaiting-approval":
        return "paused"
    if backend.lease_holder(session_id) is not None:
        return "running"
    _publish(backend, session_id, checkpoint.agent)
    return "running" if checkpoint.seq == 0 else "resumed"


#: What a publish can fail with once the broker is unreachable (kombu wraps the transport's errors).
_BROKER_ERRORS = (errors.StorageError, redis.RedisError, OSError)


def _publish(backend: Backend, session_id: str, agent: str) -> None:
    """Send ``advance`` for a run whose input is committed; a broker failure is left to the recover sweep.

    The commit is what makes the delivery durable, so the sender must get its 2xx: answering an error
    would only make it deliver again.
    """
    try:
        backend.enqueue(session_id, agent=agent)
    except _BROKER_ERRORS as exc:
        log.warning("run %s is committed but its step could not be published (%s); the recover sweep will "
                    "send it", session_id, type(exc).__name__)


def _accept(backend: Backend, config: WebhookConfig, agent: str, verified: Verified) -> tuple[str, str, bool]:
    document = _parse(verified.body)
    known = backend.known_agents()
    if known and agent not in known:
        raise Rejected(404, "LOUSHO_AGENT_NOT_FOUND", "no such agent")
    messages = input_messages(config, agent, document)
    digest = hashlib.sha256(verified.body).hexdigest()
    try:
        intake = backend.deliveries.record(agent, verified.delivery_id, verified.source, digest, messages)
    except (errors.ConfigurationError, errors.SessionAwaitingApprovalError):
        raise Rejected(409, "LOUSHO_WEBHOOK_CONFLICT", "the delivery's run id is used by another run") from None
    session_id = intake.delivery.session_id
    if not intake.created:
        if intake.replay_of is not None:
            # Answered like a duplicate: the sender learns nothing new and a genuine redelivery is settled.
            log.warning("GitHub delivery %s for %s repeats the signed body of delivery %s; it starts nothing",
                        verified.delivery_id, agent, intake.replay_of)
        elif intake.delivery.body_sha256 != digest:
            log.warning("delivery %s for %s came again with another body; the first one stands",
                        verified.delivery_id, agent)
        return session_id, _settled_status(backend, session_id), True
    crash_point("webhook_commit_before_enqueue", session_id)
    _publish(backend, session_id, agent)
    log.info("delivery %s for %s accepted as run %s", verified.delivery_id, agent, session_id)
    return session_id, "accepted", False


# -- the app ----------------------------------------------------------------------------------


class _DecisionBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    approved: bool
    note: str | None = Field(default=None, max_length=10_000)


def _authorize(request: Request, config: WebhookConfig) -> None:
    values = request.headers.getlist("authorization")
    scheme, _, token = (values[0] if len(values) == 1 else "").partition(" ")
    if not config.api_key or scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), config.api_key.encode()):
        raise Rejected(401, "LOUSHO_API_KEY_INVALID", "a valid API key is required")


def _error(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if code == "LOUSHO_API_KEY_INVALID" else None
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def _run_view(backend: Backend, session_id: str) -> dict[str, Any]:
    try:
        records.validate_session_id(session_id)
        checkpoint = backend.checkpoints.load(session_id)
    except errors.SessionIdInvalidError:
        raise Rejected(404, "LOUSHO_RUN_NOT_FOUND", "no such run") from None
    except errors.CheckpointCorruptError:
        return {"session_id": session_id, "status": "corrupt", "pending_approvals": []}
    if checkpoint is None:
        raise Rejected(404, "LOUSHO_RUN_NOT_FOUND", "no such run")
    approvals = backend.approvals.by_ids(checkpoint.approval_ids)
    pending = [a.model_dump(mode="json", include={"approval_id", "tool_call_id", "tool_name", "args", "created_at"})
               for a in approvals.values() if a.status == "pending"]
    return {"session_id": session_id, "agent": checkpoint.agent, "status": checkpoint.status,
            "finish_reason": checkpoint.finish_reason, "text": checkpoint.final_text, "steps": checkpoint.step,
            "last_error": checkpoint.last_error.model_dump() if checkpoint.last_error else None,
            "pending_approvals": pending}


def _decide(backend: Backend, approval_id: str, decision: _DecisionBody) -> tuple[str, bool]:
    if len(approval_id) > 200:
        raise Rejected(404, "LOUSHO_APPROVAL_NOT_FOUND", "no such pending approval")
    try:
        made = backend.approvals.resolve(approval_id, decision.approved, decision.note)
    except errors.ApprovalNotFoundError:
        raise Rejected(404, "LOUSHO_APPROVAL_NOT_FOUND", "no such pending approval") from None
    except errors.ApprovalOrphanedError:
        raise Rejected(409, "LOUSHO_APPROVAL_ORPHANED", "the approval's run no longer waits on it") from None
    session_id = made.approval.session_id
    if made.run_continues:
        crash_point("approval_decided_before_resume_enqueue", session_id)
        _publish(backend, session_id, made.approval.agent)
    return session_id, made.run_continues


def _healthy(backend: Backend) -> bool:
    try:
        with Transaction(backend.deliveries.engine) as conn:
            conn.execute(text("SELECT 1"))
    except errors.StorageError:
        return False
    return True


def _backend_from_env() -> Backend:
    from producer.client import Client
    from store.database import make_engine
    from store.settings import Settings

    settings = Settings()
    engine = make_engine(settings, pool_size=8)
    client = Client(settings, engine=engine)
    backend = Backend.from_client(client)

    def close() -> None:
        client.close()
        engine.dispose()

    backend.close = close
    return backend


def _state(request: Request) -> tuple[WebhookConfig, Backend]:
    config: WebhookConfig = request.app.state.config
    backend: Backend = request.app.state.backend
    return config, backend


async def _on_rejected(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Rejected)  # registered for Rejected only
    return _error(exc.status, exc.code, exc.message)


async def _on_invalid(request: Request, exc: Exception) -> JSONResponse:
    return _error(400, "LOUSHO_BAD_REQUEST", "the request is malformed")


async def _on_storage(request: Request, exc: Exception) -> JSONResponse:
    # A delivery committed before Redis failed is still run: the recover sweep or the redelivery enqueues it.
    log.warning("webhook request failed on a service: %s", type(exc).__name__)
    return _error(503, errors.StorageError.code, "service unavailable, retry later")


async def _receive(agent: str, request: Request) -> JSONResponse:
    config, backend = _state(request)
    if not _AGENT.fullmatch(agent):
        raise Rejected(404, "LOUSHO_AGENT_NOT_FOUND", "no such agent")
    verified = await _verified(request, config, agent, request.app.state.clock())
    session_id, status, duplicate = await run_in_threadpool(_accept, backend, config, agent, verified)
    url = str(request.url_for("run_status", session_id=session_id))
    return JSONResponse({"session_id": session_id, "status": status, "status_url": url, "duplicate": duplicate},
                        status_code=202)


async def _run_status(session_id: str, request: Request) -> JSONResponse:
    config, backend = _state(request)
    _authorize(request, config)
    return JSONResponse(await run_in_threadpool(_run_view, backend, session_id))


async def _approval(approval_id: str, request: Request) -> JSONResponse:
    config, backend = _state(request)
    _authorize(request, config)
    _check_json_type(request.headers)
    try:
        decision = _DecisionBody.model_validate(_parse(await read_body(request, _MAX_DECISION_BYTES)))
    except ValidationError:
        raise _bad('the body must be {"approved": true|false, "note": optional text}') from None
    session_id, continues = await run_in_threadpool(_decide, backend, approval_id, decision)
    return JSONResponse({"approval_id": approval_id, "session_id": session_id,
                         "decision": "approved" if decision.approved else "rejected", "run_continues": continues,
                         "status_url": str(request.url_for("run_status", session_id=session_id))})


async def _healthz(request: Request) -> JSONResponse:
    _, backend = _state(request)
    ok = await run_in_threadpool(_healthy, backend)
    return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    built = None
    if app.state.config is None:
        # Configured from the environment: a real server (``uvicorn producer.webhooks:app`` included).
        redaction.install()
        app.state.config = WebhookConfig.from_env()
    if app.state.backend is None:
        app.state.backend = built = _backend_from_env()
    try:
        yield
    finally:
        if built is not None:
            built.close()


def create_app(config: WebhookConfig | None = None, backend: Backend | None = None, *,
               clock: Callable[[], float] = time.time) -> FastAPI:
    """The receiver. Without arguments, configuration and connections come from the environment at startup.

    Routes: ``POST /webhooks/{agent}``, ``GET /runs/{session_id}`` and ``POST /approvals/{approval_id}``
    (``Authorization: Bearer <LOUSHO_API_KEY>``), ``GET /healthz``.

    Raises:
        ConfigurationError: ``config`` has no secret or no usable body cap.
    """
    if config is not None:
        config.check()
    app = FastAPI(title="Lousho webhooks", docs_url=None, redoc_url=None, openapi_url=None, lifespan=_lifespan)
    app.state.config, app.state.backend, app.state.clock = config, backend, clock
    app.add_exception_handler(Rejected, _on_rejected)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(errors.StorageError, _on_storage)
    app.add_exception_handler(redis.RedisError, _on_storage)
    app.add_api_route("/webhooks/{agent}", _receive, methods=["POST"], status_code=202)
    app.add_api_route("/runs/{session_id}", _run_status, methods=["GET"], name="run_status")
    app.add_api_route("/approvals/{approval_id}", _approval, methods=["POST"])
    app.add_api_route("/healthz", _healthz, methods=["GET"])
    return app


#: The ASGI app for ``uvicorn producer.webhooks:app`` (configured from the environment at startup).
app = create_app()


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging configuration with secrets masked on its handlers, and ``lousho.*`` and library
    warnings written through them (access log lines carry query strings, which may hold keys)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"redact": {"()": "store.redaction.RedactingFilter"}}
    for handler in config["handlers"].values():
        handler["filters"] = ["redact"]
    config["loggers"]["lousho"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    config["root"] = {"handlers": ["default"], "level": "WARNING"}
    return config


def cmd_serve(client: Client, args: argparse.Namespace) -> int:
    """Run ``lousho webhooks serve``: uvicorn on ``--host``/``--port`` with the environment's settings."""
    import uvicorn

    redaction.install()
    WebhookConfig.from_env()  # fail before binding the port when the secrets are missing or malformed
    uvicorn.run("producer.webhooks:app", host=args.host, port=args.port, log_level=args.log_level,
                log_config=log_config(args.log_level), server_header=False, date_header=False)
    return 0
