"""``ModelLimit``: what the whole fleet may send to one provider account or model, and how it is configured.

Parses ``LOUSHO_MODEL_LIMITS`` and settles the numbers the agents of one worker give a key (the environment wins;
two different sets of numbers refuse to start). Holds no state: the slots themselves are ``store.model_slots``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from store import errors, records

__all__ = [
    "LimitConflict",
    "ModelLimit",
    "SlotAnswer",
    "SlotUsage",
    "WaitReason",
    "conflicts",
    "parse_fairness_weights",
    "parse_model_limits",
    "settle",
    "validate_fairness_key",
    "validate_limit_key",
]

#: Why a step waits before its model call: no free slot, the requests or tokens of the minute spent, or the
#: key's shared cool-down after a 429/529.
WaitReason = Literal["slot", "requests", "tokens", "cool-down"]

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_FAIRNESS_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
_FIELDS = {
    "concurrent": "concurrent",
    "rpm": "requests_per_minute",
    "tpm": "tokens_per_minute",
    "requests_per_minute": "requests_per_minute",
    "tokens_per_minute": "tokens_per_minute",
}


def validate_limit_key(key: object) -> str:
    """Return ``key`` when it can name a limit: 1-64 letters, digits, ``.``, ``_`` or ``-`` (it goes into Redis keys).

    Raises:
        ConfigurationError: the key breaks the rule.
    """
    return records.matching(key, _KEY, "model limit key", "1-64 letters, digits, '.', '_' or '-'")


def validate_fairness_key(key: object) -> str:
    """Return ``key`` when it can be a fairness key: 1-128 letters, digits, ``.``, ``_``, ``:``, ``@`` or ``-``.

    Raises:
        ConfigurationError: the key breaks the rule.
    """
    return records.matching(key, _FAIRNESS_KEY, "fairness key", "1-128 letters, digits, '.', '_', ':', '@' or '-'")


class ModelLimit(BaseModel):
    """Limits shared by every worker of the fleet on the model calls of every agent naming ``key``.

    ``concurrent``: calls in flight at once; ``requests_per_minute`` and ``tokens_per_minute``: token buckets
    (tokens as the provider reports them, counted once a call returns). None leaves a dimension unlimited; a
    429 or 529 with ``Retry-After`` on any call of the key holds every caller of the key until then.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __init__(
        self,
        key: str,
        concurrent: int | None = None,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
    ) -> None:
        """Positional ``key`` as DESIGN.md writes it: ``ModelLimit("openai-main", concurrent=8)``."""
        super().__init__(
            key=key, concurrent=concurrent, requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute
        )

    @field_validator("key")
    @classmethod
    def _valid_key(cls, value: str) -> str:
        return validate_limit_key(value)

    @field_validator("concurrent", "requests_per_minute", "tokens_per_minute")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be at least 1 (None: unlimited)")
        return value

    def numbers(self) -> tuple[int | None, int | None, int | None]:
        """``(concurrent, requests_per_minute, tokens_per_minute)``: what two agents must agree on."""
        return self.concurrent, self.requests_per_minute, self.tokens_per_minute

    def describe(self) -> str:
        """The limit as ``LOUSHO_MODEL_LIMITS`` writes it (``key=concurrent:8,rpm:500``)."""
        parts = [
            f"{name}:{value}"
            for name, value in (
                ("concurrent", self.concurrent),
                ("rpm", self.requests_per_minute),
                ("tpm", self.tokens_per_minute),
            )
            if value is not None
        ]
        return f"{self.key}={','.join(parts)}"


def parse_model_limits(text: str) -> dict[str, ModelLimit]:
    """``LOUSHO_MODEL_LIMITS`` (``"openai-main=concurrent:8,rpm:500,tpm:200000;anthropic=concurrent:4"``) by key.

    Raises:
        ConfigurationError: a part does not parse, names an unknown field or a number below 1, or a key twice.
    """
    found: dict[str, ModelLimit] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        key, sep, rest = part.partition("=")
        if not sep:
            raise errors.ConfigurationError(f"LOUSHO_MODEL_LIMITS: {part[:80]!r} is not key=field:number,...")
        values: dict[str, int] = {}
        for item in (i.strip() for i in rest.split(",")):
            if not item:
                continue
            name, colon, number = item.partition(":")
            field = _FIELDS.get(name.strip())
            if not colon or field is None or not number.strip().isdigit():
                raise errors.ConfigurationError(
                    f"LOUSHO_MODEL_LIMITS: {item[:80]!r} (of {key.strip()[:64]!r}) is not concurrent:N, rpm:N or tpm:N"
                )
            values[field] = int(number)
        key = validate_limit_key(key.strip())
        if key in found:
            raise errors.ConfigurationError(f"LOUSHO_MODEL_LIMITS names {key!r} twice")
        try:
            found[key] = ModelLimit(key, **values)
        except ValueError as exc:
            raise errors.ConfigurationError(f"LOUSHO_MODEL_LIMITS: {key!r}: numbers must be at least 1") from exc
    return found


