"""Agents for the crash tests: a scripted model and sleeping tools that log every call they serve.

Workers import this module through ``LOUSHO_AGENTS=tests.support.agents``. Every model call and
tool execution appends one JSONL line to ``LOUSHO_TEST_LOG`` with a single ``os.write`` on an
``O_APPEND`` descriptor, so the line survives a SIGKILL of the writer a moment later. The checker
(``tests.support.checker``) reads these lines; nothing here decides whether a run was correct.

A run's shape comes from its first user message, ``run <session_id> [key=value ...]``:

``turns=N``          model turns including the final text (default 3)
``calls=3,2``        tool calls per tool turn (default ``3,2``; repeated when shorter than needed)
``sleep=20-100``     range of each call's sleep in ms (chosen deterministically per call)
``slow=T.K:MS``      call K of turn T sleeps MS ms instead (several allowed, comma separated)
``model=MS``         model latency of every turn (default 50 ms)
``slowmodel=T:MS``   model latency of turn T (several allowed, comma separated)
``gate=T.K``         call K of turn T uses ``approved_work``, which needs a human approval
``once=T.K``         call K of turn T uses ``once_work`` (``once``, reconciled by reading its effect back)
``unchecked=T.K``    call K of turn T uses ``once_unchecked`` (``once`` without ``reconcile``: a person decides)
``after=T.K:MS``     call K of turn T sleeps MS ms more after its effect (a kill can land there)

Every tool logs ``ctx.attempt`` in its start line. The ``once`` tools apply their effect to the once sink
(``checker.ONCE_TABLE``, one row per call naming the execution that applied it) in the same transaction as the
idempotent sink of I12; ``once_work``'s ``reconcile`` reads it back and logs a ``reconcile`` line.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from store.records import Message
from tests.support.checker import (
    APPROVED_TOOL,
    EFFECTS_ENV,
    EFFECTS_TABLE,
    LOG_ENV,
    ONCE_TABLE,
    ONCE_TOOL,
    UNCHECKED_TOOL,
    response_tag,
    transcript_digest,
)
from worker import Agent, Tool, ToolContext, tool
from worker.machine import transcript_problems
from worker.providers import MockModel, ModelResponse, ToolSpec

DUPLICATE_ENV = "LOUSHO_TEST_DUPLICATE"

_fds: dict[tuple[int, str], int] = {}
_fd_lock = threading.Lock()


def log_event(record: dict[str, Any]) -> None:
    """Append one JSON line to the test log (no-op when ``LOUSHO_TEST_LOG`` is unset)."""
    append_event(os.environ.get(LOG_ENV), record)


def append_event(path: str | None, record: dict[str, Any]) -> None:
    """Append ``record`` (stamped with time and pid) as one JSON line to ``path``, in one ``os.write`` on an
    ``O_APPEND`` descriptor kept per process, so a SIGKILL never leaves half a line behind another."""
    if not path:
        return
    line = {"ts": time.time(), "pid": os.getpid(), **record}
    data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
    key = (os.getpid(), path)
    with _fd_lock:
        fd = _fds.get(key)
        if fd is None:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _fds[key] = fd
    os.write(fd, data)


@dataclass(frozen=True)
class RunShape:
    """What a run asks of the model and tools, parsed from its first user message."""

    run_id: str
    turns: int = 3
    calls: tuple[int, ...] = (3, 2)
    sleep_ms: tuple[int, int] = (20, 100)
    slow: dict[tuple[int, int], int] = field(default_factory=dict)
    model_ms: int = 50
    slow_model: dict[int, int] = field(default_factory=dict)
    gated: frozenset[tuple[int, int]] = frozenset()
    once: frozenset[tuple[int, int]] = frozenset()
    unchecked: frozenset[tuple[int, int]] = frozenset()
    after: dict[tuple[int, int], int] = field(default_factory=dict)

    def tool_of(self, turn: int, index: int) -> str:
        """The tool call ``index`` of tool turn ``turn`` uses."""
        if (turn, index) in self.gated:
            return APPROVED_TOOL
        if (turn, index) in self.once:
            return ONCE_TOOL
        return UNCHECKED_TOOL if (turn, index) in self.unchecked else "work"

    def calls_in(self, turn: int) -> int:
        """How many tool calls tool turn ``turn`` makes."""
        return self.calls[turn % len(self.calls)]

    def sleep_of(self, turn: int, index: int) -> int:
        """The sleep of one call: fixed by (run, turn, index), so a regenerated turn asks the same."""
        if (turn, index) in self.slow:
            return self.slow[(turn, index)]
        seed = int(hashlib.sha256(f"{self.run_id}/{turn}/{index}".encode()).hexdigest()[:8], 16)
        return random.Random(seed).randint(*self.sleep_ms)

    def latency_of(self, turn: int) -> int:
        """The model latency of turn ``turn`` in ms."""
        return self.slow_model.get(turn, self.model_ms)


def parse_shape(text: str) -> RunShape:  # noqa: C901 - one branch per option keeps the grammar readable
    """The shape of a run from ``run <id> key=value ...``."""
    words = text.split()
    if len(words) < 2 or words[0] != "run":
        raise ValueError(f"crash-test input must start with 'run <id>', got {text[:80]!r}")
    values: dict[str, Any] = {"run_id": words[1]}
    slow: dict[tuple[int, int], int] = {}
    slow_model: dict[int, int] = {}
    marked: dict[str, set[tuple[int, int]]] = {"gate": set(), "once": set(), "unchecked": set()}
    after: dict[tuple[int, int], int] = {}
    for word in words[2:]:
        key, _, value = word.partition("=")
        if key == "turns":
            values["turns"] = int(value)
        elif key == "calls":
            values["calls"] = tuple(int(n) for n in value.split(","))
        elif key == "sleep":
            low, _, high = value.partition("-")
            values["sleep_ms"] = (int(low), int(high or low))
        elif key == "model":
            values["model_ms"] = int(value)
        elif key in ("slow", "after"):
            for item in value.split(","):
                where, _, ms = item.partition(":")
                turn, _, index = where.partition(".")
                (slow if key == "slow" else after)[(int(turn), int(index))] = int(ms)
        elif key in marked:
            for item in value.split(","):
                turn, _, index = item.partition(".")
                marked[key].add((int(turn), int(index)))
        elif key == "slowmodel":
            for item in value.split(","):
                turn, _, ms = item.partition(":")
                slow_model[int(turn)] = int(ms)
        else:
            raise ValueError(f"unknown crash-test option {key!r}")
    return RunShape(
        slow=slow,
        slow_model=slow_model,
        gated=frozenset(marked["gate"]),
        once=frozenset(marked["once"]),
        unchecked=frozenset(marked["unchecked"]),
        after=after,
        **values,
    )


def run_input(run_id: str, **options: object) -> str:
    """The first user message of a crash-test run."""
    return " ".join(["run", run_id, *(f"{key}={value}" for key, value in options.items())])


def _shape_of(messages: list[Message]) -> RunShape:
    first = next(m for m in messages if m.role == "user")
    return parse_shape(str(first.content))


def _script(messages: list[Message]) -> dict[str, Any]:
    """The scripted answer: tool turns until the last one, then final text; each carries a fresh nonce."""
    shape = _shape_of(messages)
    turn = sum(1 for m in messages if m.role == "assistant")
    nonce = uuid.uuid4().hex[:12]
    if turn >= shape.turns - 1:
        return {"text": f"done {shape.run_id} {response_tag(nonce)}"}
    calls = [
        {"id": f"c{turn}-{k}-{nonce}", "name": shape.tool_of(turn, k), "args": _args_of(shape, turn, k)}
        for k in range(shape.calls_in(turn))
    ]
    return {"text": f"turn {turn} {response_tag(nonce)}", "tool_calls": calls}


def _args_of(shape: RunShape, turn: int, index: int) -> dict[str, Any]:
    args: dict[str, Any] = {"ms": shape.sleep_of(turn, index)}
    if shape.tool_of(turn, index) in (ONCE_TOOL, UNCHECKED_TOOL):
        args["after_ms"] = shape.after.get((turn, index), 0)
    return args


class LoggedModel(MockModel):
    """``MockModel`` that logs each call (start and end) and the validity of what it received."""

    def generate(  # type: ignore[override]  # takes no listener: this model never streams
        self, messages: list[Message], tools: list[ToolSpec]
    ) -> ModelResponse:
        shape = _shape_of(messages)
        turn = sum(1 for m in messages if m.role == "assistant")
        call = uuid.uuid4().hex[:12]
        problems = transcript_problems(messages)
        log_event(
            {
                "kind": "model",
                "phase": "start",
                "call": call,
                "run_id": shape.run_id,
                "turn_index": turn,
                "transcript_valid": not problems,
                "problems": problems[:3],
                "digest": transcript_digest([m.dump() for m in messages]),
            }
        )
        time.sleep(shape.latency_of(turn) / 1000)
        response = super().generate(messages, tools)
        log_event(
            {
                "kind": "model",
                "phase": "end",
                "call": call,
                "run_id": shape.run_id,
                "turn_index": turn,
                "transcript_valid": not problems,
                "response_id": _response_id(response),
                "tool_call_ids": [c.id for c in response.tool_calls],
            }
        )
        return response


def _response_id(response: ModelResponse) -> str | None:
    text = response.text or ""
    start = text.rfind("[resp:")
    return text[start + 6 : text.find("]", start)] if start >= 0 else None


def _sleep_logged(ms: int, ctx: ToolContext, approved: bool, once: bool = False, after_ms: int = 0) -> str:
    execution = uuid.uuid4().hex[:12]
    record = {
        "kind": "tool",
        "run_id": ctx.session_id,
        "tool_call_id": ctx.tool_call_id,
        "base_seq": ctx.checkpoint_seq,
        "exec": execution,
        "approved": approved,
        "once": once,
    }
    log_event({**record, "phase": "start", "ms": ms, "attempt": ctx.attempt})
    time.sleep(ms / 1000)
    if once:
        applied = _apply_once_effect(ctx.tool_call_id, ctx.session_id, execution)
        log_event({**record, "phase": "effect", "applied": applied})
        time.sleep(after_ms / 1000)
    elif os.environ.get(EFFECTS_ENV):
        _apply_effect(ctx.tool_call_id, ctx.session_id)
        log_event({**record, "phase": "effect"})
    log_event({**record, "phase": "end"})
    return json.dumps({"exec": execution, "pid": os.getpid(), "slept_ms": ms})


_effects: dict[int, Any] = {}  # pid -> connection, so a forked pool process opens its own


def _connection() -> Any:
    import psycopg

    conn = _effects.get(os.getpid())
    if conn is None:
        _effects.clear()
        conn = _effects[os.getpid()] = psycopg.connect(os.environ["LOUSHO_DATABASE_URL"], autocommit=True)
    return conn


def _apply_effect(call_id: str, run_id: str) -> None:
    """The call's effect, applied at most once per call id (the idempotent sink of RELIABILITY check 6)."""
    _connection().execute(
        f"INSERT INTO {EFFECTS_TABLE} (idem_key, run_id) VALUES (%s, %s) ON CONFLICT DO NOTHING", (call_id, run_id)
    )


