"""Agent and tool definitions, the agent registry, and agent fingerprints.

An ``Agent`` is configuration only; running it is the step machine's and the task's job.

Stays whole: ``Agent``, ``tool`` and ``ToolContext`` are the user's API, documented and read together.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, TypedDict, Unpack, get_type_hints, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from store import errors, records
from store.limits import Limits, Prices
from store.model_limit import ModelLimit
from worker import business
from worker.providers.base import Model, ToolSpec

DriftPolicy = Literal["warn", "error", "ignore"]


@dataclass
class ToolContext(business.Holder):
    """What a tool learns about the call it serves.

    ``tool_call_id`` is stable across re-runs of the same call: use it as the idempotency key
    of side effects. ``attempt`` is 1 on a call's first execution and 2 or more when an earlier start of its
    step may have run it already (a worker died, a step failed after saving some results); it is derived from
    the step's start count, so it costs no write per call.

    ``business_state`` is the only field a tool may change: assign it (or change the value in place) and the new
    value is saved with the call's result, in the same fenced save, so it is never lost once the result is
    recorded and never kept without it. Every other field is read-only.
    """

    tool_call_id: str
    session_id: str
    agent: str
    step: int
    #: The run's business state as the call starts (a copy: changing it changes nothing until the call returns).
    business_state: Any = None
    #: The saved state (checkpoint seq) the call's batch started from; for diagnostics and checkers.
    checkpoint_seq: int = 0
    #: Set when the run is aborted while the call runs: stop early if you can (the call then gets a
    #: ``cancelled`` result, whatever it returns). Wait on it like any ``threading.Event``.
    cancelled: threading.Event = field(default_factory=threading.Event, compare=False)
    #: The approval a person decided to let this call run (a ``needs_approval`` call once approved), else None: tie
    #: the effect to the decision with it. Like ``tool_call_id`` it names one call of the model; a call the model
    #: asks again is a new call with a new approval, so an effect due once per business event needs a key of its own.
    approval_id: str | None = None
    #: 1 on the call's first execution; 2+ when an earlier start of its step may have run it (see above).
    attempt: int = 1


class ToolArgsInvalid(Exception):
    """The model's arguments do not match the tool's input schema."""


ApprovalRule = bool | Callable[[dict[str, Any], ToolContext], bool]
#: ``reconcile(args, ctx)`` of a ``once`` tool: the call's result if its effect happened, None if it did not.
Reconcile = Callable[[dict[str, Any], ToolContext], Any]


class Tool:
    """A function the model may call, with its input schema derived from the signature."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        needs_approval: ApprovalRule = False,
        timeout: float | None = None,
        expires_in: float | None = None,
        once: bool = False,
        reconcile: Reconcile | None = None,
    ) -> None:
        _positive_seconds(timeout, f"tool {name or fn.__name__!r}: timeout")
        _positive_seconds(expires_in, f"tool {name or fn.__name__!r}: expires_in")
        if reconcile is not None and not once:
            raise errors.ConfigurationError(f"tool {name or fn.__name__!r}: reconcile= needs once=True")
        if reconcile is not None and not callable(reconcile):
            raise errors.ConfigurationError(f"tool {name or fn.__name__!r}: reconcile must be callable")
        #: Each call is marked started (saved) before it runs; one its worker died in is reconciled, never re-run.
        self.once = bool(once)
        #: ``reconcile(args, ctx)``: the result of a call whose effect happened, None if it did not (reads only).
        self.reconcile = reconcile
        #: Seconds an approval of a call may wait for a decision; then it counts as rejected (None: the agent's).
        self.expires_in = expires_in
        self.fn = fn
        #: Seconds a call may run; past them it gets a ``timeout`` error result (the step goes on).
        self.timeout = timeout
        self.name = name or fn.__name__
        self.description = (description or inspect.getdoc(fn) or "").strip()
        self.needs_approval = needs_approval
        self._context_param, self.input_model = _input_model(fn, self.name)
        self.is_async = inspect.iscoroutinefunction(fn)

    @functools.cached_property
    def input_schema(self) -> dict[str, Any]:
        """JSON schema of the arguments (built once: a tool does not change after it is defined)."""
        return self.input_model.model_json_schema()

    @functools.cached_property
    def _spec(self) -> ToolSpec:
        return ToolSpec(name=self.name, description=self.description, input_schema=self.input_schema)

    def spec(self) -> ToolSpec:
        """What a model provider is told about the tool."""
        return self._spec

    def validate(self, args: dict[str, Any]) -> dict[str, Any]:
        """The validated keyword arguments; raises ``ToolArgsInvalid`` with a short reason."""
        try:
            parsed = self.input_model.model_validate(args)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}" for e in exc.errors()[:10]
            )
            raise ToolArgsInvalid(problems) from None
        return {field: getattr(parsed, field) for field in type(parsed).model_fields}

    def invoke(self, args: dict[str, Any], context: ToolContext) -> Any:
        """Validate and run the tool with its context."""
        kwargs = self.validate(args)
        if self._context_param:
            kwargs[self._context_param] = context
        if self.is_async:
            return asyncio.run(self.fn(**kwargs))
        return self.fn(**kwargs)

    def reconciled(self, args: dict[str, Any], context: ToolContext) -> Any:
        """What ``reconcile`` says of a call its worker died in: its result, or None when the effect did not happen.

        ``reconcile`` gets the arguments as the tool got them (validated against its input schema). It is called at
        least once per interrupted call, so it must only read. Raises whatever ``reconcile`` raises, and
        ``ToolArgsInvalid`` when the arguments no longer fit the tool's schema.
        """
        assert self.reconcile is not None
        outcome = self.reconcile(self.validate(args), context)
        if inspect.iscoroutine(outcome):  # an ``async def`` reconcile
            outcome = asyncio.run(outcome)
        return outcome

    def requires_approval(self, args: dict[str, Any], context: ToolContext) -> bool:
        """Whether this call must wait for a human decision."""
        rule = self.needs_approval
        return bool(rule(args, context)) if callable(rule) else bool(rule)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the tool's function directly (outside a run)."""
        return self.fn(*args, **kwargs)


