"""The agents of the interleaving test: a desk that can take every kind of turn, its sub-agent and its handoff target.

What a run does is chosen by its input: a user message ``in-<n>:<plan>`` names the plan its turns follow (``PLANS``),
so the state machine steers the agents through what it sends. A child run's prompt names its own plan
(``CHILD_PLANS``). The models and the tools report every call to an ``Observer`` before anything else happens, and
the observer checks, at that moment, what must hold then: the turn asked for is not saved already (I3), the call has
no stored result yet (I2), an approved call runs once (I5), a child's lead still exists (I17), and the request is one
the run could save (a step never calls the model with input it cannot save). A check that fails is noted, never
raised: the step would take an exception for a failure of its own.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, text

from store import errors, payloads, records
from store.records import Message
from worker import Agent, ModelLimit, ToolContext
from worker.agents import Tool
from worker.providers import MockModel
from worker.providers.base import ModelResponse, ToolSpec

DESK, RESEARCHER, BILLING = "desk", "researcher", "billing"
#: Seconds an approval of ``charge`` may wait: less than one passing of time in the test (``world.TIME_STEP``).
CHARGE_EXPIRES_S = 1800.0


def _look(topic: str) -> dict[str, Any]:
    return {"name": "look", "args": {"topic": topic}}


def _charge(order: str) -> dict[str, Any]:
    return {"name": "charge", "args": {"order": order}}


def _task(prompt: str, background: bool = False) -> dict[str, Any]:
    args: dict[str, Any] = {"agent": RESEARCHER, "prompt": prompt}
    if background:
        args["background"] = True
    return {"name": "task", "args": args}


#: Stands for the id of the run's latest background task (read from the transcript when the turn is asked for).
_LATEST_TASK = "<latest task>"

#: The desk's plans: the calls of each turn, in order; after the last turn the model answers with text.
PLANS: dict[str, list[list[dict[str, Any]]]] = {
    "chat": [],
    "look": [[_look("maps")]],
    "gated": [[_look("ledger"), _charge("o-1")]],
    "question": [[{"name": "ask_question", "args": {"question": "Which sea?"}}]],
    "task": [[_look("charts"), _task("fine")]],
    "task-broken": [[_look("charts"), _task("broken")]],
    "task-gated": [[_look("charts"), _task("gated")]],
    "gated-task": [[_charge("o-4"), _task("fine")]],
    "handoff": [[{"name": "transfer_to_billing", "args": {"reason": "a refund"}}, _charge("o-2")]],
    "background": [
        [_look("charts"), _task("fine", background=True)],
        [{"name": "agent_await", "args": {"task_id": _LATEST_TASK}}],
    ],
}
#: A child run's plans, by its prompt: ``broken`` parks the child (its tool stops the run), ``gated`` pauses it.
CHILD_PLANS: dict[str, list[list[dict[str, Any]]]] = {
    "fine": [[_look("tides")]],
    "broken": [[_look("broken")]],
    "gated": [[_charge("o-3")]],
}
#: Tools whose every execution needs a person's approval first.
GATED_TOOLS = ("charge",)


def input_tag(message: Message) -> str | None:
    """The ``in-<n>`` tag of a user message the test sent, or None (a child's prompt, an instruction)."""
    content = message.content
    if message.role != "user" or not isinstance(content, str) or not content.startswith("in-"):
        return None
    return content.split(":", 1)[0]


def input_text(number: int, plan: str, padding: str = "") -> str:
    """The text of input number ``number`` following ``plan``."""
    return f"in-{number}:{plan}:{padding}"


def _plan_of(prompt: str) -> tuple[str, list[list[dict[str, Any]]]]:
    """The tag and the turns of the input or prompt ``prompt``."""
    if prompt.startswith("in-"):
        tag, plan = prompt.split(":", 2)[:2]
        return tag, PLANS[plan]
    return prompt, CHILD_PLANS.get(prompt, [])


def _latest_task(messages: list[Message]) -> str:
    for message in reversed(messages):
        if message.role == "tool" and isinstance(message.content, str) and '"task_id"' in message.content:
            try:
                return str(json.loads(message.content).get("task_id", ""))
            except ValueError:
                continue
    return "none"


def respond(agent: str, messages: list[Message]) -> Any:
    """What ``agent``'s model answers to ``messages``: the next turn of the latest input's plan, else a text."""
    last_user = max((k for k, m in enumerate(messages) if m.role == "user"), default=-1)
    prompt = str(messages[last_user].content) if last_user >= 0 else ""
    tag, turns = _plan_of(prompt)
    since = sum(1 for m in messages[last_user + 1 :] if m.role == "assistant")
    if since >= len(turns):
        return f"{agent}: done {tag}"
    calls = []
    for k, call in enumerate(turns[since]):
        args = {
            key: (_latest_task(messages) if value == _LATEST_TASK else value) for key, value in call["args"].items()
        }
        calls.append({"id": f"{tag}-{since}-{k}", "name": call["name"], "args": args})
    return {"tool_calls": calls}


class _Current(threading.local):
    """The run whose step this thread delivers (a model call does not say which run it serves)."""

    session_id: str = ""
    delivery: int = 0


@dataclass
class Observer:
    """Every model and tool call of the test's agents, with what was wrong at the moment of the call.

    ``violations`` maps a kind of violation to its descriptions; the state machine asserts each kind is empty.
    ``on_tool`` is called in the step's thread just before a tool's effect: the state machine's interleaved actions.
    """

    engine: Engine
    violations: dict[str, list[str]] = field(default_factory=dict)
    executions: Counter[tuple[str, str]] = field(default_factory=Counter)
    model_calls: int = 0
    tool_calls: int = 0
    on_tool: Callable[[str], None] | None = None
    current: _Current = field(default_factory=_Current)

    def reset(self, on_tool: Callable[[str], None] | None) -> None:
        """Forget everything seen: a new example starts (the agents, made once, keep this observer)."""
        self.violations, self.executions, self.model_calls, self.tool_calls = {}, Counter(), 0, 0
        self.on_tool = on_tool

    def note(self, kind: str, description: str) -> None:
        self.violations.setdefault(kind, []).append(description)

    def _stored(self, session_id: str) -> tuple[bool, list[tuple[str, str | None]]]:
        """Whether the run exists, and the role and call id of each of its stored messages (the message rows)."""
        with self.engine.connect() as conn:
            exists = conn.execute(text("SELECT 1 FROM runs WHERE session_id = :sid"), {"sid": session_id}).first()
            rows = conn.execute(
                text(
                    "SELECT message ->> 'role', message ->> 'tool_call_id' FROM run_messages"
                    " WHERE session_id = :sid ORDER BY slot"
                ),
                {"sid": session_id},
            ).all()
        return exists is not None, [(str(role), call) for role, call in rows]

    def _lead_gone(self, session_id: str) -> bool:
        lead = records.lead_of(session_id)
        return lead is not None and not self._stored(lead)[0]

    def model_call(self, agent: str, messages: list[Message]) -> None:
        sid = self.current.session_id
        self.model_calls += 1
        # Characters first (cheap): only a transcript near the limit is measured as the store measures it.
        rough = sum(len(m.content) if isinstance(m.content, str) else 0 for m in messages)
        size = (
            sum(len(payloads.dumps(m.dump()).encode("utf-8")) for m in messages)
            if rough > payloads.MAX_CHECKPOINT // 2
            else rough
        )
        if size > payloads.MAX_CHECKPOINT:
            self.note(
                "unsavable-model-call",
                f"{sid}: the model was called with {size} bytes of transcript, over"
                f" the {payloads.MAX_CHECKPOINT} bytes a checkpoint may hold",
            )
        if self._lead_gone(sid):
            self.note("orphan-runs", f"{sid}: {agent}'s model was called after the run's lead was deleted")
        exists, stored = self._stored(sid)
        asked = sum(1 for m in messages if m.role == "assistant")
        saved = sum(1 for role, _ in stored if role == "assistant")
        if exists and saved > asked:
            self.note("I3", f"{sid}: turn {asked + 1} asked for again, {saved} turns are saved")

    def tool_call(self, name: str, ctx: ToolContext) -> None:
        sid, call_id = ctx.session_id, ctx.tool_call_id
        self.tool_calls += 1
        exists, stored = self._stored(sid)
        if exists and any(role == "tool" and call == call_id for role, call in stored):
            self.note("I2", f"{sid}: {name} call {call_id} ran though its result is stored")
        if self._lead_gone(sid):
            self.note("orphan-runs", f"{sid}: {name} call {call_id} ran after the run's lead was deleted")
        self.executions[(sid, call_id)] += 1
        if name in GATED_TOOLS and self.executions[(sid, call_id)] > 1:
            self.note("I5", f"{sid}: approved call {call_id} ran {self.executions[(sid, call_id)]} times")
        if self.on_tool is not None:
            self.on_tool(sid)


class ScriptedModel:
    """The plan-following model of one agent, reporting each call to the observer first."""

    #: Its usage is an estimate (``MockModel``'s): nothing to keep across a crash.
    reports_usage = False

    def __init__(self, agent: str, observer: Observer) -> None:
        self.model_id = f"interleave-{agent}"
        self._agent = agent
        self._observer = observer
        self._inner = MockModel(lambda messages: respond(agent, messages), model_id=self.model_id)

    def generate(self, messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        self._observer.model_call(self._agent, messages)
        return self._inner.generate(messages, tools)


#: The desk's model calls share one slot with another process (the ``model_slot`` rule takes and frees it).
DESK_LIMIT = ModelLimit("interleave-desk", concurrent=1)


def build_agents(observer: Observer) -> dict[str, Agent]:
    """The desk (every kind of turn), its researcher sub-agent and its billing handoff target, by name.

    Made once per test: the step machine keeps agents it derives (a handoff's target) by the agents' identity.
    """

    def look(topic: str, ctx: ToolContext) -> str:
        """Look a topic up."""
        observer.tool_call("look", ctx)
        if topic == "broken":
            raise errors.PropagatingToolError("the archive is down")
        return f"notes on {topic}"

    def charge(order: str, ctx: ToolContext) -> str:
        """Charge an order (a person approves first)."""
        observer.tool_call("charge", ctx)
        return f"charged {order}"

    looking = Tool(look, name="look")
    charging = Tool(charge, name="charge", needs_approval=True, expires_in=CHARGE_EXPIRES_S)
    researcher = Agent(RESEARCHER, ScriptedModel(RESEARCHER, observer), tools=[looking, charging], tool_concurrency=1)
    billing = Agent(
        BILLING,
        ScriptedModel(BILLING, observer),
        instructions="You are the billing desk.",
        tools=[looking],
        tool_concurrency=1,
    )
    desk = Agent(
        DESK,
        ScriptedModel(DESK, observer),
        instructions="You are the front desk.",
        tools=[looking, charging],
        subagents=[researcher],
        handoffs=[billing],
        ask_question=True,
        tool_concurrency=1,
        max_steps=20,
        model_limit=DESK_LIMIT,
    )
    return {agent.name: agent for agent in (desk, researcher, billing)}
