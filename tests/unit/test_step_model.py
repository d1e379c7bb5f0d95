"""T0: ``run_step`` driven by random command lists over the in-memory store and leases.

Commands deliver step messages (in any order, duplicated or stale), crash a step at any crash
point, freeze a step past its lease while another worker takes the run over, lose every lease key,
fail the model, move the fake clock and sweep. After every command the safety invariants hold
(I1 results in call order, I2 no re-execution of a recorded result, I3 no regenerated turn, I4 valid
transcripts only, I7 contiguous history with rising fences); once the faults stop, every run
finishes (liveness). ``LOUSHO_T0_EXAMPLES`` sets the number of examples, ``LOUSHO_T0_EXPLORE=1``
draws new ones instead of the fixed derandomized set.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from store import errors
from store.memory import MemoryCheckpointStore, MemoryLeaseManager
from store.records import Checkpoint, Claim, Message
from tests.fakes.clock import FakeClock
from tests.fakes.crash import Crashes, SimulatedCrash
from tests.fakes.model import RecordingModel
from tests.fakes.queue import StepMessage
from tests.fakes.runtime import MemoryRuntime
from tests.fakes.stall import WAIT_S, Gate, StepThread
from worker import machine
from worker.agents import Agent, Tool, ToolContext
from worker.providers import MockModel
from worker.steps import Outcome

RUNS = ("t0-a", "t0-b", "t0-c")
AGENT = "t0"
TTL_MS = 2000
STALE_S = 2.0
MAX_ATTEMPTS = 5
#: Faults (crashes, stalls, model failures) per run; below MAX_ATTEMPTS, so no run is parked by design.
FAULT_BUDGET = 3
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
)
#: Deliveries allowed to finish every run once the commands are done (far above what they need).
MAX_SETTLE_DELIVERIES = 500
EXAMPLES = int(os.environ.get("LOUSHO_T0_EXAMPLES", "300"))


# -- commands --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """A producer sends to a run: its starting message again, or a follow-up."""

    run: int
    text: Literal["start", "more"]


@dataclass(frozen=True)
class Deliver:
    """A worker takes one queued message (any of them); ``keep_copy`` leaves a duplicate queued."""

    pick: int
    keep_copy: bool


@dataclass(frozen=True)
class Crash:
    """The next step of a run that reaches ``point`` dies there; the broker may hand its message out again."""

    run: int
    point: str
    redeliver: bool


@dataclass(frozen=True)
class Stall:
    """A step freezes at its first model or tool call (``at``) past its lease. Another worker may take the run
    over and finish its step (``done``) or freeze in turn after its claim (``frozen``), before the
    first one wakes up."""

    run: int
    at: Literal["model", "tool"]
    takeover: Literal["none", "done", "frozen"]
    lose_lease_keys: bool


@dataclass(frozen=True)
class FailModel:
    """The provider fails the run's next model call (retryable)."""

    run: int


@dataclass(frozen=True)
class LoseLeaseKeys:
    """The lease service restarts empty: every lease and fencing counter is gone."""


@dataclass(frozen=True)
class Advance:
    """Time passes."""

    ms: int


@dataclass(frozen=True)
class Sweep:
    """The recover sweep re-enqueues runs that stopped moving and hold no lease."""


Command = Send | Deliver | Crash | Stall | FailModel | LoseLeaseKeys | Advance | Sweep

_RUN_INDEX = st.integers(0, len(RUNS) - 1)
_PICK = st.integers(0, 31)
COMMANDS = st.one_of(
    st.builds(Deliver, pick=_PICK, keep_copy=st.booleans()),
    st.builds(Deliver, pick=_PICK, keep_copy=st.just(False)),
    st.builds(Deliver, pick=st.just(0), keep_copy=st.just(False)),
    st.builds(Crash, run=_RUN_INDEX, point=st.sampled_from(CRASH_POINTS), redeliver=st.booleans()),
    st.builds(
        Stall,
        run=_RUN_INDEX,
        at=st.sampled_from(["model", "tool"]),
        takeover=st.sampled_from(["none", "done", "frozen"]),
        lose_lease_keys=st.booleans(),
    ),
    st.builds(Send, run=_RUN_INDEX, text=st.sampled_from(["start", "more"])),
    st.builds(FailModel, run=_RUN_INDEX),
    st.just(LoseLeaseKeys()),
    st.builds(Advance, ms=st.sampled_from([10, 500, TTL_MS + 1, int(STALE_S * 1000) + TTL_MS])),
    st.just(Sweep()),
)
#: Per run, how many calls each model turn asks for before the final answer.
PLANS = st.lists(st.integers(1, 3), min_size=1, max_size=3)


# -- the world ---------------------------------------------------------------------------------------