def _apply_once_effect(call_id: str, run_id: str, execution: str) -> bool:
    """A once call's effect: its row in the once sink (and the I12 sink, when on), in one transaction.

    Returns whether this execution applied it (False: an earlier one had, which I18 forbids).
    """
    conn = _connection()
    with conn.transaction():
        if os.environ.get(EFFECTS_ENV):
            _apply_effect(call_id, run_id)
        applied = conn.execute(
            f"INSERT INTO {ONCE_TABLE} (idem_key, exec, run_id) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING RETURNING 1",
            (call_id, execution, run_id),
        ).fetchone()
    return applied is not None


def _once_happened(args: dict[str, Any], ctx: ToolContext) -> str | None:
    """``once_work``'s reconcile: the result naming the execution that applied the effect, or None."""
    row = _connection().execute(f"SELECT exec FROM {ONCE_TABLE} WHERE idem_key = %s", (ctx.tool_call_id,)).fetchone()
    log_event(
        {
            "kind": "reconcile",
            "run_id": ctx.session_id,
            "tool_call_id": ctx.tool_call_id,
            "attempt": ctx.attempt,
            "found": row[0] if row else None,
        }
    )
    return None if row is None else json.dumps({"exec": row[0], "reconciled": True})


@tool
def work(ms: int, ctx: ToolContext) -> str:
    """Sleep ``ms`` milliseconds, logging the start and end of this execution."""
    return _sleep_logged(ms, ctx, approved=False)


