"""The world of the interleaving test: the real step machine on the real Postgres and Redis, one action at a time.

Steps run in this process (``worker.steps.run_step``, as the ``advance`` task runs them), their messages go to a
list the test delivers from, in any order and more than once; producers act through ``producer.Client``; the sweep
and retention through their task functions (``worker.tasks.recover`` and ``prune``). Time passes by moving every
stored time back (``TIME_STEP``), so what is due does not depend on how fast the machine is. Each action knows what
it must do (the reference model); ``check`` reads the whole state back after each one and notes what breaks an
invariant. Actions can also run inside a step, just before a tool's effect (``arm``): a race inside a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from hypothesis import currently_in_test_context, event
from sqlalchemy import Engine, text

from producer.client import Client
from store import errors, keys, payloads, records, telemetry
from store.checkpoints import PostgresCheckpointStore
from store.leases import LeaseManager
from store.model_slots import RedisModelSlots
from store.records import Approval, Checkpoint, Message
from store.runs import has_work, is_parked
from store.settings import Settings
from store.signals import RedisSignals
from tests.fakes.crash import Crashes, SimulatedCrash
from tests.fakes.manual_heartbeat import ManualHeartbeat
from tests.fakes.queue import StepMessage, StepQueue
from tests.support.interleave_agents import DESK, DESK_LIMIT, Observer, build_agents, input_tag, input_text
from worker import Agent, machine, tasks
from worker.steps import Outcome, StepDeps, run_step

#: The ids sends use; forks add runs of their own next to them.
TOP = ("r0", "r1")
#: One passing of time: past every lease, past a ``charge`` approval's expiry, past the retention age.
TIME_STEP = timedelta(minutes=40)
#: ``LOUSHO_RETENTION_DAYS`` of the test (28.8 minutes, under ``TIME_STEP``).
RETENTION_DAYS = 0.02
MAX_ATTEMPTS = 5
#: Model slots outlive any step, as leases do here: only time passing (or a release) frees one.
SLOT_TTL_MS = 60_000
#: The other process that holds the desk's model slot in the ``model_slot`` rule.
ELSEWHERE = "another-process"
#: Crashes per run, below ``MAX_ATTEMPTS``: no run is parked by a crash loop.
FAULT_BUDGET = 2
CRASH_POINTS = (
    "after_lease_before_epoch",
    "during_model_call",
    "after_model_response_before_save",
    "after_model_save_before_enqueue",
    "tool_before_effect",
    "after_tool_effect_before_result_save",
    "between_results",
    "after_batch_save_before_enqueue",
    "after_enqueue_before_ack",
    "after_started_marker_before_approved_call",
    "after_approved_effect_before_result_save",
    "between_chained_steps",
)
#: Steps of one run a worker's task may take in a row (``LOUSHO_CONTINUE_STEPS``): 1 is strict mode.
CHAIN_STEPS = (1, 3, 50)
#: What can happen in the middle of a step (just before a tool's effect), to the run the step belongs to.
ACTIONS = ("delete", "abort", "steer", "send", "fork", "prune", "sweep", "decide", "resume", "expire", "tree_steps")
#: A run parked by design: a child whose tool stopped it (``CHILD_PLANS["broken"]``).
DESIGNED_PARKS = (errors.PropagatingToolError.code,)
_ROWS = text("""
SELECT session_id, parent_id, agent, status, seq, transcript_id, waiting, aborted, last_error, inbox_head, inbox_cursor,
  abort_requested IS NOT NULL AS abort_requested, end_due, document -> 'approval_ids' AS approval_ids, updated_at,
  EXISTS (SELECT 1 FROM lead_news n WHERE n.lead_id = runs.session_id AND n.n > n.seen) AS news
FROM runs
""")
# Time passing changes no run: the triggers that tell leads of their children's changes stay quiet.
_QUIET = text("SET LOCAL session_replication_role = replica")
_PASS_TIME = (
    text("""UPDATE runs SET created_at = created_at - :d, updated_at = updated_at - :d,
              next_attempt_at = next_attempt_at - :d, retry_since = retry_since - :d, swept_at = swept_at - :d,
              abort_requested = abort_requested - :d"""),
    text(
        "UPDATE approvals SET created_at = created_at - :d, decided_at = decided_at - :d, expires_at = expires_at - :d"
    ),
)
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
# Every table of the schema but the migrations' own, whatever a later migration adds (%I quotes each name).
_EMPTY = text("""
DO $$ DECLARE name text; BEGIN
  FOR name IN SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()
      AND table_type = 'BASE TABLE' AND table_name <> 'alembic_version' ORDER BY table_name LOOP
    EXECUTE format('DELETE FROM %I', name);
  END LOOP;
