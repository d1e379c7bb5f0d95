"""Model specs: a model written down as JSON without secrets, and a model found or built again from one.

A dynamic agent saves the spec of the model its ``resolve`` chose with the run, so a worker that picks the run
up later uses the same model. It must not hold a key, a client option or a header: a spec is stored in the
run's checkpoint and shown wherever the checkpoint is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from store import errors
from worker.providers import _clients
from worker.providers.anthropic import DEFAULT_MAX_TOKENS, AnthropicModel
from worker.providers.base import Model
from worker.providers.mock import MockModel
from worker.providers.openai import OpenAIModel

__all__ = ["model_from_spec", "model_spec"]

#: The classes whose spec names their provider alone (``openai``, ``anthropic``, ``mock``).
_NAMED = (OpenAIModel, AnthropicModel, MockModel)


def model_spec(model: Model) -> dict[str, Any]:
    """The spec of ``model``: ``provider``, ``model_id`` and, for the SDK models, how they were built.

    ``provider`` is ``openai``, ``anthropic`` or ``mock`` for those classes, else ``<module>:<qualname>`` of
    the model's class (a subclass of one of them included: it is not built again from its spec). For
    ``OpenAIModel`` and ``AnthropicModel`` the spec also has ``base_url`` (when one was given), ``timeout``
    (when not the default), the JSON settings the model was built with (``settings``) and, for Anthropic,
    ``max_tokens`` and ``cache_prompt``; never the key, client options or headers (``left_out`` names what
    was held back). Values are as JSON reads them back, so a spec equals its stored copy.
    """
    kind = type(model)
    qualified = f"{kind.__module__}:{kind.__qualname__}"
    if isinstance(model, _clients.SDKModel | MockModel):
        spec = model.spec()
        if kind not in _NAMED:
            spec["provider"] = qualified
        return spec
    return {"provider": qualified, "model_id": str(model.model_id)}


def model_from_spec(spec: Mapping[str, Any], candidates: Iterable[Model] = ()) -> Model:
    """The model ``spec`` describes: the first of ``candidates`` with that spec, else one built from it.

    Only ``OpenAIModel`` and ``AnthropicModel`` are built from a spec, with the key from the provider's usual
    environment variable (``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``), and only when nothing was left out of
    it (client options, headers). Any other model, a ``MockModel`` among them, must be among ``candidates``
    (an agent's ``models``); two of them with the same spec are taken for one another.

    Raises:
        ConfigurationError: no candidate has the spec and it cannot be built (the message says to list the
            model in ``Agent(models=[...])``), or building it failed (no key in the environment, say).
    """
    wanted = dict(spec)
    for candidate in candidates:
        if model_spec(candidate) == wanted:
            return candidate
    build = _BUILDERS.get(str(wanted.get("provider")))
    if build is not None and "left_out" not in wanted:
        try:
            model = build(wanted)
        except (KeyError, TypeError, ValueError):
            model = None
        if model is not None and model_spec(model) == wanted:
            return model
    raise errors.ConfigurationError(
        f"no model of the agent matches the run's saved model (provider {wanted.get('provider')!r}, model id "
        f"{wanted.get('model_id')!r}) and it cannot be built from its spec: list it in Agent(models=[...])"
    )


def _model_name(spec: Mapping[str, Any], provider: str) -> str:
    model_id = spec["model_id"]
    if not isinstance(model_id, str) or not model_id.startswith(f"{provider}:"):
        raise ValueError("not a model id of this provider")
    return model_id.removeprefix(f"{provider}:")


def _openai(spec: Mapping[str, Any]) -> Model:
    return OpenAIModel(
        _model_name(spec, "openai"),
        base_url=spec.get("base_url"),
        timeout=spec.get("timeout", _clients.DEFAULT_TIMEOUT_S),
        **dict(spec.get("settings") or {}),
    )


def _anthropic(spec: Mapping[str, Any]) -> Model:
    return AnthropicModel(
        _model_name(spec, "anthropic"),
        base_url=spec.get("base_url"),
        timeout=spec.get("timeout", _clients.DEFAULT_TIMEOUT_S),
        max_tokens=spec.get("max_tokens", DEFAULT_MAX_TOKENS),
        cache_prompt=bool(spec.get("cache_prompt")),
        **dict(spec.get("settings") or {}),
    )


#: How a spec of each provider that can be rebuilt becomes a model again.
_BUILDERS: dict[str, Callable[[Mapping[str, Any]], Model]] = {"openai": _openai, "anthropic": _anthropic}