def _approved_work(ms: int, ctx: ToolContext) -> str:
    """Like ``work``, once a human approved the call."""
    return _sleep_logged(ms, ctx, approved=True)


approved_work = Tool(_approved_work, name=APPROVED_TOOL, needs_approval=True)


def _once_work(ms: int, after_ms: int, ctx: ToolContext) -> str:
    """Sleep, apply an effect that must not happen twice, sleep ``after_ms`` more."""
    return _sleep_logged(ms, ctx, approved=False, once=True, after_ms=after_ms)


def _once_unchecked(ms: int, after_ms: int, ctx: ToolContext) -> str:
    """Like ``once_work``, with no reconcile function: a person reconciles an interrupted call."""
    return _sleep_logged(ms, ctx, approved=False, once=True, after_ms=after_ms)


once_work = Tool(_once_work, name=ONCE_TOOL, once=True, reconcile=_once_happened)
once_unchecked = Tool(_once_unchecked, name=UNCHECKED_TOOL, once=True)
TOOLS = [work, approved_work, once_work, once_unchecked]


#: Parallel tools (a batch runs its calls on up to 4 threads).
chaos = Agent(
    name="chaos",
    model=LoggedModel(_script, model_id="crash-mock"),
    instructions="Crash-test agent.",
    tools=TOOLS,
    max_steps=50,
    tool_concurrency=4,
)
#: Sequential tools, so a crash point inside a batch has exactly one call in flight.
serial = Agent(
    name="serial",
    model=LoggedModel(_script, model_id="crash-mock"),
    instructions="Crash-test agent.",
    tools=TOOLS,
    max_steps=50,
    tool_concurrency=1,
)


def _install_duplicator(spec: str) -> None:
    """Publish every ``lousho.advance`` this process sends a second time, after a random jitter."""
    from celery.signals import after_task_publish

    from worker.celery import app, settings

    low, _, high = spec.partition("-")
    jitter = (int(low) / 1000, int(high or low) / 1000)

    def send_again(kwargs: dict[str, Any]) -> None:
        app.send_task("lousho.advance", kwargs=kwargs, queue=settings.queue, headers={"lousho_duplicate": 1})
        log_event({"kind": "duplicate", "run_id": kwargs["session_id"], "seq": kwargs.get("seq")})

    def on_publish(sender: object = None, headers: dict[str, Any] | None = None, body: Any = None, **_: object) -> None:
        if sender != "lousho.advance" or (headers or {}).get("lousho_duplicate"):
            return
        args, kwargs = body[0], body[1]
        message = dict(kwargs) if kwargs else {"session_id": args[0], "seq": args[1] if len(args) > 1 else None}
        timer = threading.Timer(random.uniform(*jitter), send_again, (message,))
        timer.daemon = True
        timer.start()

    after_task_publish.connect(on_publish, weak=False)


if os.environ.get(DUPLICATE_ENV):
    _install_duplicator(os.environ[DUPLICATE_ENV])