def _positive_seconds(value: float | None, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
        raise errors.ConfigurationError(f"{what} must be a positive number of seconds")


def _check_spend(name: str, limits: Limits | None, prices: Prices | None) -> None:
    """Refuse limits and prices that are not ``Limits`` and ``Prices``, and a ``max_cost`` without prices."""
    if limits is not None and not isinstance(limits, Limits):
        raise errors.ConfigurationError(f"agent {name!r}: limits must be a Limits")
    if prices is not None and not isinstance(prices, Prices):
        raise errors.ConfigurationError(f"agent {name!r}: prices must be a Prices")
    if limits is not None and limits.max_cost is not None and prices is None:
        raise errors.ConfigurationError(
            f"agent {name!r}: limits.max_cost needs prices for its model (Agent(..., prices=Prices(...)))"
        )


def _input_model(fn: Callable[..., Any], name: str) -> tuple[str | None, type[BaseModel]]:
    try:
        hints = get_type_hints(fn)
    except Exception:  # unresolvable annotations: fall back to the raw ones
        hints = dict(getattr(fn, "__annotations__", {}))
    fields: dict[str, Any] = {}
    context_param = None
    for param in inspect.signature(fn).parameters.values():
        annotation = hints.get(param.name, Any)
        if annotation is ToolContext or param.name == "ctx":
            context_param = param.name
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, default)
    model = create_model(f"{name}_input", __config__=ConfigDict(extra="forbid"), **fields)
    return context_param, model


class ToolOptions(TypedDict, total=False):
    """The options of ``tool`` (each as ``Tool`` takes it)."""

    name: str | None
    description: str | None
    needs_approval: ApprovalRule
    timeout: float | None
    expires_in: float | None
    once: bool
    reconcile: Reconcile | None