def _note(what: str) -> None:
    """Count ``what`` in Hypothesis's statistics (when running under Hypothesis)."""
    if currently_in_test_context():
        event(what)


class _StepContext(threading.local):
    """What the step running on this thread is: its run, the seq it loaded, and a stall to hit."""

    session_id: str = ""
    base_seq: int = -1
    gate: Gate | None = None
    stall_at: str = ""


_STEP = _StepContext()


class _ObservedStore(MemoryCheckpointStore):
    """Notes the seq each step loaded, so model and tool logs can say which checkpoint they came from."""

    def claim(self, session_id: str, token: int, seq: int | None, *, again: bool = False) -> Claim:
        claim = super().claim(session_id, token, seq, again=again)
        if claim.checkpoint is not None:
            _STEP.base_seq = claim.checkpoint.seq
        return claim


@dataclass
class _Seen:
    """What the checker has read of one run's history so far."""

    seq: int = 0
    fence: int = 0
    result_seq: dict[str, int] = field(default_factory=dict)
    turn_seq: dict[int, int] = field(default_factory=dict)


class World:
    """Three runs of one agent on one in-memory runtime, and everything that happened to them."""

    def __init__(self, plans: tuple[list[int], ...]) -> None:
        self.plans = dict(zip(RUNS, plans, strict=True))
        self.clock = FakeClock()
        self.model = RecordingModel(MockModel(self._answer), observe=self._observe)
        agent = Agent(
            AGENT,
            self.model,
            instructions="Work through the plan.",
            max_steps=50,
            tool_concurrency=1,
            tools=[Tool(self._work, name="work"), Tool(self._fail, name="fail")],
        )
        self.leases = MemoryLeaseManager(TTL_MS, self.clock)
        self.runtime = MemoryRuntime.build(
            [agent],
            store=_ObservedStore(history_limit=100_000, clock=self.clock),
            clock=self.clock,
            leases=self.leases,
            max_attempts=MAX_ATTEMPTS,
        )
        self.store, self.queue = self.runtime.store, self.runtime.queue
        self.crashes = Crashes()
        self.redeliver: dict[str, bool] = {}
        self.stalls: dict[str, Stall] = {}
        self.faults: Counter[str] = Counter()
        self.model_failures: Counter[str] = Counter()
        self.executions: list[tuple[str, str, int]] = []
        self.seen = {sid: _Seen() for sid in RUNS}
        self.checked_executions = 0
        self.checked_model_calls = 0

    # -- the agent's model and tools ----------------------------------------------------------

    def _observe(self) -> dict[str, Any]:
        return {"session_id": _STEP.session_id, "base_seq": _STEP.base_seq}

    def _answer(self, messages: list[Message]) -> Any:
        sid = _STEP.session_id
        self._maybe_stall("model")
        if self.model_failures[sid]:
            self.model_failures[sid] -= 1
            raise errors.ProviderError("503 from the fake provider", retryable=True)
        users = sum(1 for m in messages if m.role == "user")
        since = 0
        for message in reversed(messages):
            if message.role == "user":
                break
            since += message.role == "assistant"
        plan = self.plans[sid]
        if since < len(plan):
            return {
                "tool_calls": [
                    {
                        "id": f"{sid}-u{users}-t{since}-c{k}",
                        "name": "fail" if (since + k) % 3 == 2 else "work",
                        "args": {"n": k},
                    }
                    for k in range(plan[since])
                ]
            }
        return f"{sid}: done with message {users}"

    def _work(self, n: int, ctx: ToolContext) -> str:
        self.executions.append((ctx.session_id, ctx.tool_call_id, ctx.checkpoint_seq))
        self._maybe_stall("tool")
        return f"work {n} done"

    def _fail(self, n: int, ctx: ToolContext) -> str:
        self.executions.append((ctx.session_id, ctx.tool_call_id, ctx.checkpoint_seq))
        self._maybe_stall("tool")
        raise RuntimeError(f"fail {n} failed")

    @staticmethod
    def _maybe_stall(where: str) -> None:
        if _STEP.gate is not None and _STEP.stall_at == where:
            gate, _STEP.gate = _STEP.gate, None
            gate.pass_through()

    # -- commands ---------------------------------------------------------------------------------

    def start(self) -> None:
        for index, _ in enumerate(RUNS):
            self.apply(Send(index, "start"))

    def apply(self, command: Command) -> None:  # noqa: C901 - one branch per command of the state machine
        _note(type(command).__name__)
        if isinstance(command, Send):
            self.runtime.send(RUNS[command.run], AGENT, f"{command.text} for {RUNS[command.run]}")
        elif isinstance(command, Deliver):
            if self.queue.messages:
                message = self.queue.pop(command.pick % len(self.queue))
                if command.keep_copy:
                    self.queue.messages.append(message)
                self._deliver(message)
        elif isinstance(command, Crash):
            sid = RUNS[command.run]
            if self.faults[sid] < FAULT_BUDGET:
                self.faults[sid] += 1
                self.crashes.arm(command.point, sid)
                self.redeliver[sid] = command.redeliver
        elif isinstance(command, Stall):
            sid = RUNS[command.run]
            if self.faults[sid] < FAULT_BUDGET and sid not in self.stalls:
                self.faults[sid] += 1
                self.stalls[sid] = command
        elif isinstance(command, FailModel):
            sid = RUNS[command.run]
            if self.faults[sid] < FAULT_BUDGET:
                self.faults[sid] += 1
                self.model_failures[sid] += 1
        elif isinstance(command, LoseLeaseKeys):
            self.leases.flush_all()
        elif isinstance(command, Advance):
            self.clock.advance(ms=command.ms)
        else:
            self.runtime.sweep(STALE_S)

    def _step(self, session_id: str, seq: int | None, gate: Gate | None = None, at: str = "") -> Outcome:
        _STEP.session_id, _STEP.base_seq, _STEP.gate, _STEP.stall_at = session_id, -1, gate, at
        try:
            return self.runtime.step(session_id, seq)
        finally:
            _STEP.gate = None

    def _deliver(self, message: StepMessage) -> Outcome | None:
        sid, seq = message.session_id, message.seq
        stored = self.store.load(sid)
        expected = None
        if self.leases.holder(sid) is not None:
            expected = Outcome.BUSY
        elif stored is not None and seq is not None and stored.seq != seq:
            expected = Outcome.STALE
        stall = self.stalls.get(sid)
        if stall is not None and expected is None:
            armed, self.crashes.armed = self.crashes.armed, set()
            try:
                ran_through = self._freeze(sid, seq, stall)
            finally:
                self.crashes.armed |= armed
            if ran_through is None:
                del self.stalls[sid]
            return ran_through
        try:
            outcome = self._step(sid, seq)
        except SimulatedCrash as crash:
            # The worker died: its lease stays until it expires, and the broker may redeliver.
            self.crashes.recovered()
            _note(f"crash at {crash.point}")
            if self.redeliver[sid]:
                self.queue.messages.append(message)
            return None
        assert expected is None or outcome == expected, f"{message}: {outcome} where {expected} was due"
        _note(f"outcome {outcome}")
        return outcome

    def _start_frozen(self, sid: str, seq: int | None, at: str) -> tuple[StepThread, Gate] | Outcome:
        """Start a step that freezes at its first ``at`` call; its outcome if it ran through instead."""
        signal = threading.Event()
        gate = Gate(1, signal=signal)
        step = StepThread(lambda: self._step(sid, seq, gate, at), done=signal)
        step.start()
        assert signal.wait(WAIT_S), "the frozen step neither blocked nor finished"
        if gate.is_blocked():
            return step, gate
        outcome = step.result()
        assert outcome != Outcome.BUSY, "a step found the run busy though no lease was live"
        return outcome

    def _freeze(self, sid: str, seq: int | None, command: Stall) -> Outcome | None:
        """Deliver a step that freezes past its lease; None once it froze, else its outcome."""
        first = self._start_frozen(sid, seq, command.at)
        if isinstance(first, Outcome):
            return first  # it never reached the call: the stall stays armed
        frozen, gate = first
        if command.lose_lease_keys:
            self.leases.flush_all()
        self.clock.advance(ms=TTL_MS + 1)  # no heartbeat renews a frozen step's lease
        second: tuple[StepThread, Gate] | Outcome | None = None
        if command.takeover == "done":
            self._step(sid, self._seq(sid))
        elif command.takeover == "frozen":
            second = self._start_frozen(sid, self._seq(sid), command.at)
        before_wake = self.store.load(sid)
        gate.release()
        outcome = frozen.result()
        _note(f"stall at {command.at}, takeover {command.takeover} -> {outcome}")
        if command.takeover != "none":
            # I7: the frozen holder's late writes are refused and leave no trace, even when the
            # new holder has claimed the run but not saved anything yet.
            assert outcome == Outcome.FENCED, f"a stalled holder of {sid} was not fenced: {outcome}"
            assert self.store.load(sid) == before_wake, f"the stalled holder of {sid} changed the run"
        if isinstance(second, tuple):
            second[1].release()
            second[0].result()
        return None

    def _seq(self, sid: str) -> int:
        checkpoint = self.store.load(sid)
        assert checkpoint is not None
        return checkpoint.seq

    # -- invariants --------------------------------------------------------------------------------

    def check(self) -> None:
        for sid in RUNS:
            checkpoint = self.store.load(sid)
            if checkpoint is not None:
                self._check_run(sid, checkpoint)
        for sid, call_id, base in self.executions[self.checked_executions :]:
            recorded = self.seen[sid].result_seq.get(call_id)
            assert recorded is None or base < recorded, (
                f"I2: {call_id} executed from seq {base} though its result was saved at seq {recorded}"
            )
        self.checked_executions = len(self.executions)
        for call in self.model.calls[self.checked_model_calls :]:
            sid, base = call.context["session_id"], call.context["base_seq"]
            assert call.problems == [], f"I4: {sid} model got an invalid transcript: {call.problems}"
            recorded = self.seen[sid].turn_seq.get(call.assistant_turns)
            assert recorded is None or base < recorded, (
                f"I3: {sid} turn {call.assistant_turns} generated from seq {base}, saved at seq {recorded}"
            )
        self.checked_model_calls = len(self.model.calls)

    def _check_run(self, sid: str, checkpoint: Checkpoint) -> None:
        seen = self.seen[sid]
        assert checkpoint.seq >= seen.seq, f"I7: {sid} seq went back from {seen.seq} to {checkpoint.seq}"
        if checkpoint.seq > seen.seq:
            entries = list(reversed(self.store.history(sid, limit=checkpoint.seq - seen.seq)))
            assert [e.seq for e in entries] == list(range(seen.seq + 1, checkpoint.seq + 1)), (
                f"I7: {sid} history is not contiguous after seq {seen.seq}: {[e.seq for e in entries]}"
            )
            for entry in entries:
                fence = entry.checkpoint.fence
                assert fence >= seen.fence, f"I7: {sid} fence fell from {seen.fence} to {fence} at seq {entry.seq}"
                seen.fence = fence
                turns = 0
                for message in entry.checkpoint.messages:
                    if message.role == "tool" and message.tool_call_id is not None:
                        seen.result_seq.setdefault(message.tool_call_id, entry.seq)
                    elif message.role == "assistant":
                        seen.turn_seq.setdefault(turns, entry.seq)
                        turns += 1
            seen.seq = checkpoint.seq
        # I1 so far: each call has at most one result, in call order, with nothing else in between.
        completed = checkpoint
        for call in checkpoint.pending_tool_calls:
            completed = machine.record_tool_result(completed, Message(role="tool", tool_call_id=call.id))
        problems = machine.transcript_problems(completed.messages)
        assert problems == [], f"I1: {sid} transcript: {problems}"

    # -- liveness ------------------------------------------------------------------------------------

    def settle(self) -> None:
        """Deliver everything, sweep when idle, until every run has finished.

        Crashes still armed may fire here: the fault budget bounds them, so the runs must finish anyway.
        """
        deliveries = 0
        for _ in range(60):
            while self.queue.messages and deliveries < MAX_SETTLE_DELIVERIES:
                self._deliver(self.queue.pop())
                deliveries += 1
            if all(self._settled(sid) for sid in RUNS):
                return
            self.clock.advance(ms=TTL_MS + int(STALE_S * 1000) + 1)
            self.runtime.sweep(STALE_S)
        stuck = {sid: self.store.load(sid) for sid in RUNS if not self._settled(sid)}
        raise AssertionError(
            "I10: runs did not finish: "
            + "; ".join(
                f"{sid} status={c.status} seq={c.seq} attempts={c.attempts} last_error={c.last_error}"
                for sid, c in stuck.items()
                if c is not None
            )
        )

    def _settled(self, sid: str) -> bool:
        checkpoint = self.store.load(sid)
        return (
            checkpoint is not None
            and checkpoint.status == "finished"
            and checkpoint.last_error is None
            and self.store.inbox(sid, checkpoint.inbox_cursor) == []
        )

    def check_finished(self) -> None:
        for sid in RUNS:
            checkpoint = self.store.load(sid)
            assert checkpoint is not None and checkpoint.pending_tool_calls == []
            assert machine.transcript_problems(checkpoint.messages) == [], f"I1: {sid} final transcript"
            assert checkpoint.final_text is not None and checkpoint.final_text.startswith(sid)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    print_blob=True,
    derandomize=os.environ.get("LOUSHO_T0_EXPLORE") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(plans=st.tuples(PLANS, PLANS, PLANS), commands=st.lists(COMMANDS, min_size=5, max_size=50))
def test_runs_stay_safe_and_finish_under_duplicates_crashes_stalls_and_lost_leases(
    plans: tuple[list[int], ...], commands: list[Command]
) -> None:
    world = World(plans)
    with world.crashes.installed(world.leases):
        world.start()
        for command in commands:
            world.apply(command)
            world.check()
        world.settle()
        world.check()
        world.check_finished()
