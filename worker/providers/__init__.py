"""Model providers: the ``Model`` port and ``MockModel`` (scripted)."""

from __future__ import annotations

from worker.providers.base import Model, ModelResponse, ToolSpec
from worker.providers.mock import MockModel

__all__ = ["MockModel", "Model", "ModelResponse", "ToolSpec"]