END $$""")
_QUEUED = text(
    "SELECT left(messages -> 0 ->> 'content', 40) FROM inbox WHERE session_id = :sid AND n > :cursor ORDER BY n"
)
_STEPS = text("SELECT DISTINCT step FROM checkpoint_history WHERE session_id = :sid")
_PASS_EXPIRIES = text("UPDATE approvals SET expires_at = expires_at - :d WHERE status = 'pending'")
_PENDING = text(
    "SELECT approval_id, session_id, kind, expires_at <= now() AS expired FROM approvals"
    " WHERE status = 'pending' ORDER BY approval_id"
)


@dataclass(frozen=True)
class Row:
    """What the test reads of a run's row (the attributes ``store.runs.has_work`` reads, and a few more)."""

    session_id: str
    parent_id: str | None
    agent: str
    status: str
    seq: int
    transcript_id: int
    waiting: bool
    aborted: bool
    last_error: dict[str, Any] | None
    inbox_head: int
    inbox_cursor: int
    abort_requested: bool
    end_due: bool
    approval_ids: tuple[str, ...]
    updated_at: datetime
    #: A child changed since the run's last step began (``lead_news``): the sweep of waiting leads reads it.
    news: bool

    @property
    def lead(self) -> str | None:
        return self.parent_id or records.lead_of(self.session_id)

    @property
    def moving(self) -> bool:
        """A step has work on it and it is not parked: the sweep sends it."""
        return has_work(self) and not is_parked(self.last_error)


@dataclass
class Env:
    """What every example shares: the services, the lease manager the crashes patch, and the world running now."""

    settings: Settings
    engine: Engine
    redis: redis.Redis
    leases: LeaseManager
    crashes: Crashes
    observer: Observer = field(init=False)
    agents: dict[str, Agent] = field(init=False)
    world: World | None = None

    def __post_init__(self) -> None:
        self.observer = Observer(self.engine)
        self.agents = build_agents(self.observer)

    def enqueue(
        self,
        session_id: str,
        seq: int | None,
        countdown: float = 0.0,
        agent: str | None = None,
        /,
        *,
        name: str | None = None,
    ) -> None:
        """``worker.tasks.enqueue`` while the test runs: the sweep's messages join the current world's."""
        assert self.world is not None
        self.world.queue(session_id, seq, countdown, agent, name=name)


