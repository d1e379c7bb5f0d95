"""``lousho approvals list|approve|reject|answer``: decisions on gated calls, questions and reconciliations.

It calls ``Approvals`` of the client and prints; it must not decide anything itself.
"""

from __future__ import annotations

import argparse
import json

from producer.cli.output import accept_json, print_json, print_settled
from producer.client import Client
from store import errors


def cmd_approvals(client: Client, args: argparse.Namespace) -> int:
    """``lousho approvals list``, ``approve ID``, ``reject ID`` (declines a question) or ``answer ID TEXT``.

    A reconciliation (a ``once`` call its worker died in) is approved (run again), rejected (not done) or answered
    (it took effect; the text is its result).

    ``list`` shows pending decisions, oldest first, with the time each expires at (when it does);
    ``--wait`` waits for the run after a decision.

    Raises:
        ConfigurationError: a decision without an approval id, an answer without text or for a gated tool call.
        ApprovalNotFoundError: unknown, already decided, or of another agent (``--agent``).
        ApprovalExpiredError: it expired undecided; it was recorded as rejected (``main`` prints the code, exit 1).
        ApprovalOrphanedError: the approval's run was deleted or replaced.
    """
    approvals = client.agent(args.agent).approvals if args.agent else client.approvals
    if args.action == "list":
        pending = approvals.list()
        if args.json:
            print_json([a.model_dump(mode="json", exclude={"fingerprint"}) for a in pending])
            return 0
        if not pending:
            print("no pending approvals")
        for a in pending:
            created = a.created_at.isoformat() if a.created_at else "-"
            expiry = f"  expires {a.expires_at.isoformat()}" if a.expires_at else ""
            if a.kind == "question":
                choices = f"  options {json.dumps(a.options)}" if a.options else ""
                print(
                    f"{a.approval_id}  {a.agent}  {a.session_id}  question: {a.question}{choices}"
                    f"  since {created}{expiry}"
                )
                continue
            if a.kind == "reconcile":
                # A once call its worker died in: approve runs it again, reject records it as not done, answer
                # records the text as its result.
                print(
                    f"{a.approval_id}  {a.agent}  {a.session_id}  reconcile: {a.tool_name}({json.dumps(a.args)})"
                    f"  call {a.tool_call_id}  since {created}  (approve: run again; reject: not done;"
                    " answer ID TEXT: it took effect, with TEXT as its result)"
                )
                continue
            print(
                f"{a.approval_id}  {a.agent}  {a.session_id}  {a.tool_name}({json.dumps(a.args)})"
                f"  call {a.tool_call_id}  since {created}{expiry}"
            )
        return 0
    if not args.approval_id:
        raise errors.ConfigurationError(f"approvals {args.action} needs an approval id")
    if args.action == "answer":
        if args.text is None:
            raise errors.ConfigurationError("approvals answer needs the answer's text")
        run = approvals.resolve(args.approval_id, answer=args.text, note=args.note)
    else:
        run = approvals.resolve(args.approval_id, approved=args.action == "approve", note=args.note)
    decision = {"approve": "approved", "reject": "rejected", "answer": "answered"}[args.action]
    if args.wait:
        return print_settled(run, args, prefix=f"{decision} {args.approval_id}; ")
    if args.json:
        print_json({"approval_id": args.approval_id, "decision": decision, "session_id": run.session_id})
    else:
        print(f"{decision} {args.approval_id} (run {run.session_id})")
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho approvals`` to the ``lousho`` parser."""
    approvals = accept_json(
        sub.add_parser(
            "approvals", help="list, approve or reject gated calls; answer questions; decide reconciliations"
        )
    )
    approvals.add_argument("action", choices=["list", "approve", "reject", "answer"])
    approvals.add_argument("approval_id", nargs="?")
    approvals.add_argument("text", nargs="?", help="the answer, or a reconciled call's result (with answer)")
    approvals.add_argument("--note", default=None, help="a note for the model (with approve/reject)")
    approvals.add_argument("--agent", default=None)
    approvals.add_argument("--wait", action="store_true", help="wait for the run to settle again")
    approvals.add_argument("--timeout", type=float, default=60.0)
    approvals.set_defaults(fn=cmd_approvals)
