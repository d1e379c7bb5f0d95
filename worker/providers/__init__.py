"""Model providers: the ``Model`` port, ``MockModel`` (scripted), ``OpenAIModel`` and ``AnthropicModel``."""

from __future__ import annotations

from worker.providers.anthropic import AnthropicModel
from worker.providers.base import Model, ModelResponse, ToolSpec
from worker.providers.mock import MockModel
from worker.providers.openai import OpenAIModel

__all__ = ["AnthropicModel", "MockModel", "Model", "ModelResponse", "OpenAIModel", "ToolSpec"]
