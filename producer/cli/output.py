"""What the ``lousho`` commands print: JSON with ``--json``, lines otherwise, errors with their code, run events.

It also owns the ``--json`` option itself: a command either honours it or refuses it as a usage error.
It must not call the client beyond waiting on a ``Run`` it is handed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from producer.client import Run
from store import errors, redaction
from store.events import Event

#: How much of a tool call's arguments, and of a result or message, an event line shows.
_ARGS_CHARS = 120
_RESULT_CHARS = 200


def print_json(value: Any) -> None:
    """Print ``value`` as indented JSON (datetimes and other odd values as strings)."""
    print(json.dumps(value, indent=2, default=str))


def print_error(error: errors.LoushoError, as_json: bool) -> None:
    """Print a Lousho error, masked: ``{"error": {code, message, retryable}}`` on stdout, else a line on stderr."""
    message = redaction.redact(error.message)
    if as_json:
        print_json({"error": {"code": error.code, "message": message, "retryable": error.retryable}})
    else:
        print(f"error {error.code}: {message}", file=sys.stderr)


def print_settled(run: Run, args: argparse.Namespace, prefix: str = "") -> int:
    """Wait for ``run`` (``--timeout``) and print how it settled: the result as JSON, or a line and the final text.

    Raises:
        RunTimeoutError: it did not settle in time.
        LoushoError: the typed error the run stopped with.
    """
    result = run.wait(timeout=args.timeout)
    if args.json:
        print_json(result.model_dump(mode="json", exclude_none=True))
    else:
        print(f"{prefix}{result.session_id}: {result.finish_reason} after {result.steps} step(s)")
        if result.text:
            print(result.text)
    return 0


def accept_json(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give a command that can print JSON its ``--json`` option; returns the parser."""
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


