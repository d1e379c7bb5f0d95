"""Spend limits of a run (``Limits``) and the prices that turn its token usage into cost (``Prices``).

Shared by the agents that set them (``worker``) and the producers that raise them on ``resume`` (``producer``).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from store.records import Usage

__all__ = ["Limits", "Prices"]


class Limits(BaseModel):
    """What one input of a run may spend; checked before each model call.

    Counted per input, like ``steps`` and ``usage``: a follow-up to a finished run starts from zero. A run
    that reached a limit (the limit itself included) stops with ``finish_reason="budget-exceeded"`` (in
    progress, left alone by the sweep) until ``resume(..., limits=...)`` raises it. ``max_duration_s`` is wall
    time on Postgres's clock from the input's first step, without the time the run waited on approvals or stood
    stopped. ``max_cost`` needs ``Prices`` for the agent's model. None leaves a dimension unlimited.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_cost: float | None = None
    max_duration_s: float | None = None

    @field_validator("max_input_tokens", "max_output_tokens", "max_cost", "max_duration_s")
    @classmethod
    def _positive(cls, value: float | None) -> float | None:
        if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value <= 0):
            raise ValueError("limits must be positive numbers (None: unlimited)")
        return value

    def stored(self) -> dict[str, Any]:
        """The limits set, as JSON."""
        return self.model_dump(exclude_none=True)


class Prices(BaseModel):
    """What a model costs, per million tokens (in whatever currency ``max_cost`` is given in).

    Cached reads and cache writes cost ``cache_read`` and ``cache_write`` when given, else ``input``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    input: float
    output: float
    cache_read: float | None = None
    cache_write: float | None = None

    @field_validator("input", "output", "cache_read", "cache_write")
    @classmethod
    def _not_negative(cls, value: float | None) -> float | None:
        if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value < 0):
            raise ValueError("prices must be numbers of at least 0")
        return value

    def cost(self, usage: Usage) -> float:
        """The cost of ``usage`` (input tokens include cached ones, as providers report them)."""
        cache_read = self.input if self.cache_read is None else self.cache_read
        cache_write = self.input if self.cache_write is None else self.cache_write
        plain_input = max(usage.input_tokens - usage.cache_read_tokens - usage.cache_write_tokens, 0)
        return (
            plain_input * self.input
            + usage.cache_read_tokens * cache_read
            + usage.cache_write_tokens * cache_write
            + usage.output_tokens * self.output
        ) / 1_000_000