def _count(what: str) -> None:
    """Count ``what`` in Hypothesis's statistics (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        event(what)


def _empty(env: Env) -> None:
    """Every table and the Redis db emptied for a new example (a few rows each: deleting is faster than TRUNCATE)."""
    with env.engine.begin() as conn:
        conn.execute(_EMPTY)
    env.redis.flushdb()


def _collapse(tags: list[str]) -> list[str]:
    """Tags with repeats in a row removed (a large send is several messages carrying one tag)."""
    return [tag for k, tag in enumerate(tags) if k == 0 or tags[k - 1] != tag]


def large_input(text_start: str) -> list[dict[str, str]]:
    """Four user messages together exactly as large as one send may be (``MAX_INPUT_TOTAL``), each tagged."""
    overhead = len(payloads.dumps(Message(role="user", content=text_start).dump()).encode("utf-8"))
    each = (payloads.MAX_INPUT_TOTAL - 4 * overhead) // 4
    sizes = [each, each, each, payloads.MAX_INPUT_TOTAL - 4 * overhead - 3 * each]
    return [{"role": "user", "content": text_start + "x" * size} for size in sizes]


@dataclass
class World:
    """One example: the runs, their messages, and everything the test saw happen."""

    env: Env
    store: PostgresCheckpointStore = field(init=False)
    client: Client = field(init=False)
    queue: StepQueue = field(default_factory=StepQueue)
    observer: Observer = field(init=False)
    #: Accepted input of each run of its own, by tag, in the order it must be applied.
    inputs: dict[str, list[str]] = field(default_factory=dict)
    faults: Counter[str] = field(default_factory=Counter)
    redeliver: dict[str, bool] = field(default_factory=dict)
    #: The action armed to run inside the next step, just before a tool's effect, and whether the step hears it.
    armed: tuple[str, int, bool] | None = None
    #: A decision (approve or answer 0, reject or decline 1, 2) armed for the next step that reads an approval of
    #: its run still pending (``decide_inside_a_step``).
    decide_at_read: int | None = None
    delivered: list[StepMessage] = field(default_factory=list)
    _numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _cache: dict[str, tuple[Row, Checkpoint, list[str]]] = field(default_factory=dict)
    _in_action: bool = False
    #: The run whose step an action runs inside (its own messages meet its lease held).
    _stepping: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        env = self.env
        _empty(env)
        self.store = PostgresCheckpointStore(env.engine, env.settings.history_limit)
        self.client = Client(env.settings, engine=env.engine)
        self.client.nudge = self._nudge  # type: ignore[method-assign]  # producers' messages go to this queue
        self.observer = env.observer
        self.observer.reset(self._during_tool)
        self._read_decisions = self.store.decisions
        self.store.decisions = self._decisions  # type: ignore[method-assign]  # a person decides as a step reads
        agents = env.agents
        self.heartbeat = ManualHeartbeat(env.leases)
        self.deps = StepDeps(
            store=self.store,
            leases=env.leases,
            heartbeat=self.heartbeat,
            agents=agents,
            enqueue=self.queue,
            max_attempts=MAX_ATTEMPTS,
            signals=RedisSignals(env.redis),
            slots=RedisModelSlots(env.redis, SLOT_TTL_MS),
        )
        #: Whether another process holds the desk's model slot now (the ``model_slot`` rule).
        self.slot_taken = False
        self.store.register_agents({name: agent.fingerprint() for name, agent in agents.items()})
        env.crashes.disarm()
        env.crashes.recovered()
        env.world = self

    def close(self) -> None:
        self.env.crashes.disarm()
        self.env.world = None
        self.client.close()

    def _nudge(self, session_id: str, agent: str | None = None, kind: str = telemetry.NEW_INPUT) -> None:
        self.queue(session_id, None, 0.0, agent, name=kind)

    def note(self, kind: str, description: str) -> None:
        self.observer.note(kind, description)

    # -- reading the state back ------------------------------------------------------------------------

    def rows(self) -> dict[str, Row]:
        with self.env.engine.connect() as conn:
            found = conn.execute(_ROWS).all()
        return {row.session_id: Row(**{**row._mapping, "approval_ids": tuple(row.approval_ids or ())}) for row in found}

    def tops(self) -> list[str]:
        """The runs of their own that sends, forks and deletes pick from: ``TOP`` and the forks that exist."""
        forks = sorted(sid for sid, row in self.rows().items() if row.lead is None and sid not in TOP)
        return [*TOP, *forks]

    def state(self, row: Row) -> tuple[Checkpoint, list[str]]:
        """The run's checkpoint and the tags of its queued input (read again only when its row changed)."""
        key = dataclasses.replace(row, updated_at=_EPOCH)  # time passing changes no state
        cached = self._cache.get(row.session_id)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        checkpoint = self.store.load(row.session_id)
        assert checkpoint is not None, f"{row.session_id} went away while it was read"
        with self.env.engine.connect() as conn:  # the tag of each queued send, without reading large input whole
            queued = [
                str(start).split(":", 1)[0]
                for start in conn.execute(_QUEUED, {"sid": row.session_id, "cursor": checkpoint.inbox_cursor}).scalars()
            ]
        self._cache[row.session_id] = (key, checkpoint, queued)
        return checkpoint, queued

    def _forget(self, *session_ids: str) -> None:
        for sid in session_ids:
            self._cache.pop(sid, None)
            self.inputs.pop(sid, None)

    # -- the step ---------------------------------------------------------------------------------------

    def deliver(self, message: StepMessage, keep_copy: bool = False) -> Outcome | None:
        """Run the step of ``message`` (``keep_copy``: the broker hands it out again later)."""
        if keep_copy:
            self.queue.messages.append(message)
        self.delivered.append(message)
        current = self.observer.current
        outer = current.session_id  # a step delivered inside another's (``tree_steps``) gives it back after
        current.session_id = message.session_id
        try:
            with telemetry.step(message.session_id, message.seq) as report:
                outcome = run_step(self.deps, message.session_id, message.seq)
            if report.chained:
                _count("a task took steps in a row")
        except SimulatedCrash:
            # The worker died: its lease expires (no one renews it), and the broker may hand the message out again.
            self.env.crashes.recovered()
            self.env.redis.delete(keys.lease_key(message.session_id))
            self.faults[message.session_id] += 1
            _count("step crashed")
            if self.redeliver.get(message.session_id):
                self.queue.messages.append(message)
            return None
        except Exception as exc:  # a step must settle every failure itself: one that escapes is a finding
            self.note("step-raised", f"a step of {message.session_id} raised {type(exc).__name__}: {exc}")
            return None
        finally:
            current.session_id = outer
        _count(f"step {outcome.value}")
        if outcome == Outcome.BUSY and message.session_id not in self._stepping:
            self.note("unexpected-outcome", f"{message.session_id}: busy with no step running")
        return outcome

    def drain(self, limit: int, only: Callable[[StepMessage], bool] | None = None) -> None:
        for _ in range(limit):
            picked = next((k for k, m in enumerate(self.queue.messages) if only is None or only(m)), None)
            if picked is None:
                return
            self.deliver(self.queue.pop(picked))

    def crash(self, session_id: str, point: str, redeliver: bool) -> None:
        """Arm ``point`` for the run, in place of a point armed for it before that has not fired.

        The budget counts crashes that fired (``deliver``), so arms that never fire do not use it up.
        """
        if self.faults[session_id] < FAULT_BUDGET:
            self.env.crashes.disarm(session_id)
            self.env.crashes.arm(point, session_id)
            self.redeliver[session_id] = redeliver

    def armed_for(self, session_id: str) -> bool:
        """Whether a crash point is still armed for the run (it has not fired yet)."""
        return any(armed == session_id for _, armed in self.env.crashes.armed)

    def arm(self, action: str, choice: int, heard: bool) -> None:
        """Do ``action`` at the next tool call, whichever step makes it (``heard``: the step hears it at once)."""
        self.armed = (action, choice, heard)

    def _during_tool(self, session_id: str) -> None:
        if self.armed is None or self._in_action:
            return
        action, choice, heard = self.armed
        if action == "tree_steps" and not self._tree_queue(records.runs_to(session_id)[0]):
            return  # kept for a step whose tree has messages queued
        self.armed = None
        with self._inside(session_id):
            try:
                self.act(action, records.runs_to(session_id)[0], choice)
            except Exception as exc:  # noted, never raised: the step would take it for the tool's own failure
                self.note("unexpected-error", f"{action} during a step of {session_id}: {type(exc).__name__}: {exc}")
        if heard:
            self.heartbeat.beat()

    def _decisions(self, approval_ids: Sequence[str]) -> dict[str, Approval]:
        """The store's ``decisions``; when a decision is armed and a step reads one of its run's approvals still
        pending, a person decides it right after, and the decision's step is delivered while that step holds the
        lease (a worker drops it as busy)."""
        found = self._read_decisions(approval_ids)
        session_id = self.observer.current.session_id
        if self.decide_at_read is None or self._in_action or not session_id:
            return found
        if not any(a.status == "pending" and a.session_id == session_id for a in found.values()):
            return found
        decision, self.decide_at_read = self.decide_at_read, None
        with self._inside(session_id):
            self.decide(0, decision, session_id=session_id)
            for message in [m for m in self.queue.messages if m.session_id == session_id]:
                self.queue.messages.remove(message)
                _count("a decision's step ran inside a step of its run")
                self.deliver(message)
        return found

    @contextlib.contextmanager
    def _inside(self, session_id: str) -> Iterator[None]:
        """An action inside a step of ``session_id``: no other armed action fires in it, and the run's own
        messages delivered meanwhile meet its lease (busy is expected of them)."""
        self._in_action = True
        self._stepping.add(session_id)
        try:
            yield
        finally:
            self._in_action = False
            self._stepping.clear()

    def act(self, action: str, session_id: str, choice: int) -> None:
        """Do ``action`` to ``session_id`` (``choice`` picks a plan, an approval or a step where one is needed)."""
        plans = ("chat", "look", "gated", "task")
        if action == "delete":
            self.delete(session_id)
        elif action == "abort":
            self.abort(session_id)
        elif action in ("steer", "send"):
            self.send(session_id, plans[choice % len(plans)], steer=action == "steer")
        elif action == "fork":
            self.fork(session_id, choice % 2, None, run_it=True)
        elif action == "prune":
            self.prune()
        elif action == "sweep":
            self.sweep()
        elif action == "decide":
            self.decide(choice, choice % 3)
        elif action == "resume":
            self.resume(session_id)
        elif action == "tree_steps":
            self.tree_steps(session_id)
        else:
            self.expire()

    def tree_steps(self, root: str) -> None:
        """The queued steps of ``root`` and the runs under it are delivered while a step of the tree holds its
        lease: children settle inside their lead's step, and the run stepping meets its own messages busy (a
        worker drops those)."""
        for message in self._tree_queue(root)[:20]:
            if message in self.queue.messages:
                self.queue.messages.remove(message)
                _count("a step of a tree ran inside another step of it")
                self.deliver(message)

    def _tree_queue(self, root: str) -> list[StepMessage]:
        return [m for m in self.queue.messages if records.runs_to(m.session_id)[0] == root]

    # -- producers (each checks what its answer must be) ----------------------------------------------

    def send(self, session_id: str, plan: str, *, steer: bool = False, large: bool = False) -> None:
        before = self.rows().get(session_id)
        tag_text = input_text(next(self._numbers), plan)
        body: Any = large_input(tag_text) if large else tag_text
        handle = self.client.agent(DESK)
        try:
            handle.steer(session_id, body) if steer else handle.send(body, session_id)
        except errors.SessionAwaitingApprovalError:
            if before is None or before.status != "awaiting-approval":
                self.note(
                    "wrong-answer",
                    f"send to {session_id} refused as awaiting approval; it is {before.status if before else 'absent'}",
                )
            return
        except errors.InputTooLargeError:
            after = self.rows().get(session_id)
            if not large:
                self.note("wrong-answer", f"a small send to {session_id} refused as too large")
            if (after.inbox_head if after else None) != (before.inbox_head if before else None):
                self.note("wrong-answer", f"a refused send to {session_id} was queued")
            return
        if before is not None and before.status == "awaiting-approval":
            self.note("wrong-answer", f"send to {session_id} accepted while it awaits approval")
        self.inputs.setdefault(session_id, []).append(tag_text.split(":", 1)[0])

    def abort(self, session_id: str) -> None:
        before = self.rows().get(session_id)
        try:
            answered = self.client.abort(session_id)
        except errors.CheckpointNotFoundError:
            if before is not None:
                self.note("wrong-answer", f"abort of {session_id}: not found, though it exists")
            return
        expected = before is not None and before.status != "finished" and not before.aborted
        if answered != expected:
            self.note(
                "wrong-answer",
                f"abort of {session_id} answered {answered} (status {before and before.status},"
                f" aborted {before and before.aborted})",
            )

    def resume(self, session_id: str) -> None:
        before = self.rows().get(session_id)
        try:
            run = self.client.resume(session_id)
        except errors.SessionAwaitingApprovalError:
            if before is None or before.status != "awaiting-approval":
                self.note("wrong-answer", f"resume of {session_id} refused as awaiting approval")
            return
        except errors.SessionBusyError:
            if not self._in_action:
                self.note("wrong-answer", f"resume of {session_id} refused as busy, with no step running")
            return
        if before is None:
            if run is not None:
                self.note("wrong-answer", f"resume of the unknown run {session_id} returned a run")
        elif run is None and before.status != "finished" and (before.aborted or is_parked(before.last_error)):
            # I14: resume() can act on every run that is not finished.
            self.note("wrong-answer", f"resume of the stopped run {session_id} did nothing")

    def decide(self, pick: int, decision: int, *, session_id: str | None = None) -> None:
        """Decide the ``pick``-th pending approval (of ``session_id`` when given): approve or answer (0), reject or
        decline (1, 2)."""
        with self.env.engine.connect() as conn:
            pending = [a for a in conn.execute(_PENDING).all() if session_id in (None, a.session_id)]
        if not pending:
            return
        approval = pending[pick % len(pending)]
        before = self.rows().get(approval.session_id)
        yes = decision == 0
        question = approval.kind == "question"
        try:
            self.client.approvals.resolve(
                approval.approval_id,
                approved=None if question and yes else yes,
                answer="the Baltic" if question and yes else None,
            )
        except errors.ApprovalOrphanedError:
            if (
                before is not None
                and before.status == "awaiting-approval"
                and approval.approval_id in before.approval_ids
            ):
                self.note("wrong-answer", f"approval {approval.approval_id} orphaned though its run waits on it")
        except errors.ApprovalExpiredError:
            if not approval.expired:
                self.note("wrong-answer", f"approval {approval.approval_id} refused as expired before its time")

    def fork(self, session_id: str, back: int, plan: str | None, *, run_it: bool) -> None:
        handle = self.client.agent(DESK)
        with self.env.engine.connect() as conn:  # the steps kept, without reading every saved transcript
            steps = sorted(conn.execute(_STEPS, {"sid": session_id}).scalars().all())
        if not steps:
            return
        patch = None
        tag = None
        if plan is not None:
            tag_text = input_text(next(self._numbers), plan)
            tag = tag_text.split(":", 1)[0]
            patch = {"append_input": tag_text}
        made = handle.fork(session_id, steps[max(len(steps) - 1 - back, 0)], patch)
        applied = _collapse([t for t in (input_tag(m) for m in made.checkpoint.messages) if t is not None])
        self.inputs[made.session_id] = applied + ([tag] if tag else [])
        if run_it:
            self.resume(made.session_id)

    def delete(self, session_id: str) -> None:
        rows = self.rows()
        deleted = self.client.agent(DESK).delete(session_id)
        if deleted != (session_id in rows):
            self.note("wrong-answer", f"delete of {session_id} answered {deleted}")
        self._forget(session_id, *(sid for sid in rows if records.runs_to(sid)[0] == session_id))

    # -- time, the sweep, retention ---------------------------------------------------------------------

    def hold_slot(self, hold: bool) -> None:
        """Another process takes the desk's one model slot (waiting for it, when in use), or gives it back.

        Given back, the slot goes to the next run in line, whose step is sent, as the step that frees a slot does.
        """
        slots = self.deps.slots
        assert slots is not None
        if hold and not self.slot_taken:
            answer = slots.acquire(DESK_LIMIT, ELSEWHERE, DESK)
            self.slot_taken = answer.granted
            woken = answer.woken
        elif not hold and self.slot_taken:
            woken = slots.release(DESK_LIMIT, ELSEWHERE)
            self.slot_taken = False
        else:
            return
        for session_id, agent in woken:
            self.queue(session_id, None, 0.0, agent, name=telemetry.SLOT_FREED)

    def chain(self, steps: int) -> None:
        """Workers from now on take up to ``steps`` steps of a run in one task (a slice long enough to never end
        a chain here: the step count and the chain's own stops decide)."""
        self.deps.continue_steps, self.deps.continue_ms = steps, 60_000.0
        _count(f"chain {steps}")

    def pass_time(self) -> None:
        """``TIME_STEP`` passes: every stored time moves back by it, and every lease expires."""
        with self.env.engine.begin() as conn:
            conn.execute(_QUIET)
            for statement in _PASS_TIME:
                conn.execute(statement, {"d": TIME_STEP})
        for key in self.env.redis.scan_iter(keys.LEASE_PREFIX + "*"):
            self.env.redis.delete(key)
        # Model slots expire like leases (no holder renews one that long), the other process's too.
        for part in ("held", "woken"):
            self.env.redis.delete(keys.limit_key(DESK_LIMIT.key, part))
        self.slot_taken = False

    def sweep(self) -> None:
        self.pass_time()
        tasks.recover()

    def expire(self) -> None:
        """Every pending approval's expiry passes; the store rejects them (what the sweep does first)."""
        with self.env.engine.begin() as conn:
            conn.execute(_PASS_EXPIRIES, {"d": TIME_STEP})
        self.store.expire_approvals()
        with self.env.engine.connect() as conn:
            left = [row.approval_id for row in conn.execute(_PENDING) if row.expired]
        if left:
            self.note("wrong-answer", f"approvals past their expiry still pending: {left}")

    def prune(self) -> None:
        """Time passes and the retention sweep runs: what must go goes, and nothing that can continue does."""
        self.pass_time()
        before = self.rows()
        tasks.prune()
        after = self.rows()
        must_go, may_go = _retention_due(before)
        for lead in sorted(must_go):
            if lead in after:
                self.note(
                    "retention",
                    f"finished lead {lead} kept, though every run under it is settled: {_tree_states(before, lead)}",
                )
        for sid in sorted(set(before) - set(after)):
            if sid not in may_go:
                self.note("retention", f"{sid} pruned though it can still continue ({before[sid].status})")
        self._forget(*(set(before) - set(after)))

    # -- invariants -------------------------------------------------------------------------------------

    def check(self) -> None:
        """Read every run back and note what breaks an invariant."""
        rows = self.rows()
        with self.env.engine.connect() as conn:
            pending = {row.approval_id for row in conn.execute(_PENDING)}
        for sid, row in rows.items():
            checkpoint, queued = self.state(row)
            self._check_transcript(sid, checkpoint)
            self._check_family(sid, row, checkpoint, rows)
            self._check_waiter(sid, row, checkpoint, rows, pending)
            if row.last_error is not None and not (
                row.lead is not None
                and row.last_error.get("code") in DESIGNED_PARKS
                and not row.last_error.get("retryable")
            ):
                self.note("I13", f"{sid} stopped on {row.last_error.get('code')}: {row.last_error.get('message')}")
            if sid in self.inputs:
                seen = _collapse([t for t in (input_tag(m) for m in checkpoint.messages) if t is not None])
                if seen + queued != self.inputs[sid]:
                    self.note("inputs", f"{sid}: accepted {self.inputs[sid]}, applied {seen}, queued {queued}")

    def _check_transcript(self, sid: str, checkpoint: Checkpoint) -> None:
        completed = checkpoint
        for call in checkpoint.pending_tool_calls:
            completed = machine.record_tool_result(completed, Message(role="tool", tool_call_id=call.id))
        problems = machine.transcript_problems(completed.messages)
        if problems:
            self.note("I1", f"{sid}: {problems[0]}")

    def _check_family(self, sid: str, row: Row, checkpoint: Checkpoint, rows: dict[str, Row]) -> None:
        if row.lead is not None and row.lead not in rows:
            self.note("orphan-runs", f"{sid} exists, its lead {row.lead} does not")
        for child in [*(checkpoint.delegated or {}).values(), *(checkpoint.background or [])]:
            if records.lead_of(child) != sid:
                self.note("adopted-children", f"{sid} waits on or follows {child}, a child of another run")

    def _check_waiter(
        self, sid: str, row: Row, checkpoint: Checkpoint, rows: dict[str, Row], pending: set[str]
    ) -> None:
        """I19: a run that is not moving has a waiter (a person's decision, or children of its own)."""
        if row.status == "awaiting-approval" and not row.waiting and not pending & set(row.approval_ids):
            self.note("I19", f"{sid} awaits approval with no pending approval ({list(row.approval_ids)})")
        if not row.waiting:
            return
        children = list((checkpoint.delegated or {}).values())
        if not children or any(child not in rows for child in children):
            self.note("I19", f"{sid} waits on children {children}, not all of which exist")
            return
        # The sweep reads only leads with news of a child: one its rule would wake must have some.
        if _sweep_rule(rows, row, checkpoint) and not row.news:
            self.note("I19", f"{sid} is one the sweep wakes, but no news of a child since its step began marks it")
        # Its own children wake it as they settle (a message), or the sweep does when a wake-up was lost.
        if (
            all(_at_rest(rows[child]) for child in children)
            and not any(message.session_id == sid for message in self.queue.messages)
            and not _swept_awake(rows, row)
        ):
            self.note("I19", f"{sid} waits on {children}, all settled, and nothing will wake it")

    # -- the end ----------------------------------------------------------------------------------------

    def settle(self, rounds: int = 8) -> None:
        """Let every run finish: deliver, decide, resume what is stopped, sweep; note the runs that cannot."""
        self.env.crashes.disarm()
        self.hold_slot(False)
        for _ in range(rounds):
            self.drain(400)
            with self.env.engine.connect() as conn:
                pending = conn.execute(_PENDING).all()
            for _ in pending:
                self.decide(0, 0)
            for sid, row in self.rows().items():
                if row.lead is None and (row.status != "finished" or has_work(row)) and not row.waiting:
                    self.resume(sid)
            self.drain(400)
            if self._settled():
                return
            self.sweep()
        stuck = {sid: row for sid, row in self.rows().items() if not _at_rest(row)}
        self.note(
            "I10",
            "runs did not finish: "
            + "; ".join(
                f"{sid} status={row.status} waiting={row.waiting} aborted={row.aborted} error={row.last_error}"
                for sid, row in sorted(stuck.items())
            ),
        )

    def _settled(self) -> bool:
        return all(_at_rest(row) for row in self.rows().values())

    def check_finished(self) -> None:
        """After ``settle``: every call has exactly one result and every accepted input was applied."""
        for sid, row in self.rows().items():
            checkpoint, queued = self.state(row)
            if row.lead is None and (checkpoint.pending_tool_calls or queued):
                self.note(
                    "I10",
                    f"{sid} settled with calls {[c.id for c in checkpoint.pending_tool_calls]} and input {queued} left",
                )