class _RefuseJson(argparse.Action):
    """``--json`` on a command that cannot honour it: a usage error (exit status 2), never ignored."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"--json is not supported here: {self.reason}")


def refuse_json(parser: argparse.ArgumentParser, reason: str) -> argparse.ArgumentParser:
    """Make ``--json`` a usage error on a command whose output is a log (a long-running command); returns the parser."""
    parser.add_argument("--json", action=_RefuseJson, reason=reason)
    return parser


def _one_line(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _duration(ms: Any) -> str:
    if not isinstance(ms, int | float):
        return ""
    return f" in {ms:.0f} ms" if ms < 10_000 else f" in {ms / 1000:.1f} s"


#: Reads which of some approvals were decided: approval id -> status, the undecided ones left out.
Decided = Callable[[Sequence[str]], dict[str, str]]

#: What each outcome of a ``tool.reconcile`` event means, as ``lousho watch`` says it.
_RECONCILED = {
    "happened": "it took effect",
    "not-happened": "it did not take effect; it runs again",
    "not-done": "recorded as not done",
    "failed": "reconcile failed; it is retried",
    "asked": "a person decides",
}


class EventPrinter:
    """Prints events as lines for a person: model text as it streams, tool calls with their durations.

    With ``decided``, an approval that was decided since its event was saved is shown with its decision, without
    the way to decide it (which would now fail).
    """

    def __init__(self, out: TextIO, decided: Decided | None = None) -> None:
        self.out = out
        self.decided = decided
        #: Streamed text was written without its line being ended.
        self.open_line = False
        #: The text streamed (``text.delta``) since the last ``step.done``.
        self.streamed: list[str] = []
        #: The text of the last step printed (the result repeats it only when it differs).
        self.last_text: str | None = None
        self.calls: dict[str, str] = {}

    def show(self, event: Event) -> None:
        """Print one event (a type this version does not know is printed as its JSON)."""
        handler: Callable[[dict[str, Any]], None] | None = getattr(self, "_on_" + event.type.replace(".", "_"), None)
        if handler is None:
            self.line(f"{event.type}: {_one_line(event.data, _RESULT_CHARS)}")
        else:
            handler(event.data)
        self.out.flush()

    def line(self, text: str) -> None:
        """Print a line, after ending streamed text."""
        self.end_stream()
        self.out.write(text + "\n")

    def end_stream(self) -> None:
        """End the line of streamed text, if one is open."""
        if self.open_line:
            self.out.write("\n")
            self.open_line = False

    def _call(self, call_id: Any, name: Any) -> str:
        return self.calls.get(str(call_id)) or f"{name}(...)"

    def _on_run_start(self, data: dict[str, Any]) -> None:
        how = "resumed" if data.get("resumed") else f"input {data.get('input_number')}"
        self.line(f"-- {how} (agent {data.get('agent')})")

    def _on_step_start(self, data: dict[str, Any]) -> None:
        self.end_stream()
        self.streamed = []

    def _on_text_delta(self, data: dict[str, Any]) -> None:
        text = str(data.get("text") or "")
        if text:
            self.out.write(text)
            self.open_line = not text.endswith("\n")
            self.streamed.append(text)

    def _on_step_done(self, data: dict[str, Any]) -> None:
        text = data.get("text")
        self.end_stream()
        if text and "".join(self.streamed) != text:
            # Nothing streamed, or only part of it (the watch began mid-turn, or signals were lost): the whole text.
            self.line(str(text))
        self.streamed, self.last_text = [], text or self.last_text
        for call in data.get("tool_calls") or ():
            self.calls[str(call.get("id"))] = f"{call.get('name')}({_one_line(call.get('args') or {}, _ARGS_CHARS)})"

    def _on_tool_start(self, data: dict[str, Any]) -> None:
        call = f"{data.get('tool_name')}({_one_line(data.get('args') or {}, _ARGS_CHARS)})"
        self.calls[str(data.get("tool_call_id"))] = call
        self.line(f"tool {call} ...")

    def _on_tool_partial(self, data: dict[str, Any]) -> None:
        return None

    def _on_tool_done(self, data: dict[str, Any]) -> None:
        call = self._call(data.get("tool_call_id"), data.get("tool_name"))
        self.line(
            f"tool {call} done{_duration(data.get('duration_ms'))}: {_one_line(data.get('result'), _RESULT_CHARS)}"
        )

    def _on_tool_error(self, data: dict[str, Any]) -> None:
        call = self._call(data.get("tool_call_id"), data.get("tool_name"))
        self.line(
            f"tool {call} failed ({data.get('kind') or 'error'}){_duration(data.get('duration_ms'))}: "
            f"{_one_line(data.get('result'), _RESULT_CHARS)}"
        )

    def _decisions(self, approval_ids: Sequence[Any]) -> dict[str, str]:
        ids = [str(approval_id) for approval_id in approval_ids if approval_id]
        return self.decided(ids) if self.decided is not None and ids else {}

    def _on_tool_reconcile(self, data: dict[str, Any]) -> None:
        call = self._call(data.get("tool_call_id"), data.get("tool_name"))
        found = _RECONCILED.get(str(data.get("outcome")), str(data.get("outcome")))
        self.line(
            f"tool {call} was interrupted by a crash: {found} (found by {data.get('by')},"
            f" attempt {data.get('attempt')})"
        )

    def _on_approval_requested(self, data: dict[str, Any]) -> None:
        approval_id = data.get("approval_id")
        call = f"{data.get('tool_name')}({_one_line(data.get('args') or {}, _ARGS_CHARS)})"
        if data.get("kind") == "reconcile":
            self.line(f"reconciliation {approval_id} needed for {call}: {_one_line(data.get('question'), 200)}")
            self.line(
                f"  decide with: lousho approvals answer {approval_id} RESULT  (it took effect), approve"
                f" {approval_id}  (run it again) or reject {approval_id}  (not done)"
            )
            return
        decision = self._decisions([approval_id]).get(str(approval_id))
        if decision is not None:
            self.line(f"approval {approval_id} for {call}: {decision}")
            return
        self.line(f"approval {approval_id} needed for {call}")
        self.line(f"  decide with: lousho approvals approve {approval_id}  (or: lousho approvals reject {approval_id})")

    def _on_agent_drift(self, data: dict[str, Any]) -> None:
        changed = {key: value for key, value in data.items() if value}
        self.line(f"agent changed since the run started: {_one_line(changed, _RESULT_CHARS)}")

    def _on_provider_retry(self, data: dict[str, Any]) -> None:
        delay = data.get("delay_s")
        when = f"; next attempt in {delay:.1f} s" if isinstance(delay, int | float) else ""
        self.line(
            f"provider failed ({data.get('code')}, failure {data.get('failures')}): "
            f"{_one_line(data.get('message'), _RESULT_CHARS)}{when}"
        )

    def _on_error(self, data: dict[str, Any]) -> None:
        again = " (retried)" if data.get("retryable") else ""
        self.line(f"error {data.get('code')}{again}: {_one_line(data.get('message'), _RESULT_CHARS)}")

    def _on_run_done(self, data: dict[str, Any]) -> None:
        usage = data.get("usage") or {}
        tokens = (
            (
                f"; tokens {usage.get('input_tokens', 0)} in, {usage.get('output_tokens', 0)} out, "
                f"{usage.get('total_tokens', 0)} total"
            )
            if usage
            else ""
        )
        self.line(f"== {data.get('finish_reason')} after {data.get('steps')} step(s){tokens}")
        text = data.get("text")
        if text and text != self.last_text:
            self.line(str(text))
        ids = [str(approval_id) for approval_id in data.get("approval_ids") or []]
        if data.get("finish_reason") == "awaiting-approval" and ids:
            waiting = [approval_id for approval_id in ids if approval_id not in self._decisions(ids)]
            if waiting:
                self.line(f"waiting on approval {', '.join(waiting)}")
            else:
                self.line(f"decided since: {', '.join(ids)}; the run went on")
