"""Who may read and act on which runs: API keys, each full, read-only, or limited to some agents.

Keys come from ``LOUSHO_API_KEY`` (one key with full access, named ``default``) and ``LOUSHO_API_KEYS``, a
comma-separated list of ``name=key`` entries, each optionally followed by ``;read`` (read-only) and
``;agents=a|b`` (only those agents' runs)::

    LOUSHO_API_KEYS="ops=7c1f...e2,viewer=91ab...0d;read,support=5d2e...77;agents=support|billing"

A key sees and acts on the runs of its agents only, on every surface alike: the JSON routes, the event stream
and the browser pages. A run a key does not see is answered as if it did not exist.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import SecretStr

from store import errors

#: Shortest key accepted: a guessable key is refused when the settings are read.
MIN_KEY_LENGTH = 16
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_AGENT = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Principal:
    """Whoever presented a key (or a trusted proxy vouched for): what they may see and do."""

    name: str
    read_only: bool = False
    #: The agents whose runs they see; None: every agent.
    agents: frozenset[str] | None = None

    def sees(self, agent: str | None) -> bool:
        """Whether runs of ``agent`` are visible (an unknown agent only to a key of every agent)."""
        return self.agents is None or (agent is not None and agent in self.agents)

    def acts_on(self, agent: str | None) -> bool:
        """Whether they may decide, abort, resume, steer or fork runs of ``agent``."""
        return not self.read_only and self.sees(agent)

    def visible(self, agents: Iterable[str]) -> list[str]:
        """The agents of ``agents`` they see, sorted."""
        return sorted(agent for agent in agents if self.sees(agent))


@dataclass(frozen=True)
class _Key:
    secret: bytes
    principal: Principal


class Keys:
    """The configured keys; ``find`` compares a presented key with each in constant time."""

    def __init__(self, keys: Iterable[tuple[str, Principal]] = ()) -> None:
        self._keys = tuple(_Key(secret.encode(), principal) for secret, principal in keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def find(self, presented: str) -> Principal | None:
        """The principal of ``presented``, or None when it matches no key."""
        candidate = presented.strip().encode()
        found = None
        for key in self._keys:  # every key is compared: the time taken does not say which matched
            if hmac.compare_digest(candidate, key.secret):
                found = key.principal
        return found

    def fingerprint(self) -> bytes:
        """A digest of every key and its scope: signed sessions end when a key is added, changed or removed."""
        joined = b"\0".join(
            sorted(
                key.secret
                + b"\0"
                + key.principal.name.encode()
                + b"\0"
                + repr(
                    (
                        key.principal.read_only,
                        sorted(key.principal.agents) if key.principal.agents is not None else None,
                    )
                ).encode()
                for key in self._keys
            )
        )
        return hmac.digest(b"lousho-keys", joined, "sha256")

    @classmethod
    def parse(cls, single: SecretStr | None, listed: SecretStr | None) -> Keys:
        """Keys from ``LOUSHO_API_KEY`` and ``LOUSHO_API_KEYS``.

        Raises:
            ConfigurationError: an entry is malformed, a name repeats, or a key is shorter than ``MIN_KEY_LENGTH``
                (the message never quotes a key).
        """
        keys: list[tuple[str, Principal]] = []
        if single is not None and single.get_secret_value():
            keys.append((single.get_secret_value(), Principal("default")))
        text = listed.get_secret_value() if listed is not None else ""
        for number, entry in enumerate((item.strip() for item in text.split(",")), start=1):
            if entry:
                keys.append(_entry(entry, number))
        names = [principal.name for _, principal in keys]
        if len(set(names)) != len(names):
            raise errors.ConfigurationError("LOUSHO_API_KEYS: every key needs a name of its own")
        for secret, principal in keys:
            # LOUSHO_API_KEY predates the rule: a short one is kept working, the listed keys are held to it.
            if principal.name != "default" and len(secret) < MIN_KEY_LENGTH:
                raise errors.ConfigurationError(
                    f"API key {principal.name!r} is shorter than {MIN_KEY_LENGTH} characters"
                )
        return cls(keys)


def parse_access(options: Iterable[str]) -> tuple[bool, frozenset[str] | None]:
    """A key's options (``read``, ``agents=a|b``; empty ones ignored) as ``(read_only, agents)``.

    Raises:
        ValueError: an unknown option, or ``agents=`` that names no agent or a name no agent can have.
    """
    read_only, agents = False, None
    for option in (o.strip() for o in options):
        if option == "read":
            read_only = True
        elif option.startswith("agents="):
            named = [a.strip() for a in option.removeprefix("agents=").split("|") if a.strip()]
            if not named or not all(_AGENT.fullmatch(a) for a in named):
                raise ValueError("agents=a|b names agents")
            agents = frozenset(named)
        elif option:
            raise ValueError("unknown option (read, agents=a|b)")
    return read_only, agents


def _entry(entry: str, number: int) -> tuple[str, Principal]:
    head, *options = entry.split(";")
    name, sep, secret = head.partition("=")
    if not sep or not _NAME.fullmatch(name.strip()) or not secret.strip():
        raise errors.ConfigurationError(f"LOUSHO_API_KEYS entry {number} is not name=key[;read][;agents=a|b]")
    try:
        read_only, agents = parse_access(options)
    except ValueError as exc:
        raise errors.ConfigurationError(f"LOUSHO_API_KEYS entry {number}: {exc}") from None
    return secret.strip(), Principal(name.strip(), read_only, agents)


__all__ = ["MIN_KEY_LENGTH", "Keys", "Principal", "parse_access"]