@overload
def tool(fn: Callable[..., Any], **options: Unpack[ToolOptions]) -> Tool: ...


@overload
def tool(fn: None = None, **options: Unpack[ToolOptions]) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, **options: Unpack[ToolOptions]
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a function into a ``Tool``; usable bare (``@tool``) or with options (``@tool(...)``).

    ``timeout`` (seconds): a call that runs longer gets a ``timeout`` error result the model sees, instead of
    holding the step until its time limit; the call is told through ``ctx.cancelled`` and its late answer is
    dropped (it may still take effect: make it idempotent). ``expires_in`` (seconds): an approval of a call
    left undecided that long counts as rejected (default: the agent's ``approval_expires_in``).

    ``once=True``: the call's effect must not happen twice. It is marked started in Postgres before it runs, and a
    call its worker died in is not run again blindly: ``reconcile(args, ctx)`` says whether its effect happened
    (returning the call's result) or not (None: the call runs again); without ``reconcile``, or while it keeps
    failing past the retry budget, the run waits on an approval of kind ``reconcile`` that a person resolves.

    Raises:
        ConfigurationError: an option has a value that cannot be used (``reconcile`` without ``once``, say).
    """

    def wrap(target: Callable[..., Any]) -> Tool:
        return Tool(target, **options)

    return wrap(fn) if fn is not None else wrap


#: The built-in tool of ``Agent(ask_question=True)``.
ASK_QUESTION = "ask_question"
#: The built-in tool of ``Agent(subagents=[...])``: a child run of one of them.
TASK = "task"


#: The tools that follow a background task (``task(..., background=True)``) by its ``task_id``.
AGENT_STATUS, AGENT_AWAIT, AGENT_CANCEL = "agent_status", "agent_await", "agent_cancel"
#: Every built-in tool of an agent with sub-agents.
SUBAGENT_TOOLS = (TASK, AGENT_STATUS, AGENT_AWAIT, AGENT_CANCEL)


def _task(agent: str, prompt: str, description: str = "", background: bool = False) -> str:
    """Give a task to a sub-agent: it sees only ``prompt`` (not this conversation) and answers with its final text.

    Several task calls in one turn run at the same time. ``description`` is a few words for people watching.
    With ``background=True`` the call returns a ``task_id`` at once and the sub-agent works on while you go on;
    follow it with ``agent_status``, ``agent_await`` or ``agent_cancel``.
    """
    raise errors.ConfigurationError("a task runs as a child run, never as a function")


def agent_status(task_id: str) -> str:
    """Where a background task stands (running, finished with its answer, paused, failed or cancelled)."""
    raise errors.ConfigurationError("answered by the step from the task's run")


def agent_await(task_id: str) -> str:
    """Wait for a background task to finish and get its answer."""
    raise errors.ConfigurationError("answered by the step from the task's run")


def agent_cancel(task_id: str) -> str:
    """Stop a background task."""
    raise errors.ConfigurationError("answered by the step from the task's run")


def _task_tool(names: list[str]) -> Tool:
    """The ``task`` tool, its ``agent`` argument limited to ``names``."""
    task = Tool(_task, name=TASK)
    choice: Any = Literal[tuple(names)]
    task.input_model = create_model(
        f"{TASK}_input",
        __config__=ConfigDict(extra="forbid"),
        agent=(choice, ...),
        prompt=(str, ...),
        description=(str, ""),
        background=(bool, False),
    )
    return task


#: The name prefix of the tools that hand a run to another agent (``Agent(handoffs=[...])``).
HANDOFF_PREFIX = "transfer_to_"


def _ask_question(question: str, options: list[str] | None = None) -> str:
    """Ask the person behind this run a question and wait for the answer (it may take days).

    Give ``options`` when the answer is one of a few choices. The result is ``{"answer": ...}``, or an
    error result when the person declines.
    """
    raise errors.ConfigurationError("ask_question is answered by a person; it never runs")


def _check_callables(agent: str, **given: Any) -> None:
    """Refuse an agent option that must be a function and is not (None leaves it out)."""
    for what, value in given.items():
        if value is not None and not callable(value):
            raise errors.ConfigurationError(f"agent {agent!r}: {what} must be callable")


class Agent:
    """A model, instructions and tools, under a name the workers and producers share.

    - ``ask_question=True`` adds the built-in ``ask_question`` tool: a call pauses the run on an approval of
      kind ``question`` until a person answers it (``approvals.resolve(id, answer=...)``) or declines it.
    - ``hooks``: objects with any of ``pre_generate``, ``post_generate``, ``pre_tool_call``, ``post_tool_call``
      and ``on_run_end`` (``worker.hooks``), run in order.
    - ``limits`` (``Limits``) stop a run's input at a spend budget (``finish_reason="budget-exceeded"``);
      ``max_cost`` needs ``prices`` (``Prices``, per million tokens).
    - ``approval_expires_in`` (seconds): an approval or question left undecided that long counts as rejected
      (a tool's own ``expires_in`` wins).
    - ``handoffs``: agents this one may hand the run to. Each adds a ``transfer_to_<name>`` tool; the first such
      call of a turn moves the run to that agent (its model, tools and instructions; the run's hooks, limits and
      step budget stay), for every later step and resume. At most ``max_handoffs`` per input.
    - ``subagents``: agents this one may give tasks to (the ``task`` tool starts a child run of one), nested at most
      ``max_subagent_depth`` deep; background tasks still running at the run's answer are cancelled, or awaited
      (``background_on_finish``).
    - ``resolve``: a dynamic agent. ``resolve(ctx)`` runs on the worker when an input starts and returns a
      ``RunConfig`` (model, tools, instructions) chosen from ``ctx.input`` and ``ctx.metadata``; the model
      chosen is saved with the run, and a worker that picks the run up later uses it. ``model`` is then a
      default for ``RunConfig`` fields left None, and ``models`` lists the models a saved choice may name that
      cannot be rebuilt from their spec alone (a ``MockModel``, a model with custom client options).
    - ``model_limit`` (``ModelLimit``): concurrent calls, requests and tokens per minute shared by every worker of
      the fleet with every agent naming the same key; a step that must wait holds no worker process.
    - ``on_recovered(run)`` and ``on_error(error, run)``: the recovery sweep's report on a run of this agent that it
      sent on (one that stopped moving, or was due for a retry). ``on_recovered`` once the run's input ended
      (finished, paused on a person, stopped), ``on_error`` once it failed again (``run.last_error``); each at most
      once per recovery, from a sweep on a worker that loads this agent (``worker.recovery``).
    """

    def __init__(
        self,
        name: str,
        model: Model | None = None,
        instructions: str = "",
        tools: Iterable[Tool] = (),
        max_steps: int = 10,
        tool_concurrency: int = 4,
        on_agent_drift: DriftPolicy = "warn",
        ask_question: bool = False,
        hooks: Iterable[Any] = (),
        limits: Limits | None = None,
        prices: Prices | None = None,
        approval_expires_in: float | None = None,
        resolve: Callable[[Any], Any] | None = None,
        models: Iterable[Model] = (),
        handoffs: Iterable[Agent] = (),
        max_handoffs: int = 5,
        subagents: Iterable[Agent] = (),
        max_subagent_depth: int = 1,
        background_on_finish: Literal["cancel", "await"] = "cancel",
        on_recovered: Callable[[records.SweptRun], Any] | None = None,
        on_error: Callable[[records.LastError, records.SweptRun], Any] | None = None,
        model_limit: ModelLimit | None = None,
    ) -> None:
        records.validate_agent_name(name)
        if max_steps < 1:
            raise errors.ConfigurationError("max_steps must be at least 1")
        if tool_concurrency < 1:
            raise errors.ConfigurationError("tool_concurrency must be at least 1")
        if on_agent_drift not in ("warn", "error", "ignore"):
            raise errors.ConfigurationError("on_agent_drift must be 'warn', 'error' or 'ignore'")
        if model is None and resolve is None:
            raise errors.ConfigurationError(f"agent {name!r} needs a model, or a resolve function that chooses one")
        _check_callables(name, resolve=resolve, on_recovered=on_recovered, on_error=on_error)
        _positive_seconds(approval_expires_in, f"agent {name!r}: approval_expires_in")
        _check_spend(name, limits, prices)
        listed = list(tools)
        #: What the agent was defined with (``replace`` builds a variant from it; built-in tools are not in it).
        self._defined: dict[str, Any] = {
            "name": name,
            "model": model,
            "instructions": instructions,
            "tools": tuple(listed),
            "max_steps": max_steps,
            "tool_concurrency": tool_concurrency,
            "on_agent_drift": on_agent_drift,
            "ask_question": ask_question,
            "hooks": tuple(hooks),
            "limits": limits,
            "prices": prices,
            "approval_expires_in": approval_expires_in,
            "resolve": resolve,
            "models": tuple(models),
            "handoffs": tuple(handoffs),
            "max_handoffs": max_handoffs,
            "subagents": tuple(subagents),
            "max_subagent_depth": max_subagent_depth,
            "background_on_finish": background_on_finish,
            "on_recovered": on_recovered,
            "on_error": on_error,
            "model_limit": model_limit,
        }
        self.name = name
        self.model = model
        self.instructions = instructions
        if ask_question:
            listed.append(Tool(_ask_question, name=ASK_QUESTION, needs_approval=True))
        self.ask_question = ask_question
        self.tools = {t.name: t for t in listed}
        if len(self.tools) != len(listed):
            raise errors.ConfigurationError(f"agent {name!r} has two tools with one name")
        self.max_steps = max_steps
        self.tool_concurrency = tool_concurrency
        self.on_agent_drift = on_agent_drift
        self.hooks = tuple(hooks)
        self.limits = limits
        self.prices = prices
        self.approval_expires_in = approval_expires_in
        self.resolve = resolve
        self.models = tuple(models)
        if max_handoffs < 0:
            raise errors.ConfigurationError("max_handoffs must be at least 0")
        self.max_handoffs = max_handoffs
        #: Handoff targets by name; their ``transfer_to_<name>`` tools are in ``tools``.
        self.handoffs: dict[str, Agent] = {}
        for target in handoffs:
            self._add_handoff(target)
        if max_subagent_depth < 1:
            raise errors.ConfigurationError("max_subagent_depth must be at least 1")
        self.max_subagent_depth = max_subagent_depth
        #: Sub-agents by name: the ``task`` tool starts a child run of one of them.
        self.subagents: dict[str, Agent] = {}
        self._add_subagents(list(subagents))
        if background_on_finish not in ("cancel", "await"):
            raise errors.ConfigurationError("background_on_finish must be 'cancel' or 'await'")
        #: What happens to background tasks still running when the run's answer comes: stop them, or wait.
        self.background_on_finish = background_on_finish
        #: The recovery sweep's report on a run it sent on: its input ended since, or it failed again.
        self.on_recovered = on_recovered
        self.on_error = on_error
        if model_limit is not None and not isinstance(model_limit, ModelLimit):
            raise errors.ConfigurationError(f"agent {name!r}: model_limit must be a ModelLimit")
        #: The fleet-wide limit its model calls share with every agent naming the same key (``LOUSHO_MODEL_LIMITS``
        #: wins over its numbers).
        self.model_limit = model_limit

    def _add_subagents(self, children: list[Agent]) -> None:
        for child in children:
            if not isinstance(child, Agent) or child.name in self.subagents or child.name == self.name:
                raise errors.ConfigurationError(
                    f"agent {self.name!r}: sub-agents must be other agents, each listed once"
                )
            self.subagents[child.name] = child
        if self.subagents:
            taken = sorted(set(SUBAGENT_TOOLS) & set(self.tools))
            if taken:
                raise errors.ConfigurationError(f"agent {self.name!r} has sub-agents and tools named {taken}")
            self.tools[TASK] = _task_tool(sorted(self.subagents))
            for follow in (agent_status, agent_await, agent_cancel):
                self.tools[follow.__name__] = Tool(follow)

    def _add_handoff(self, target: Agent) -> None:
        if not isinstance(target, Agent) or target.resolve is not None:
            raise errors.ConfigurationError(f"agent {self.name!r}: a handoff target must be a static Agent")
        tool_name = HANDOFF_PREFIX + target.name
        if target.name == self.name or tool_name in self.tools:
            raise errors.ConfigurationError(
                f"agent {self.name!r}: cannot hand off to {target.name!r} (listed twice,"
                " itself, or a tool has the name)"
            )

        def transfer(reason: str = "") -> str:
            raise errors.ConfigurationError("a handoff is recorded by the step, never run")

        self.handoffs[target.name] = target
        self.tools[tool_name] = Tool(
            transfer,
            name=tool_name,
            description=(
                f"Hand this conversation over to {target.name}"
                + (f": {target.description_for_handoff}" if target.description_for_handoff else "")
                + ". Give the reason; the other agent continues from here."
            ),
        )

    @property
    def description_for_handoff(self) -> str:
        """What the ``transfer_to_`` tool says of this agent: the first line of its instructions."""
        return self.instructions.strip().splitlines()[0][:200] if self.instructions.strip() else ""

    def replace(self, **changes: Any) -> Agent:
        """A new agent defined like this one but for ``changes`` (``Agent``'s keywords; ``tools`` without built-ins).

        Raises:
            ConfigurationError: the changed definition is not valid.
        """
        return Agent(**{**self._defined, **changes})

    def tool_specs(self) -> list[ToolSpec]:
        """What the model is told about the tools."""
        return [t.spec() for t in self.tools.values()]  # each spec is built once per tool

    def fingerprint(self) -> dict[str, Any]:
        """Model id, each tool's name with a hash of its input schema, a hash of the instructions (computed once)."""
        known: dict[str, Any] | None = self.__dict__.get("_fingerprint")
        if known is not None:
            return known
        tools = {name: _sha(json.dumps(t.input_schema, sort_keys=True)) for name, t in sorted(self.tools.items())}
        parts = {
            "model": getattr(self.model, "model_id", type(self.model).__name__),
            "tools": tools,
            "instructions": _sha(self.instructions),
        }
        parts["hash"] = _sha(json.dumps(parts, sort_keys=True))[:16]
        self.__dict__["_fingerprint"] = parts
        return parts

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, tools={list(self.tools)})"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def reachable(agents: Iterable[Agent]) -> list[Agent]:
    """``agents`` and every agent they hand off to or start as sub-agents, at any depth, each once."""
    found: dict[int, Agent] = {}
    pending = list(agents)
    while pending:
        agent = pending.pop()
        if id(agent) not in found:
            found[id(agent)] = agent
            pending.extend([*agent.handoffs.values(), *agent.subagents.values()])
    return list(found.values())


def import_agent_modules(modules: Iterable[str]) -> list[ModuleType]:
    """Import the modules named in ``LOUSHO_AGENTS``.

    Like ``celery -A``, modules next to where the worker was started are importable.

    Raises:
        ConfigurationError: a module cannot be imported.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    imported = []
    for module_name in modules:
        try:
            imported.append(importlib.import_module(module_name))
        except ImportError as exc:
            raise errors.ConfigurationError(f"cannot import agent module {module_name!r}: {exc}") from exc
    return imported


def load_agents(modules: Iterable[str]) -> dict[str, Agent]:
    """Import each module and collect the ``Agent`` objects defined at its top level.

    Raises:
        ConfigurationError: a module cannot be imported, or two agents share a name.
    """
    found: dict[str, Agent] = {}
    for module in import_agent_modules(modules):
        for value in vars(module).values():
            if isinstance(value, Agent):
                other = found.get(value.name)
                if other is not None and other is not value:
                    raise errors.ConfigurationError(f"two agents are named {value.name!r}")
                found[value.name] = value
    return found