def _at_rest(row: Row) -> bool:
    """Finished (a run of its own), or settled (a child: finished, stopped or parked by design)."""
    if row.lead is None:
        return row.status == "finished" and not has_work(row) and not row.waiting
    return not row.moving and not row.waiting and row.status != "awaiting-approval"


def _swept_awake(rows: dict[str, Row], lead: Row) -> bool:
    """Whether the recovery sweep wakes the waiting ``lead``: no child can move, and one changed since its save."""
    children = [row for row in rows.values() if row.parent_id == lead.session_id]
    return not any(child.moving for child in children) and any(child.updated_at > lead.updated_at for child in children)


def _sweep_rule(rows: dict[str, Row], lead: Row, checkpoint: Checkpoint) -> bool:
    """The whole rule of the sweep of waiting leads, times aside: no child can move, and one changed since the lead's
    save, or none is left, or one it waits on settled (a child refused to resume counts for none of these)."""
    children = [row for row in rows.values() if row.parent_id == lead.session_id]
    if any(child.moving for child in children):
        return False
    waited = set((checkpoint.delegated or {}).values()) if checkpoint.delegated else set(checkpoint.background or ())
    counted = [child for child in children if not records.is_refused(child.last_error)]
    return (
        not children
        or any(child.updated_at > lead.updated_at for child in counted)
        or any(
            child.session_id in waited and (child.status == "finished" or child.aborted or is_parked(child.last_error))
            for child in counted
        )
    )