def parse_fairness_weights(text: str) -> dict[str, int]:
    """``LOUSHO_FAIRNESS_WEIGHTS`` (``"acme=2,globex=3"``; ``;`` separates too): each key's share, 1 when unnamed.

    Raises:
        ConfigurationError: a part is not ``key=N`` with N from 1 to 100.
    """
    weights: dict[str, int] = {}
    for part in (p.strip() for p in re.split(r"[;,]", text)):
        if not part:
            continue
        key, sep, number = part.partition("=")
        if not sep or not number.strip().isdigit() or not 1 <= int(number) <= 100:
            raise errors.ConfigurationError(f"LOUSHO_FAIRNESS_WEIGHTS: {part[:80]!r} is not key=N (N from 1 to 100)")
        weights[validate_fairness_key(key.strip())] = int(number)
    return weights


def settle(named: Iterable[tuple[str, ModelLimit]], environment: Mapping[str, ModelLimit]) -> dict[str, ModelLimit]:
    """The limit each key holds in this worker: the environment's, else the one its agents agree on.

    ``named`` pairs an agent's name with its ``model_limit``. A key only the environment names is kept too.

    Raises:
        ConfigurationError: two agents give one key different numbers and the environment does not settle it.
    """
    settled: dict[str, ModelLimit] = dict(environment)
    first: dict[str, tuple[str, ModelLimit]] = {}
    for agent, limit in named:
        if limit.key in environment:
            continue
        seen = first.setdefault(limit.key, (agent, limit))
        if seen[1].numbers() != limit.numbers():
            raise errors.ConfigurationError(
                f"agents {seen[0]!r} and {agent!r} give model limit {limit.key!r} different numbers"
                f" ({seen[1].describe()} and {limit.describe()}); give them one, or set it in LOUSHO_MODEL_LIMITS"
            )
        settled[limit.key] = limit
    return settled


class LimitConflict(BaseModel):
    """One key that live workers give different numbers (workers of two releases): the smallest of each holds.

    ``given`` maps each set of numbers (``ModelLimit.describe``) to the workers that give it; ``holds`` is what the
    fleet's slots hold the key to meanwhile (``store.model_slots`` keeps the smallest number each caller notes).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    given: dict[str, list[str]]
    holds: ModelLimit


def conflicts(registered: Iterable[tuple[str, ModelLimit]]) -> list[LimitConflict]:
    """The keys that the workers of ``registered`` (pairs of worker id and a limit it holds) disagree on, by key."""
    by_key: dict[str, dict[tuple[int | None, int | None, int | None], tuple[ModelLimit, set[str]]]] = {}
    for worker, limit in registered:
        by_key.setdefault(limit.key, {}).setdefault(limit.numbers(), (limit, set()))[1].add(worker)
    found = []
    for key, sets in sorted(by_key.items()):
        if len(sets) < 2:
            continue
        limits = [limit for limit, _ in sets.values()]
        holds = ModelLimit(
            key,
            concurrent=_smallest(limit.concurrent for limit in limits),
            requests_per_minute=_smallest(limit.requests_per_minute for limit in limits),
            tokens_per_minute=_smallest(limit.tokens_per_minute for limit in limits),
        )
        given = {limit.describe(): sorted(workers) for limit, workers in sets.values()}
        found.append(LimitConflict(key=key, given=dict(sorted(given.items())), holds=holds))
    return found


def _smallest(numbers: Iterable[int | None]) -> int | None:
    """The smallest number given (None, unlimited, only when no one gives one)."""
    given = [number for number in numbers if number is not None]
    return min(given) if given else None


class SlotAnswer(BaseModel):
    """What asking for a model call under a limit gave: the call may go, or why and how long to wait.

    ``woken``: runs ``(session_id, agent)`` the answer gave a freed slot to; the caller sends each a step.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    granted: bool
    reason: WaitReason | None = None
    #: Seconds until the wait can end (0 for a slot wait: the run is woken when one frees).
    wait_s: float = 0.0
    woken: tuple[tuple[str, str], ...] = ()


class SlotUsage(BaseModel):
    """One limit key as the metrics show it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    in_use: int
    waiting: int
    cooling_s: float
