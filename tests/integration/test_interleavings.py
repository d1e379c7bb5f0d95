"""Model-based interleavings: producer actions, steps, crashes, races and sweeps in any order, on the real step machine.

A Hypothesis state machine (grown from the in-memory T0 model of ``tests/unit/test_step_model.py``) drives runs of
one desk agent that can answer, call tools, ask a person, hand off with a gated call in the same turn, and start
sub-agents in the foreground or the background (``tests/support/interleave_agents.py``), over the real Postgres stores
and Redis leases, steps run in this process as the ``advance`` task runs them, the sweep and retention through their
task functions (``tests/support/interleave_world.py``). Rules:

- send or steer, small or as large as one send may be; abort; resume; approve, reject, answer or decline; fork; delete
  (each followed by ``then`` steps: workers keep up);
- time passes, then the recovery sweep runs, or retention, or only approvals' expiries come;
- a step (any queued message, one the broker hands out again later, or a late copy of one delivered before), a
  drain of the oldest messages, the children's messages only, a crash at a named crash point (between two steps
  one task takes in a row too);
- workers switch between one step per task and several of a run in a row (continuation, ``LOUSHO_CONTINUE_STEPS``);
- another process takes the desk's one model slot (``ModelLimit(concurrent=1)``) or gives it back: the desk's
  model turns wait without failing, and the run the freed slot goes to is sent its step;
- any producer action inside the next step that runs a tool, just before its effect (a race inside a step), or the
  queued steps of that step's tree (children settle while their lead's step holds its lease);

Each action checks its own answer (the reference model: what it must return, and what it must write or leave alone);
after every rule the whole state is read back and must hold:

- I1, I4: every transcript is valid for a provider: each call has at most one result, results follow their turn.
- I2, I3, I5: no call runs once its result is stored, no saved turn is asked for again, an approved call runs once.
- I13: no run stops on an error, but a child parked by its own tool.
- I17: no child without its lead; no run waits on or follows a child of another run; no child runs once its lead
  is gone.
- I19: a run that awaits a person has a pending approval; a run that waits on children has them, and something
  wakes it once they settled (their message, or the sweep); a lead the sweep's rule would wake has news of a child
  since its step began (``lead_news``: the sweep reads no other lead).
- every accepted input is applied once and in order; a step never calls the model with input it cannot save.
- retention prunes a finished lead whose children are all settled (finished, stopped or parked), and nothing that
  can still continue.

At the end every run must finish (I10: messages delivered, approvals decided, unfinished runs resumed, sweeps run),
every call with exactly one result and every input applied, and retention then prunes every finished lead.

``LOUSHO_INTERLEAVINGS_EXAMPLES`` sets the examples of either profile (default ``interleavings-ci``: a fixed, bounded
set of 150); ``HYPOTHESIS_PROFILE=interleavings-long`` (or ``long``) runs many more and longer ones, new ones each time.
``LOUSHO_INTERLEAVINGS_SKIP`` leaves rules out by name, to study one seam while another is known.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from store import records
from store.checkpoints import PostgresCheckpointStore
from store.leases import LeaseManager
from store.settings import Settings
from tests.fakes.crash import Crashes
from tests.support import services
from tests.support.interleave_agents import PLANS
from tests.support.interleave_world import ACTIONS, CHAIN_STEPS, CRASH_POINTS, RETENTION_DAYS, Env, World
from worker import tasks

settings.register_profile(
    "interleavings-ci",
    max_examples=int(os.environ.get("LOUSHO_INTERLEAVINGS_EXAMPLES", "150")),
    stateful_step_count=30,
    deadline=None,
    database=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile(
    "interleavings-long",
    max_examples=int(os.environ.get("LOUSHO_INTERLEAVINGS_EXAMPLES", "2000")),
    stateful_step_count=60,
    deadline=None,
    database=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


_LONG = os.environ.get("HYPOTHESIS_PROFILE", "") in ("long", "interleavings-long")


def _profile() -> settings:
    return settings.get_profile("interleavings-long" if _LONG else "interleavings-ci")


#: Rules left out by name (``LOUSHO_INTERLEAVINGS_SKIP=fork,during_next_tool``).
_SKIPPED = {name.strip() for name in os.environ.get("LOUSHO_INTERLEAVINGS_SKIP", "").split(",") if name.strip()}
PLAN = st.sampled_from(sorted(PLANS))
PICK = st.integers(0, 15)
#: Steps the workers take after a producer's action.
THEN = st.integers(0, 10)
#: Most sends are small; a large one carries as much as one send may (``MAX_INPUT_TOTAL``).
SIZE = st.sampled_from(["small"] * 3 + ["large"])


def _rule(**arguments: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A rule of the machine (unless left out) that marks the state unchecked until the invariants held after it."""

    def made(action: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(action)
        def run(self: Interleavings, **values: Any) -> None:
            self.sound = False
            action(self, **values)

        # rule(**kwargs) returns an untyped decorator in Hypothesis; both return the function they were given.
        ruled = rule(**arguments)(run)  # type: ignore[no-untyped-call]
        return cast(Callable[..., None], precondition(lambda self: action.__name__ not in _SKIPPED)(ruled))

    return made


class Interleavings(RuleBasedStateMachine):
    """Runs of the desk agent under every interleaving of the rules below."""

    def __init__(self, env: Env) -> None:
        super().__init__()
        self.world = World(env)
        #: False from a rule's start until the invariants after it held: the end's liveness check then runs.
        self.sound = True

    def _top(self, pick: int) -> str:
        tops = self.world.tops()
        return tops[pick % len(tops)]

    def _any(self, pick: int) -> str:
        runs = sorted(self.world.rows()) or ["r0"]
        return runs[pick % len(runs)]

    # -- producers ------------------------------------------------------------------------------------

    # Each producer action is followed by ``then`` steps (the oldest queued messages): workers keep up.

    @_rule(run=PICK, plan=PLAN, steer=st.booleans(), size=SIZE, then=THEN)
    def send(self, run: int, plan: str, steer: bool, size: str, then: int) -> None:
        """A send (``steer``: a steer) of input following ``plan``; ``large``: as large as one send may be."""
        self.world.send(self._top(run), plan, steer=steer, large=size == "large")
        self.world.drain(then)

    @_rule(run=PICK, then=THEN)
    def abort(self, run: int, then: int) -> None:
        self.world.abort(self._any(run))
        self.world.drain(then)

    @_rule(run=PICK, then=THEN)
    def resume(self, run: int, then: int) -> None:
        self.world.resume(self._top(run))
        self.world.drain(then)

    @_rule(pick=PICK, decision=st.integers(0, 2), then=THEN)
    def decide(self, pick: int, decision: int, then: int) -> None:
        """Decide a pending approval: approve or answer (0), reject or decline (1, 2)."""
        self.world.decide(pick, decision)
        self.world.drain(then)

    @_rule(run=PICK, decision=st.integers(0, 2), plan=st.sampled_from(["gated-task", "gated"]))
    def decide_inside_a_step(self, run: int, decision: int, plan: str) -> None:
        """A run of its own is sent ``plan``, and a person decides its approval while a step of the run holds the
        lease, right after that step read it still pending (the step of the paused lead its child woke, say): the
        decision's own step meets the lease (a worker drops it as busy). The next step reading a pending approval
        of its run, of any run, takes the decision if this run's steps do not."""
        root = self._top(run)
        self.world.send(root, plan)
        self.world.decide_at_read = decision
        self.world.drain(12, only=lambda message: records.runs_to(message.session_id)[0] == root)

    @_rule(run=PICK, back=st.integers(0, 3), plan=st.none() | PLAN, run_it=st.booleans(), then=THEN)
    def fork(self, run: int, back: int, plan: str | None, run_it: bool, then: int) -> None:
        """Fork a run from its latest step (``back``: that many steps earlier), with ``plan``'s input if given, and
        resume the fork (``run_it``)."""
        self.world.fork(self._top(run), back, plan, run_it=run_it)
        self.world.drain(then)

    @_rule(run=PICK)
    def delete(self, run: int) -> None:
        self.world.delete(self._top(run))

    # -- time -----------------------------------------------------------------------------------------

    @_rule(what=st.sampled_from(["sweep", "prune", "expire"]))
    def time_passes(self, what: str) -> None:
        """Time passes; the recovery sweep runs, or retention, or (only) approvals' expiries come."""
        {"sweep": self.world.sweep, "prune": self.world.prune, "expire": self.world.expire}[what]()

    # -- workers --------------------------------------------------------------------------------------

    @_rule(pick=PICK, message=st.sampled_from(["taken", "kept", "late"]))
    def step(self, pick: int, message: str) -> None:
        """A worker takes a queued message (``kept``: the broker hands it out again later), or a late copy of one
        delivered before."""
        world = self.world
        source = world.delivered if message == "late" else world.queue.messages
        if source:
            delivery = source[pick % len(source)] if message == "late" else world.queue.pop(pick % len(source))
            world.deliver(delivery, keep_copy=message == "kept")

    @_rule(hold=st.booleans(), then=THEN)
    def model_slot(self, hold: bool, then: int) -> None:
        """Another process takes the desk's one model slot (the desk's model turns wait for it), or gives it back
        (the next run in line is sent its step)."""
        self.world.hold_slot(hold)
        self.world.drain(then)

    @_rule(steps=st.sampled_from(CHAIN_STEPS))
    def continuation(self, steps: int) -> None:
        """Workers switch between one step per task and taking a run's next steps in the same task
        (``LOUSHO_CONTINUE_STEPS``): every later step, crash and race happens inside such chains too."""
        self.world.chain(steps)

    @_rule(limit=st.integers(1, 40))
    def drain(self, limit: int) -> None:
        """Workers take the oldest queued messages, up to ``limit`` of them."""
        self.world.drain(limit)

    @_rule()
    def children_settle(self) -> None:
        """The children's queued messages only: sub-agents run ahead of their leads."""
        self.world.drain(60, only=lambda message: records.is_child_id(message.session_id))

    @_rule(run=PICK, plan=st.sampled_from(["background", "task", "task-gated", "gated-task"]))
    def children_inside_a_step(self, run: int, plan: str) -> None:
        """A run of its own is sent ``plan`` (sub-agents), and the queued steps of its tree run inside the next step
        of the tree that calls a tool: children settle while their lead's step holds its lease, and the lead's own
        wake-ups meet that lease (a worker drops them as busy)."""
        root = self._top(run)
        self.world.send(root, plan)
        self.world.arm("tree_steps", 0, False)
        self.world.drain(12, only=lambda message: records.runs_to(message.session_id)[0] == root)

    @_rule(run=PICK, point=st.sampled_from(CRASH_POINTS), redeliver=st.booleans(), plan=PLAN)
    def crash(self, run: int, point: str, redeliver: bool, plan: str) -> None:
        """A worker dies at ``point`` in a step of a run with a queued message (a run of its own is sent ``plan``
        first when nothing is queued): that run's messages are delivered until the crash fires or none is left,
        so the point is reached whenever the run's path passes it."""
        world = self.world
        if point == "between_chained_steps" and world.deps.continue_steps == 1:
            world.chain(CHAIN_STEPS[-1])  # the point is only on a chain's path
        if not world.queue.messages:
            world.send(self._top(run), plan)
        queued = world.queue.messages
        if not queued:
            return
        target = queued[run % len(queued)].session_id
        world.crash(target, point, redeliver)
        world.drain(12, only=lambda message: message.session_id == target and world.armed_for(target))

    @_rule(action=st.sampled_from(ACTIONS), choice=PICK, heard=st.booleans())
    def during_next_tool(self, action: str, choice: int, heard: bool) -> None:
        """``action`` happens inside the next step that runs a tool, just before its effect (a race inside a step).

        Its target is the run of its own the step belongs to; ``heard``: the step's heartbeat hears it at once.
        """
        self.world.arm(action, choice, heard)

    # -- invariants -----------------------------------------------------------------------------------

    @invariant()
    def holds(self) -> None:
        self.world.check()
        _assert_none(self.world.observer.violations)
        self.sound = True

    def teardown(self) -> None:
        try:
            if self.sound:
                self.world.settle()
                self.world.check()
                self.world.check_finished()
                self.world.prune()
                _assert_none(self.world.observer.violations)
        finally:
            self.world.close()


def _assert_none(found: dict[str, list[str]]) -> None:
    """One line per kind of violation, so Hypothesis tells the kinds apart and shrinks each on its own."""
    assert not found.get("orphan-runs"), f"I17 a child without its lead: {found['orphan-runs']}"
    assert not found.get("adopted-children"), f"I17 a run adopted a child: {found['adopted-children']}"
    assert not found.get("unsavable-model-call"), f"model called unsavably: {found['unsavable-model-call']}"
    assert not found.get("retention"), f"retention: {found['retention']}"
    assert not found.get("I13"), f"I13 a run stopped on an error: {found['I13']}"
    assert not found.get("I19"), f"I19 a run with no waiter: {found['I19']}"
    assert not found.get("I1"), f"I1/I4 an invalid transcript: {found['I1']}"
    assert not found.get("I2"), f"I2 a stored result ran again: {found['I2']}"
    assert not found.get("I3"), f"I3 a saved turn asked for again: {found['I3']}"
    assert not found.get("I5"), f"I5 an approved call ran twice: {found['I5']}"
    assert not found.get("inputs"), f"input not applied once and in order: {found['inputs']}"
    assert not found.get("step-raised"), f"a step raised: {found['step-raised']}"
    assert not found.get("wrong-answer"), f"an action answered wrongly: {found['wrong-answer']}"
    assert not found.get("unexpected-error"), f"an action raised: {found['unexpected-error']}"
    assert not found.get("unexpected-outcome"), f"a step did what it should not: {found['unexpected-outcome']}"
    assert not found.get("I10"), f"I10 runs did not finish: {found['I10']}"
    assert not found, f"violations: {found}"


@pytest.fixture
def env(
    settings: Settings, store: PostgresCheckpointStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Env]:
    """The services every example shares; the sweep and retention tasks on the test database."""
    with_retention = services.test_settings(retention_days=RETENTION_DAYS)
    leases = LeaseManager(redis_client, 60_000)  # far above a step: only a crash leaves one, and it is dropped
    made = Env(with_retention, store.engine, redis_client, leases, Crashes())
    monkeypatch.setattr(tasks, "settings", with_retention)
    monkeypatch.setattr(tasks, "enqueue", made.enqueue)
    monkeypatch.setitem(tasks._state, "pid", None)
    monkeypatch.setitem(tasks._state, "deps", None)
    with made.crashes.installed(leases):
        yield made
    built = tasks._state.get("deps")
    if built is not None:
        built.heartbeat.stop()
        built.store.engine.dispose()


# The CI profile takes a minute or two (up to five more to shrink what it finds); the long one about an hour.
@pytest.mark.timeout(4 * 3600 if _LONG else 1800)
def test_runs_stay_safe_and_finish_under_any_interleaving_of_producers_steps_crashes_and_sweeps(env: Env) -> None:
    # Hypothesis takes any callable that makes the machine (its annotation names the class only).
    factory = cast(type[Interleavings], lambda: Interleavings(env))
    run_state_machine_as_test(factory, settings=_profile())