def _tree(rows: dict[str, Row], lead: str) -> list[Row]:
    below, todo = [], [lead]
    while todo:
        parent = todo.pop()
        children = [row for row in rows.values() if row.lead == parent]
        below.extend(children)
        todo.extend(row.session_id for row in children)
    return below


def _tree_states(rows: dict[str, Row], lead: str) -> str:
    return ", ".join(
        f"{row.session_id}: {row.status}{' aborted' if row.aborted else ''}"
        f"{' parked' if is_parked(row.last_error) else ''}"
        for row in _tree(rows, lead)
    )


def _retention_due(rows: dict[str, Row]) -> tuple[set[str], set[str]]:
    """Runs retention must prune (finished leads whose every child is settled) and those it may (with their trees).

    A child is settled when it is finished, stopped (aborted or by a budget) or parked, with nothing left to do;
    a lead with a child that can still move or waits on its own children stays. A child paused on a person, or
    parked with an abort no step will settle, may go either way.
    """
    must, may = set(), set()
    for sid, row in rows.items():
        if row.lead is not None or row.status != "finished" or has_work(row) or row.waiting:
            continue
        tree = _tree(rows, sid)
        if any(child.moving or child.waiting for child in tree):
            continue
        if all(
            (is_parked(child.last_error) and not child.abort_requested)
            or (not has_work(child) and (child.status == "finished" or child.aborted))
            for child in tree
        ):
            must.add(sid)
        may.add(sid)
        may.update(child.session_id for child in tree)
    return must, may
