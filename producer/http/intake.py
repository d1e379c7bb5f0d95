"""Intake of one delivery: verify its signature, map its body to the agent's first input, record it, publish.

It must not write runs itself: the delivery row, the run and its first input are one transaction in
``store.deliveries`` (which also refuses a GitHub body replayed under a new delivery id), and the ``advance``
message is published only after that commit; a failed publish is left to the recover sweep.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from producer.http import bodies, headers, signatures
from producer.http.backend import Backend
from producer.http.config import WebhookConfig
from producer.http.rejections import Rejected, bad_request
from store import errors, inputs, model_limit, payloads, records
from store.faults import crash_point

log = logging.getLogger("lousho.webhooks")


@dataclass(frozen=True)
class Verified:
    """A delivery whose signature held: who sent it, its id, its raw body."""

    source: records.DeliverySource
    delivery_id: str
    body: bytes
    #: The value of the header that carries the agent's fairness key (``LOUSHO_WEBHOOK_FAIRNESS``), when it does.
    fairness_header: str | None = None


async def verified(request: Request, config: WebhookConfig, agent: str, now: float) -> Verified:
    """The delivery, when signed by a secret of this agent's (or an unbound one).

    The body is read (under the cap) only once the headers are well formed and, for Standard Webhooks,
    the timestamp is inside the window.

    Raises:
        Rejected: 415 for another content type, 400 for missing or malformed headers, 401 for a stale
            timestamp or a signature no key of this agent's matches, 413 for a body over the cap.
    """
    found = request.headers
    headers.check_json_type(found)
    source = config.fairness_source(agent)
    fairness = found.get(source.removeprefix("header:")) if source and source.startswith("header:") else None
    if config.takes_standard and "webhook-signature" in found:
        delivery_id, timestamp, offered = headers.standard_headers(found)
        signatures.check_timestamp(timestamp, now, config.tolerance_s)
        body = await bodies.read_body(request, config.max_body_bytes)
        signatures.verify_standard(config.standard_keys(agent), delivery_id, timestamp, body, offered)
        return Verified("standard-webhooks", delivery_id, body, fairness)
    if config.takes_github and "x-hub-signature-256" in found:
        github_id, signature = headers.github_headers(found)
        body = await bodies.read_body(request, config.max_body_bytes)
        signatures.verify_github(config.github_keys(agent), signature, body)
        return Verified("github", github_id, body, fairness)
    raise bad_request("signature headers are required")


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


def fairness_key(config: WebhookConfig, agent: str, delivery: Verified, document: Any) -> str | None:
    """The delivery's fairness key, from the header or body field ``LOUSHO_WEBHOOK_FAIRNESS`` names.

    None when none is configured for the agent or the delivery does not carry it (its run has no key).

    Raises:
        Rejected: 422 when the configured header or field holds something that is not a fairness key.
    """
    source = config.fairness_source(agent)
    if source is None:
        return None
    try:
        value = delivery.fairness_header if source.startswith("header:") else _pointer(document, source)
    except KeyError:
        return None
    if value is None:
        return None
    try:
        return model_limit.validate_fairness_key(value)
    except errors.ConfigurationError:
        raise Rejected(
            422,
            "LOUSHO_WEBHOOK_FAIRNESS_INVALID",
            "the delivery's fairness key is not 1-128 letters, digits, '.', '_', ':', '@' or '-'",
        ) from None


def settled_status(backend: Backend, session_id: str) -> str:
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
        return "awaiting-approval"
    if backend.lease_holder(session_id) is not None:
        return "running"
    backend.publish(session_id, checkpoint.agent)
    return "running" if checkpoint.seq == 0 else "resumed"


def accept(backend: Backend, config: WebhookConfig, agent: str, delivery: Verified) -> tuple[str, str, bool]:
    """Record a verified delivery as a run and publish its first step: ``(session_id, status, duplicate)``.

    A delivery id seen before starts nothing: it is answered with how its run stands.

    Raises:
        Rejected: 400 for a body that is not acceptable JSON, 404 for an agent no worker serves, 422 for a
            body without usable input or with a malformed fairness key, 409 when the delivery's run id belongs
            to another run, 413 when that run has no room left for the input.
    """
    document = bodies.parse_json(delivery.body)
    try:
        inputs.check_agent(agent, backend.known_agents())
    except errors.AgentNotFoundError:
        raise Rejected(404, "LOUSHO_AGENT_NOT_FOUND", "no such agent") from None  # the list of agents stays private
    messages = input_messages(config, agent, document)
    fairness = fairness_key(config, agent, delivery, document)
    digest = hashlib.sha256(delivery.body).hexdigest()
    try:
        intake = backend.deliveries.record(
            agent, delivery.delivery_id, delivery.source, digest, messages, fairness_key=fairness
        )
    except (
        errors.ConfigurationError,
        errors.SessionAwaitingApprovalError,
        errors.CheckpointCorruptError,
        errors.CheckpointFormatError,
    ):
        raise Rejected(409, "LOUSHO_WEBHOOK_CONFLICT", "the delivery's run id is used by another run") from None
    except errors.InputTooLargeError as exc:  # a run made under the delivery's id has no room left for it
        raise Rejected(413, exc.code, "the delivery's run has no room for this input") from None
    session_id = intake.delivery.session_id
    if not intake.created:
        if intake.replay_of is not None:
            # Answered like a duplicate: the sender learns nothing new and a genuine redelivery is settled.
            log.warning(
                "GitHub delivery %s for %s repeats the signed body of delivery %s; it starts nothing",
                delivery.delivery_id,
                agent,
                intake.replay_of,
            )
        elif intake.delivery.body_sha256 != digest:
            log.warning(
                "delivery %s for %s came again with another body; the first one stands", delivery.delivery_id, agent
            )
        return session_id, settled_status(backend, session_id), True
    crash_point("webhook_commit_before_enqueue", session_id)
    backend.publish(session_id, agent)
    log.info("delivery %s for %s accepted as run %s", delivery.delivery_id, agent, session_id)
    return session_id, "accepted", False
