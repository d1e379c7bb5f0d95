"""The receiver's configuration (signing keys, API key, body cap, input mapping), built from ``Settings``.

It reads no environment variable itself (``Settings`` does, once) and never puts a secret in a message or repr.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from producer.http import access, signatures
from store import errors, inputs
from store.settings import Settings

#: The default body cap in bytes (``LOUSHO_WEBHOOK_MAX_BODY_BYTES``, whose default ``Settings`` owns).
MAX_BODY_BYTES: int = Settings.model_fields["webhook_max_body_bytes"].default
#: What an agent name looks like; a path or a binding naming anything else can never match an agent.
AGENT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


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


def _parse_secrets(spec: _SecretSpec, value: SecretStr) -> tuple[tuple[bytes, ...], dict[str, tuple[bytes, ...]]]:
    """``(unbound keys, keys per agent)`` of one secrets variable; errors name the variable, never a secret."""
    unbound: list[bytes] = []
    bound: dict[str, list[bytes]] = {}
    for number, item in enumerate((i.strip() for i in value.get_secret_value().split(",")), start=1):
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
                variable=spec.variable,
            ) from None
        (unbound if agent == "*" else bound.setdefault(agent, [])).append(key)
    return tuple(unbound), {agent: tuple(keys) for agent, keys in bound.items()}


def _parse_input_pointers(value: str) -> dict[str, str]:
    """``LOUSHO_WEBHOOK_INPUT``: ``agent=/json/pointer`` pairs, comma-separated."""
    pointers: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in value.split(","))):
        agent, sep, pointer = item.partition("=")
        if not sep or not (pointer == "" or pointer.startswith("/")):
            raise errors.ConfigurationError("LOUSHO_WEBHOOK_INPUT is agent=/json/pointer, comma-separated")
        pointers[agent.strip()] = pointer
    return pointers


def _parse_fairness_sources(value: str) -> dict[str, str]:
    """``LOUSHO_WEBHOOK_FAIRNESS``: ``agent=header:Name`` or ``agent=/json/pointer`` pairs (``*``: every agent)."""
    sources: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in value.split(","))):
        agent, sep, source = item.partition("=")
        source = source.strip()
        header = source.removeprefix("header:").strip() if source.startswith("header:") else None
        if not sep or not agent.strip() or not (source.startswith("/") or header):
            raise errors.ConfigurationError(
                "LOUSHO_WEBHOOK_FAIRNESS is agent=header:Name or agent=/json/pointer,"
                " comma-separated (* for every agent)",
                variable="LOUSHO_WEBHOOK_FAIRNESS",
            )
        sources[agent.strip()] = f"header:{header.lower()}" if header else source
    return sources


@dataclass(frozen=True)
class WebhookConfig:
    """Signing secrets, the API key of the read and approval routes, limits, input mapping.

    There may be several secrets, for rotation; each serves every agent or is bound to one.
    ``secrets`` and ``github_secrets`` verify deliveries to any agent; ``agent_secrets`` and
    ``github_agent_secrets`` verify only deliveries to their agent's path, so the holder of one
    agent's secret cannot start another. ``input_pointers`` maps an agent to the JSON pointer (RFC 6901)
    of the part of the body that becomes its input; ``input_builders`` maps an agent to a function of the
    parsed body returning a string or chat messages. Agents in neither get the whole body as JSON text.
    Keys are left out of the repr.
    """

    secrets: tuple[bytes, ...] = field(default=(), repr=False)
    github_secrets: tuple[bytes, ...] = field(default=(), repr=False)
    api_key: SecretStr | None = None
    #: ``LOUSHO_API_KEYS``: named keys, read-only or limited to agents (``producer.http.access``).
    api_keys: SecretStr | None = field(default=None, repr=False)
    max_body_bytes: int = MAX_BODY_BYTES
    tolerance_s: int = signatures.TOLERANCE_S
    input_pointers: Mapping[str, str] = field(default_factory=dict)
    input_builders: Mapping[str, Callable[[Any], inputs.Input]] = field(default_factory=dict)
    agent_secrets: Mapping[str, tuple[bytes, ...]] = field(default_factory=dict, repr=False)
    github_agent_secrets: Mapping[str, tuple[bytes, ...]] = field(default_factory=dict, repr=False)
    #: Whether ``POST /webhooks/{agent}`` is served (``LOUSHO_WEBHOOKS_ENABLED``); off, no secret is needed.
    intake: bool = True
    #: Where each agent's deliveries carry their fairness key (``LOUSHO_WEBHOOK_FAIRNESS``): ``header:<name>``
    #: (lower case) or a JSON pointer into the body; ``*`` for every agent not named.
    fairness_sources: Mapping[str, str] = field(default_factory=dict)

    def fairness_source(self, agent: str) -> str | None:
        """Where ``agent``'s deliveries carry their fairness key, or None."""
        return self.fairness_sources.get(agent, self.fairness_sources.get("*"))

    @classmethod
    def from_settings(cls, settings: Settings) -> WebhookConfig:
        """The configuration from the webhook fields of ``settings``.

        ``LOUSHO_WEBHOOK_SECRETS`` and ``LOUSHO_GITHUB_WEBHOOK_SECRETS`` take comma-separated items, each
        ``secret`` (every agent) or ``agent=secret`` (that agent only); ``*=secret`` is a secret for every
        agent that may contain ``=`` itself. Also used: ``LOUSHO_API_KEY`` (empty means unset),
        ``LOUSHO_WEBHOOK_MAX_BODY_BYTES``, ``LOUSHO_WEBHOOK_INPUT`` (``agent=/json/pointer,...``) and
        ``LOUSHO_WEBHOOK_FAIRNESS`` (``agent=header:Name`` or ``agent=/json/pointer``).

        Raises:
            ConfigurationError: a malformed secret or input mapping, a body cap that is not positive, or no
                secret at all while intake is on; the message names the variable and never repeats a secret.
        """
        secrets, agent_secrets = _parse_secrets(_STANDARD_SPEC, settings.webhook_secrets)
        github, github_agents = _parse_secrets(_GITHUB_SPEC, settings.github_webhook_secrets)
        api_key = settings.api_key if settings.api_key is not None and settings.api_key.get_secret_value() else None
        config = cls(
            secrets=secrets,
            github_secrets=github,
            api_key=api_key,
            api_keys=settings.api_keys,
            max_body_bytes=settings.webhook_max_body_bytes,
            input_pointers=_parse_input_pointers(settings.webhook_input),
            agent_secrets=agent_secrets,
            github_agent_secrets=github_agents,
            intake=settings.webhooks_enabled,
            fairness_sources=_parse_fairness_sources(settings.webhook_fairness),
        )
        config.check()
        config.keys  # noqa: B018  # a malformed LOUSHO_API_KEYS is refused here, before a port is bound
        return config

    @functools.cached_property
    def keys(self) -> access.Keys:
        """The API keys of the read and act routes and the browser pages (``LOUSHO_API_KEY`` and ``LOUSHO_API_KEYS``).

        Raises:
            ConfigurationError: a malformed ``LOUSHO_API_KEYS``.
        """
        return access.Keys.parse(self.api_key, self.api_keys)

    def standard_keys(self, agent: str) -> tuple[bytes, ...]:
        """The Standard Webhooks keys that may sign a delivery to ``agent``: the unbound ones and its own."""
        return self.secrets + tuple(self.agent_secrets.get(agent, ()))

    def github_keys(self, agent: str) -> tuple[bytes, ...]:
        """The GitHub secrets that may sign a delivery to ``agent``: the unbound ones and its own."""
        return self.github_secrets + tuple(self.github_agent_secrets.get(agent, ()))

    @property
    def takes_standard(self) -> bool:
        """Whether any Standard Webhooks key is configured."""
        return bool(self.secrets or self.agent_secrets)

    @property
    def takes_github(self) -> bool:
        """Whether any GitHub secret is configured."""
        return bool(self.github_secrets or self.github_agent_secrets)

    def check(self) -> None:
        """Refuse a configuration that could accept nothing or anything.

        Raises:
            ConfigurationError: no secret while intake is on, a secret bound to a name no agent can have, or a
                body cap that is not positive.
        """
        if self.intake and not (
            self.secrets
            or self.github_secrets
            or any(self.agent_secrets.values())
            or any(self.github_agent_secrets.values())
        ):
            raise errors.ConfigurationError(
                "set LOUSHO_WEBHOOK_SECRETS (whsec_... or agent=whsec_...) to receive webhooks"
            )
        for agent in (*self.agent_secrets, *self.github_agent_secrets):
            if not AGENT_NAME.fullmatch(agent):
                raise errors.ConfigurationError("a webhook secret is bound to a name no agent can have")
        if self.max_body_bytes <= 0:
            raise errors.ConfigurationError("the webhook body cap must be positive")
